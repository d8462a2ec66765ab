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


if __name__ == "__main__":
    for key, value in CPU_ENV.items():
        print(f'export {key}="${{{key}:-{value}}}"')
