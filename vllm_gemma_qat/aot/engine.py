"""The engine's start-up, run for a TPU topology on a machine without one.

`start` runs what `vllm serve` runs in its engine core before it serves:
vLLM's `UniProcExecutor` starts tpu-inference's `TPUWorker` (on the
topology's chips, as libtpu describes them), which builds the runner and
the model; then `EngineCore._initialize_kv_caches`: the KV cache specs the
runner declares (gemma_qat's included), tpu-inference's
`determine_available_memory` (HBM x utilization minus what the chips
hold), vLLM's `get_kv_cache_configs`, the runner's sampling precompile
before the KV cache and its `capture_model` after. Every program the
runner hands `CompilationManager._run_compilation` is lowered and compiled
by libtpu for the topology and recorded under the runner's own name and
signature, as its `Precompile NAME --> {...}` log line names it. Nothing
executes: there is no TPU.

What it changes to run without a TPU, only while it runs:
- `TPUWorker.__init__`: its devices are the topology's (the worker would
  take `jax.devices()`, the host's CPU).
- `tpu_inference.utils.general_device_put` (behind `device_array`): an
  abstract array (shape, dtype, sharding) in place of a transfer.
- `compilation_manager.jnp`: its dummy values (`jnp.ones` / `zeros` /
  `array`, all made outside a trace) on the host, numpy's.
- `tpu_inference.utils.hbm_usage_bytes`: per chip, the bytes the runner's
  abstract arrays hold and the chip's HBM (a TPU reports them).
- `CompilationManager._run_compilation`: lower and compile, record; a
  function that is not a jit (the runner compiles it by calling it in its
  warm-up) is compiled as the jit that call reaches: the step jit that
  `get_flax_model`'s `model_fn` resolves; the jit a proposer's method
  calls after its host-side prologue; else `jax.jit` of the function.
- `CompilationManager._flush_compilations`: no warm-up calls.
- `TPUModelRunner.load_model`: records the runner (for the HBM count).
- `TPUWorker.initialize_from_config`: records the KV cache's config (a
  ValueError before it is a refusal to start, reported as such).
- JAX's `compile_or_get_cached`, while a recorded program compiles: one
  compiled before the same way is answered by what was kept from that
  compile (analyses.py; where JAX's persistent cache is configured).
The scheduler, which `EngineCore.__init__` builds next, is not: it needs
the tokenizer, and compile reads configs only.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from vllm_gemma_qat.aot.analyses import Analyses, Kept
from vllm_gemma_qat.aot.report import ANALYSIS, Program


@dataclass
class Started:
    runner: object | None = None
    kv_cache_config: object | None = None
    programs: list = field(default_factory=list)
    # vLLM's or tpu-inference's refusal to start (no room for the KV cache)
    refused: str | None = None
    # per step program (label): the arguments the compiled program keeps
    # (XLA drops unused ones), see `kept_arguments`
    step_arguments: dict = field(default_factory=dict)


class Recorder:
    """Lowers, compiles and records what the runner precompiles; `select`
    (a Program -> bool) leaves the others out (not compiled, not listed)."""

    def __init__(self, select, log):
        self.select = select
        self.log = log
        self.started = Started()
        self.analyses = Analyses.configured(ANALYSIS)

    @property
    def mesh(self):
        return getattr(self.started.runner, "mesh", None)

    def run_compilation(self, manager, name, fn, *args, call_kwargs=None,
                        warmup_handler=None, aot=True, compile_only=False,
                        **kwargs):
        import jax
        from tpu_inference.runner.compilation_manager import \
            _describe_signature

        from vllm_gemma_qat.substitute import MissingTarget
        prog = Program(name, _describe_signature(kwargs))
        if not self.select(prog):
            return
        call_kwargs = dict(call_kwargs or {})
        while isinstance(fn, functools.partial):  # as the runner unwraps
            args = fn.args + args
            call_kwargs = {**fn.keywords, **call_kwargs}
            fn = fn.func
        started = time.perf_counter()
        self.log(f"compiling {prog.label}")
        try:
            with jax.set_mesh(manager.runner.mesh):
                if not hasattr(fn, "lower"):
                    fn, args, call_kwargs = _the_jit_it_calls(fn, args,
                                                              call_kwargs)
                try:
                    lowered = fn.lower(*args, **call_kwargs)
                except Exception:
                    if compile_only:
                        raise
                    # As the runner does: a jit it cannot lower so (a
                    # bound method's jit) compiles at its warm-up call.
                    call = fn
                    lowered = jax.jit(lambda *a, **kw: call(*a, **kw)).lower(
                        *args, **call_kwargs)
                try:
                    with self.analyses.compiling():
                        compiled = lowered.compile()
                except Kept as kept:
                    compiled = kept
        except MissingTarget:
            raise
        except Exception as e:  # the TPU compiler's error, named
            prog.error = f"{type(e).__name__}: {str(e).strip()[:2000]}"
            prog.compile_s = time.perf_counter() - started
            self.log(f"FAILED {prog.label}: {prog.error.splitlines()[0]}")
        else:
            lowered_shardings = lowered._lowering.compile_args["in_shardings"]
            if isinstance(compiled, Kept):
                prog.replay(compiled.analysis)
                shardings = lowered_shardings
                self.log(f"{prog.label}: as compiled before, in "
                         f"{prog.compile_s:.1f} s (kept analysis)")
            else:
                prog.compile_s = time.perf_counter() - started
                prog.record(compiled)
                shardings = jax.tree.leaves(compiled.input_shardings)
                self.log(f"compiled {prog.label} in {prog.compile_s:.1f} s")
                # A replayed step's arguments are the lowering's shardings:
                # a step is kept only where they are what the compiler
                # chose. Other programs replay their analysis alone (the
                # audio tower's, on host arrays, have no lowered sharding).
                if not prog.is_step or _equivalent(shardings,
                                                   lowered_shardings,
                                                   lowered):
                    self.analyses.write(prog.analysis())
            if prog.is_step:
                self.started.step_arguments[prog.label] = \
                    kept_arguments(lowered, shardings)
        self.started.programs.append(prog)


class _Called(Exception):
    """Stops a warm-up call at the jit it makes (see `_the_jit_it_calls`)."""

    def __init__(self, jit, args, kwargs):
        self.jit, self.args, self.kwargs = jit, args, kwargs


def _the_jit_it_calls(fn, args, call_kwargs):
    """(jit, args, kwargs): the program the runner's warm-up call of `fn`
    (not a jit) would compile.
    - `get_flax_model`'s `model_fn` (it picks the step jit for the KV caches
      it is given): that jit, with the arguments the runner passes.
    - A method whose object's class holds jits (the proposer's `propose`,
      `prepare_inputs`): the method is called, its host-side prologue run,
      until it calls one of them; that call's arguments.
    - Any other function: the function as one jit (the runner's warm-up
      runs its host-side prologue, if any, eagerly: here it is fused)."""
    import jax
    code = getattr(fn, "__code__", None)  # else a callable object
    cells = {} if code is None else dict(zip(
        code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    if "_resolve_step_fn" in cells:
        return cells["_resolve_step_fn"](args[1], True), args, call_kwargs
    if getattr(fn, "__name__", None) == "wrapped_model_fn":
        from vllm_gemma_qat.substitute import MissingTarget
        raise MissingTarget(
            "tpu_inference.models.common.model_loader:get_flax_model's "
            "model_fn no longer resolves its jit through _resolve_step_fn")
    owner = getattr(fn, "__self__", None)
    jits = [] if owner is None else [
        name for name in dir(type(owner))
        if hasattr(getattr(type(owner), name, None), "lower")]
    if jits:
        def stop_at(name):
            def called(*a, **kw):
                raise _Called(getattr(type(owner), name), (owner, *a), kw)
            return called
        own = {name: owner.__dict__[name] for name in jits
               if name in owner.__dict__}
        for name in jits:
            setattr(owner, name, stop_at(name))
        try:
            fn(*args, **call_kwargs)
        except _Called as call:
            return call.jit, call.args, call.kwargs
        finally:
            for name in jits:
                delattr(owner, name)
            owner.__dict__.update(own)
        raise RuntimeError(f"{fn.__qualname__} called none of its class's "
                           f"jits ({', '.join(jits)})")
    return jax.jit(fn), args, call_kwargs


def _kept_args_info(lowered) -> list:
    """(index among the jit's flattened non-static arguments, its
    args_info) for each argument the compiled program keeps. Which ones it
    keeps JAX says only in the lowering's compile arguments
    (`kept_var_idx`)."""
    import jax
    infos = jax.tree.leaves(lowered.args_info)
    return [(i, infos[i])
            for i in sorted(lowered._lowering.compile_args["kept_var_idx"])]


def kept_arguments(lowered, shardings) -> list:
    """(index among the jit's flattened non-static arguments, abstract
    array with the sharding it is compiled for) for each argument the
    compiled program keeps; `shardings`: the compiled program's input
    shardings (those of the kept ones, in order)."""
    import jax
    kept = _kept_args_info(lowered)
    assert len(kept) == len(shardings), (len(kept), len(shardings))
    return [(i, jax.ShapeDtypeStruct(info.shape, info.dtype,
                                     sharding=sharding))
            for (i, info), sharding in zip(kept, shardings)]


def _equivalent(compiled_shardings, lowered_shardings, lowered) -> bool:
    """Whether the compiled program's input shardings are the lowering's
    (for the arguments it keeps)."""
    kept = _kept_args_info(lowered)
    return len(compiled_shardings) == len(lowered_shardings) == len(kept) \
        and all(hasattr(b, "is_equivalent_to")
                and a.is_equivalent_to(b, len(info.shape))
                for a, b, (_, info) in zip(compiled_shardings,
                                           lowered_shardings, kept))


def _abstract(tree, sharding, mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    if isinstance(sharding, PartitionSpec):  # as device_put: the mesh's
        sharding = NamedSharding(mesh, sharding)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        tree)


class HostJnp:
    """jax.numpy, but `ones`, `zeros` and `array` called outside a trace
    are numpy's (the same values on the host); inside one, jax.numpy's."""

    def __getattr__(self, name):
        import jax.numpy as jnp
        return getattr(jnp, name)

    @staticmethod
    def _made(name, *args, **kwargs):
        import jax.numpy as jnp
        import numpy as np
        from jax._src import core
        on_host = core.trace_state_clean()
        return getattr(np if on_host else jnp, name)(*args, **kwargs)

    def ones(self, shape, dtype=None):
        return self._made("ones", shape, dtype=dtype)

    def zeros(self, shape, dtype=None):
        return self._made("zeros", shape, dtype=dtype)

    def array(self, value, dtype=None):
        return self._made("array", value, dtype=dtype)


def unique_leaves(tree) -> list:
    """The tree's leaves, each array once (a leaf shared by two parts, the
    target's embedding in the drafter's state, is one buffer)."""
    import jax
    seen, out = set(), []
    for x in jax.tree.leaves(tree):
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def bytes_per_device(arrays) -> dict:
    """device id -> bytes of the arrays' shards on it (int4: two a byte)."""
    import jax
    import numpy as np
    held: dict = {}
    for x in unique_leaves(arrays):
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            continue
        shard = sharding.shard_shape(x.shape)
        size = int(np.prod(shard)) * x.dtype.itemsize \
            if x.dtype.name != "int4" else int(np.prod(shard)) // 2
        for device in sharding.device_set:
            held[device.id] = held.get(device.id, 0) + size
    return held


