"""Opt-in CPU mode: `vllm serve` through tpu-inference's runner and JAX model
on JAX's CPU backend, for tests and demos on machines without a TPU.

Active only with VLLM_GEMMA_QAT_CPU_MODE=1 (and JAX_PLATFORMS=cpu, on a
machine with no TPU device). It substitutes only what is TPU-only, each entry
of `substitutions()` in this order:

- `compiler_options.get_step_fn_compiler_options` / `get_sampling_compiler_
  options`, and the modules that import them by name (`model_loader`,
  `decode_loop`, `sampling`): no TPU-only XLA compiler options.
- `attention_interface.ragged_paged_attention`: the Pallas kernel, by
  `attention.ragged_paged_attention` (pure JAX, same cache layout and
  semantics, per device: tpu-inference's own shard_map runs around it).
- `attention_interface.flash_attention`: the Pallas flash attention that
  Gemma 4's vision tower runs (through `sharded_flash_attention`), by
  `flash_attention.flash_attention` (pure JAX, per device).
- `linear.gmm_v2`: tokamax's int4 matmul kernel, by `gmm.gmm`.
- `Eagle3Proposer._propose`, `DFlashProposer._propose` (speculative
  decoding): the same jit without the TPU-only options it sets inline.
- `tpu_runner.make_optimized_mesh`: a mesh from CPU devices (the original
  sorts devices by TPU coordinates).
- `utils.general_device_put`: copies host arrays first (the CPU backend may
  alias a numpy buffer the runner refills while the last step still runs).
- `utils.get_device_hbm_limit`: a device-memory size for the CPU
  (VLLM_GEMMA_QAT_CPU_MEMORY_GIB, default 0.1), which the original looks up
  by TPU kind.
- `utils.pathways_hbm_usage_gb` (what the devices hold, from live arrays,
  when they report no memory stats): int4 at half a byte a value, as a
  TPU holds it (the CPU backend keeps a byte per value).

`VLLM_GEMMA_QAT_CPU_KERNELS=interpret` runs the real ragged paged attention
and `gmm_v2` kernels in Pallas TPU interpret mode instead of the first and
third stand-in (`interpret.py`: the kernel entry points and the changes to
JAX / tpu-inference internals the interpreter needs, in the same table).

`VLLM_GEMMA_QAT_CPU_BUG=<name>` puts back a wrong variant that no fix
removes, for evidence runs (`bugs.py`).

The list is logged when CPU mode starts; a target missing from the installed
tpu-inference (or JAX) stops it with `substitute.MissingTarget`.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os

# vLLM, JAX and tpu-inference are imported lazily below: `register` runs in
# every vLLM process, and `vllm_gemma_qat.cpu.env` must be importable first.

CPU_MODE_ENV = "VLLM_GEMMA_QAT_CPU_MODE"
CPU_MEMORY_ENV = "VLLM_GEMMA_QAT_CPU_MEMORY_GIB"  # the "HBM" the CPU offers
# Which kernels CPU mode runs: the pure-JAX stand-ins, or the real Pallas
# kernels in TPU interpret mode (slow; tests).
CPU_KERNELS_ENV = "VLLM_GEMMA_QAT_CPU_KERNELS"
CPU_KERNELS = ("stand-in", "interpret")
# Device nodes of a TPU VM (v4: accel, v5e/v6e: vfio).
TPU_DEVICE_GLOBS = ("accel[0-9]*", "vfio/[0-9]*")


def requested() -> bool:
    return os.environ.get(CPU_MODE_ENV, "") == "1"


def register() -> None:
    """`vllm.general_plugins` entry point: CPU mode when requested."""
    if requested():
        enable()


def enable() -> None:
    from vllm_gemma_qat import substitute
    refuse_on_tpu()
    # A warning: CPU mode must be visible wherever it is on (and vLLM's
    # API server loads plugins before it configures its INFO logging).
    substitute.apply(kernel_substitutions() + runtime_substitutions(),
                     f"vllm-gemma-qat CPU mode ({CPU_MODE_ENV}=1, tests and "
                     f"demos only; {CPU_KERNELS_ENV}={kernel_choice()})",
                     level=logging.WARNING)
    from vllm_gemma_qat.cpu import bugs
    bug = bugs.requested()
    if bug:  # an evidence run (tests/test_evidence.py)
        bugs.install(bug)


@contextlib.contextmanager
def kernels(choice: str | None = None):
    """The CPU kernels for the duration of a block: enough to run the model
    in-process (tests, benchmarks; see `testing.runner`). `choice`: as
    VLLM_GEMMA_QAT_CPU_KERNELS (default: that variable, else stand-ins)."""
    from vllm_gemma_qat import substitute
    refuse_on_tpu()
    choice = choice or kernel_choice()
    with substitute.applied(kernel_substitutions(choice),
                            f"vllm-gemma-qat CPU kernels ({choice})"):
        yield


def kernel_choice() -> str:
    """VLLM_GEMMA_QAT_CPU_KERNELS: "stand-in" (the default) or "interpret";
    anything else is an error."""
    choice = os.environ.get(CPU_KERNELS_ENV, "") or CPU_KERNELS[0]
    if choice not in CPU_KERNELS:
        raise ValueError(f"{CPU_KERNELS_ENV}={choice!r}: expected one of "
                         f"{', '.join(CPU_KERNELS)}")
    return choice


def kernel_substitutions(choice: str | None = None) -> list:
    """The TPU-only kernels: pure-JAX equivalents, or ("interpret") the
    real attention and int4 kernels in Pallas TPU interpret mode, after the
    changes to JAX / tpu-inference internals that mode needs (the vision
    tower's flash attention keeps its stand-in either way)."""
    from vllm_gemma_qat.substitute import Substitution
    from vllm_gemma_qat.cpu.attention import ragged_paged_attention
    from vllm_gemma_qat.cpu.flash_attention import flash_attention
    from vllm_gemma_qat.cpu.gmm import gmm
    if (choice or kernel_choice()) == "interpret":
        from vllm_gemma_qat.cpu import interpret
        ragged_paged_attention, gmm = interpret.ragged_paged_attention, \
            interpret.gmm
        why = " (run here by the Pallas TPU interpreter)"
        prefix = interpret.runtime_substitutions()
    else:
        why, prefix = "", []
    return prefix + [
        Substitution("tpu_inference.layers.common.attention_interface:"
                     "ragged_paged_attention", ragged_paged_attention,
                     "the Pallas ragged paged attention kernel is TPU-only"
                     + why),
        Substitution("tpu_inference.layers.common.attention_interface:"
                     "flash_attention", flash_attention,
                     "the Pallas flash attention kernel (Gemma 4's vision "
                     "tower) is TPU-only"),
        Substitution("tpu_inference.layers.common.linear:gmm_v2", gmm,
                     "tokamax's int4 (wNa16) matmul kernel is TPU-only" + why),
    ]


def runtime_substitutions() -> list:
    """What tpu-inference's runner needs besides the kernels."""
    from vllm_gemma_qat.substitute import Substitution
    no_options = "TPU-only XLA compiler options"
    table = [
        # First: sampling builds a jit with these options when imported.
        Substitution("tpu_inference.models.common.compiler_options:"
                     f"{name}", dict, no_options)
        for name in ("get_step_fn_compiler_options",
                     "get_sampling_compiler_options")]
    table += [
        Substitution(f"{module}:{name}", dict, no_options + " (imported by "
                     "name)")
        for module, name in (
            ("tpu_inference.models.common.model_loader",
             "get_step_fn_compiler_options"),
            ("tpu_inference.runner.decode_loop", "get_step_fn_compiler_options"),
            ("tpu_inference.runner.decode_loop",
             "get_sampling_compiler_options"),
            ("tpu_inference.layers.jax.sample.sampling",
             "get_sampling_compiler_options"))]
    # Speculative decoding's proposers jit `_propose` with TPU-only options
    # inline (not through the getters above): the same jit without them.
    table += [
        Substitution(f"tpu_inference.spec_decode.jax.{module}:{cls}._propose",
                     functools.partial(jit_without_compiler_options,
                                       static_argnums=static),
                     no_options + " (speculative decoding's proposer jits "
                     "them inline)", wraps=True)
        for module, cls, static in (("eagle3", "Eagle3Proposer", (0, 7, 8)),
                                    ("dflash", "DFlashProposer", (0, )))]
    budget = int(float(os.environ.get(CPU_MEMORY_ENV, "0.1")) * 2**30)
    return table + [
        Substitution("tpu_inference.runner.tpu_runner:make_optimized_mesh",
                     cpu_mesh, "the original sorts devices by TPU coordinates"),
        Substitution("tpu_inference.utils:general_device_put", copying,
                     "the CPU backend may alias a host buffer the runner "
                     "refills while the last step still runs", wraps=True),
        Substitution("tpu_inference.utils:get_device_hbm_limit",
                     lambda: budget, f"CPU devices have no HBM size "
                     f"({CPU_MEMORY_ENV}: {budget / 2**30:g} GiB)"),
        Substitution("tpu_inference.utils:pathways_hbm_usage_gb",
                     live_bytes_as_on_a_tpu, "the memory CPU devices hold, "
                     "counted from live arrays as the original counts it "
                     "(CPU devices report no usage), but int4 at half a "
                     "byte a value, as TPU HBM holds it (the CPU backend "
                     "keeps a byte per value): the KV cache gets the pages "
                     "it would on a TPU"),
    ]


def live_bytes_as_on_a_tpu(devices) -> list[tuple[int, int]]:
    """tpu_inference.utils.pathways_hbm_usage_gb (bytes, despite its name),
    int4 buffers at half a byte a value."""
    import jax
    from tpu_inference import utils
    used: dict = {}
    seen = set()
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if id(shard.data) in seen:
                continue
            seen.add(id(shard.data))
            nbytes = shard.data.size // 2 if shard.data.dtype.name == "int4" \
                else shard.data.nbytes
            used[shard.data.device] = used.get(shard.data.device, 0) + nbytes
    limit = utils.get_device_hbm_limit()
    return [(used.get(device, 0), limit) for device in devices]


def jit_without_compiler_options(jitted, static_argnums):
    """A proposer's `_propose` jitted as tpu-inference 0.32 jits it
    (`static_argnums`, the KV caches donated, outputs' shardings left to
    XLA) but with no `compiler_options`: its XLA TPU options make the CPU
    backend refuse the program (`No such compile option`)."""
    import jax
    return jax.jit(jitted.__wrapped__, static_argnums=static_argnums,
                   donate_argnames=("kv_caches", ),
                   out_shardings=(None, None))


def cpu_mesh(axis_shapes, axis_names, *, devices=None):
    """`make_optimized_mesh` for CPU devices, which have no TPU coords."""
    import jax
    import numpy as np
    devices = list(devices if devices is not None else jax.devices())
    n = int(np.prod(axis_shapes))
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(axis_shapes),
                             tuple(axis_names))


def copying(device_put):
    """`device_put` that copies numpy inputs first."""

    def put(tensor, *args, **kwargs):
        import jax
        import numpy as np
        tensor = jax.tree_util.tree_map(
            lambda t: np.array(t, copy=True) if isinstance(t, np.ndarray) else t,
            tensor)
        return device_put(tensor, *args, **kwargs)

    return put


def tpu_evidence(environ=os.environ, dev: str = "/dev") -> str | None:
    """Why this looks like a machine where CPU mode must not run, or None.
    Decided without initialising a JAX backend (unsafe in vLLM's API server
    before it starts the engine)."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms != "cpu":
        return f"JAX_PLATFORMS is {platforms!r}, not 'cpu'"
    for pattern in TPU_DEVICE_GLOBS:
        found = sorted(glob.glob(os.path.join(dev, pattern)))
        if found:
            return f"{found[0]} exists (a TPU device)"
    return None


def refuse_on_tpu() -> None:
    reason = tpu_evidence()
    if reason:
        raise RuntimeError(f"vllm-gemma-qat CPU mode refuses to start: "
                           f"{reason}. It must never be active on a TPU; "
                           f"unset {CPU_MODE_ENV}.")
