"""The environment a process needs to import tpu-inference and run JAX on a
machine with no TPU: the CPU backend, and TPU_* values that stop
tpu-inference's import-time cloud-metadata lookups (which hang or fail off
Google Cloud). One definition for conftest.py, the demo, the version matrix
and ./run (`python -m vllm_gemma_qat.cpu.env` prints shell exports that keep
values already set). Imports nothing, so it can run first."""

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


if __name__ == "__main__":
    for key, value in CPU_ENV.items():
        print(f'export {key}="${{{key}:-{value}}}"')