def bytes_on(arrays, device_id) -> int:
    """Bytes of the arrays' shards on one device."""
    return bytes_per_device(arrays).get(device_id, 0)


def substitutions(recorder: Recorder, devices, hbm_bytes: int) -> list:
    from vllm_gemma_qat.substitute import Substitution
    manager = "tpu_inference.runner.compilation_manager:CompilationManager"

    def worker_init(original):
        def init(self, *args, **kwargs):
            kwargs.setdefault("devices", list(devices))
            return original(self, *args, **kwargs)
        return init

    def load_model(original):
        def load(self):
            original(self)
            recorder.started.runner = self
        return load

    def hbm_usage_bytes(chips):
        runner = recorder.started.runner
        held = {} if runner is None else bytes_per_device(
            [runner.state, runner.kv_caches,
             getattr(getattr(runner, "drafter", None), "state", None)])
        return [(held.get(d.id, 0), hbm_bytes) for d in chips]

    def sized(original):
        def initialize(self, kv_cache_config):
            recorder.started.kv_cache_config = kv_cache_config
            return original(self, kv_cache_config)
        return initialize

    def run_compilation(self, name, fn, *args, **kwargs):
        return recorder.run_compilation(self, name, fn, *args, **kwargs)

    def no_warmup(self):
        self._compile_futures, self._warmup_tasks = [], []

    return [
        Substitution("tpu_inference.worker.tpu_worker:TPUWorker.__init__",
                     worker_init, "the worker's devices are the topology's "
                     "(it would take jax.devices(), the host's CPU)",
                     wraps=True),
        Substitution("tpu_inference.runner.tpu_runner:TPUModelRunner."
                     "load_model", load_model, "the runner, recorded for "
                     "the HBM it holds", wraps=True),
        Substitution("tpu_inference.utils:general_device_put",
                     lambda tensor, sharding=None, **_: _abstract(
                         tensor, sharding, recorder.mesh),
                     "an abstract array (shape, dtype, sharding) for a "
                     "transfer to chips that are not here"),
        Substitution("tpu_inference.runner.compilation_manager:jnp",
                     HostJnp(), "the precompile's dummy values (jnp.ones / "
                     "zeros / array, made outside any trace) on the host: "
                     "jax.numpy would place them on the mesh's chips, which "
                     "are not here; device_array then makes them abstract"),
        Substitution("tpu_inference.models.jax.gemma4_mm:jnp", HostJnp(),
                     "the same for Gemma 4's vision-encoder precompile "
                     "(`vision_warmup_config`'s dummy images); inside its "
                     "traced code, jax.numpy's"),
        Substitution("tpu_inference.utils:hbm_usage_bytes", hbm_usage_bytes,
                     "per chip: the bytes the runner's abstract arrays hold "
                     "and the chip's nominal HBM (a TPU reports its own)"),
        Substitution("tpu_inference.worker.tpu_worker:TPUWorker."
                     "initialize_from_config", sized, "marks the KV cache "
                     "sized: a ValueError before it is vLLM's or "
                     "tpu-inference's refusal to start", wraps=True),
        Substitution(f"{manager}._run_compilation", run_compilation,
                     "lowered and compiled by libtpu for the topology, "
                     "recorded; nothing runs"),
        Substitution(f"{manager}._flush_compilations", no_warmup,
                     "no warm-up calls (nothing can run)"),
        Substitution("jax._src.compiler:compile_or_get_cached",
                     recorder.analyses.keyed, "a recorded program compiled "
                     "before is answered by the analysis kept under its "
                     "executable's key (analyses.py)", wraps=True),
    ]


def start(vllm_config, devices, hbm_bytes: int, select, log) -> Started:
    """The engine core's start-up up to its scheduler, with the runner's
    precompile compiled for the topology (see the module's docstring)."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from vllm_gemma_qat import substitute
    recorder = Recorder(select, log)
    with substitute.applied(substitutions(recorder, devices, hbm_bytes),
                            "vllm-gemma-qat AOT engine"):
        # EngineCore.__init__'s steps up to the scheduler (it needs the
        # tokenizer).
        core = EngineCore.__new__(EngineCore)
        core.vllm_config = vllm_config
        core.available_gpu_memory_for_kv_cache = -1
        core.model_executor = UniProcExecutor(vllm_config)
        try:
            core._initialize_kv_caches(vllm_config)
        except ValueError as e:
            if recorder.started.kv_cache_config is not None:
                raise  # after the KV cache was sized: not a refusal
            # no room for the KV cache: vLLM or tpu-inference says so
            recorder.started.refused = str(e).strip()
    return recorder.started
