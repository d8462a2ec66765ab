"""The environment a process needs to import tpu-inference and run JAX on a
machine with no TPU: the CPU backend, and TPU_* values that stop
tpu-inference's import-time cloud-metadata lookups (which hang or fail off
Google Cloud). One definition for conftest.py, the demo, the version matrix
and ./run (`python -m vllm_gemma_qat.cpu.env` prints shell exports that keep
values already set). Imports only the standard library, so it can run
first."""
from pathlib import Path

CPU_ENV = {"JAX_PLATFORMS": "cpu", "TPU_NAME": "cpu-ci",
           "TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_WORKER_ID": "0",
           "HF_HUB_OFFLINE": "1"}


def set_defaults(environ) -> None:
    for key, value in CPU_ENV.items():
        environ.setdefault(key, value)


def compile_cache_env(directory: str) -> dict[str, str]:
    """JAX's persistent compilation cache in `directory` for every compile,
    however quick, shared by the processes that get this environment (a
    test run: in-process models and `vllm serve`, whose runner points JAX
    at VLLM_XLA_CACHE_PATH). Tiny models compile in milliseconds, below
    JAX's default 1 s threshold, and under other load formats than gemma_qat
    tpu-inference clears JAX's in-memory caches after each module it loads
    (gemma_qat: once per load, fixes/compile_once.py), so without this such a
    load compiles the same few small programs again for every module. No
    size cap: with one, JAX rescans the whole directory on every write. A
    reader that meets an entry still being written gets a warning and
    compiles (entries are compressed; the key is the program's hash)."""
    return {"JAX_COMPILATION_CACHE_DIR": directory,
            "VLLM_XLA_CACHE_PATH": directory,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


MACHINE_CACHE_LIMIT_BYTES = 4 << 30


def machine_compile_cache(parent) -> Path:
    """The compilation cache a machine's test runs share, in `parent` (the
    model cache, outside any clone): `xla-<jax>-<jaxlib>`. JAX keys each
    entry by the program's HLO, its compile options, XLA_FLAGS and the
    jax / jaxlib / backend versions, so an entry an earlier commit wrote
    serves only the same program compiled the same way. The directories of
    other jax versions are removed; one grown past 4 GiB is emptied (JAX's
    own size cap rescans the directory on every write)."""
    import shutil
    from importlib.metadata import version
    parent = Path(parent)
    current = parent / f"xla-{version('jax')}-{version('jaxlib')}"
    for other in parent.glob("xla-*"):
        if other != current:
            shutil.rmtree(other, ignore_errors=True)
    if current.is_dir() and sum(f.stat().st_size for f in current.iterdir()
                                if f.is_file()) > MACHINE_CACHE_LIMIT_BYTES:
        shutil.rmtree(current, ignore_errors=True)
    current.mkdir(parents=True, exist_ok=True)
    return current


if __name__ == "__main__":
    for key, value in CPU_ENV.items():
        print(f'export {key}="${{{key}:-{value}}}"')
