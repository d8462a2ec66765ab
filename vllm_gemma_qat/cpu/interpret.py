"""CPU mode with the real TPU kernels: tpu-inference's ragged paged attention
v3 and tokamax's int4 `gmm_v2`, run by JAX's Pallas TPU interpreter
(`VLLM_GEMMA_QAT_CPU_KERNELS=interpret`, tests only).

Two parts:

- `runtime_substitutions()`: what stock JAX 0.11 / tpu-inference 0.32 need
  before the interpreter runs these two kernels on a CPU, each a narrow
  change to a JAX or tpu-inference internal, declared with its reason (see
  `substitute.py`; a target an upgrade moves stops with MissingTarget).
- `ragged_paged_attention` and `gmm`: drop-ins for the two kernel entry
  points. Each runs the real kernel, interpreted, as its own compiled
  program behind `jax.pure_callback`: one compile per kernel shape and
  flags in a process, reused by every layer and step (traced into the
  model's step jit, every interpreted call site would add ~0.7 MB of HLO to
  it; a tiny int4 model's first step then compiled for minutes).

What this shows: the kernels' semantics on our inputs (masks, windows, cache
writes, KV-shared reads, fp8 caches, int4 dequantization). Not Mosaic
lowering, VMEM limits, TPU memory layout or speed.
"""
from __future__ import annotations

import functools
import threading

from vllm.logger import init_logger

# JAX and tpu-inference are imported lazily: this module is imported by
# `cpu.kernel_substitutions()` in every CPU-mode process.
logger = init_logger(f"vllm.{__name__}")


def interpret_params():
    """The interpreter's settings. Out-of-bounds reads give uninitialized
    values instead of raising: gmm_v2 reads K tiles past a K smaller than
    its tile and masks them (the TPU reads whatever VMEM holds)."""
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams(out_of_bounds_reads="uninitialized")


# --- the runtime changes ----------------------------------------------------

def runtime_substitutions() -> list:
    from vllm_gemma_qat.substitute import Substitution
    interp = "jax._src.pallas.mosaic.interpret.interpret_pallas_call"
    views = ("the interpreter reads and writes refs through index ranges "
             "only; the kernels also reshape, bitcast (and gmm_v2 "
             "zero-stride-slice) refs: those views applied in numpy")
    return [
        Substitution("jax._src.tpu_info:registry", _with_cpu_kind,
                     "get_tpu_info() (RPA's VMEM limit, gmm_v2's tiling) "
                     "knows TPU device kinds only: 'cpu' reads as one v6e "
                     "TensorCore", wraps=True),
        Substitution("tpu_inference.kernels.ragged_paged_attention.v3."
                     "kernel:get_tpu_version", _v6,
                     "RPA v3 picks block sizes and code paths by TPU "
                     "version (-1 off TPU: NotImplementedError): v6"),
        Substitution(f"{interp}:get", _viewing_get, views, wraps=True),
        Substitution(f"{interp}:store", _viewing_store, views, wraps=True),
        Substitution(f"{interp}:swap", _viewing_swap, views, wraps=True),
        Substitution("jax._src.pallas.mosaic.core:TensorCoreMesh.__init__",
                     _one_core_off_tpu,
                     "TensorCoreMesh() (gmm_v2's pl.kernel mesh) asks the "
                     "device for its core count; a CPU device has none: 1, "
                     "as a v6e", wraps=True),
        Substitution(f"{interp}:remove_memory_space_p.abstract_eval",
                     _dropping_memory_spaces,
                     "the interpreter refuses operands pinned to SMEM / "
                     "VMEM (with_memory_space_constraint); on the CPU "
                     "there is one memory: the constraint is dropped",
                     wraps=True),
    ]


class _Registry(dict):
    """A dict the substitution can mark."""


def _with_cpu_kind(registry):
    from jax._src import tpu_info

    def v6e():
        return tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V6E, 1)

    return _Registry(registry, cpu=v6e)


def _v6() -> int:
    return 6


def _one_core_off_tpu(init):

    def __init__(self, *args, num_cores=None, **kwargs):
        if num_cores is None:
            from jax._src.pallas.mosaic import core
            try:
                num_cores = core._get_default_num_cores()
            except AttributeError:  # a CpuDevice has no num_cores
                pass
        init(self, *args, num_cores=num_cores or 1, **kwargs)

    return __init__


def _dropping_memory_spaces(abstract_eval):

    def drop(x, **params):
        import jax
        from jax._src import core
        if (isinstance(x, core.ShapedArray)
                and not isinstance(x.memory_space, core.MemorySpace)
                and x.memory_space is not None):
            return jax.core.ShapedArray(x.shape, x.dtype), core.no_effects
        return abstract_eval(x, **params)

    return drop


# Views: the interpreter's get / store / swap take a ref's transforms and
# turn them into one index range (`interpret/utils.py` `to_range`), which
# holds only NDIndexers with positive strides. Otherwise the leading plain
# indexers still select the region read or written through the original
# function; the rest (reshape, bitcast, transpose, zero-stride slices) is
# applied to that region here.

def _split(transforms):
    """(leading plain-indexer transforms, the rest) or None if all plain."""
    from jax._src.state import indexing
    for n, t in enumerate(transforms):
        if not (isinstance(t, indexing.NDIndexer) and all(
                not isinstance(i, indexing.Slice) or i.stride > 0
                for i in t.indices)):
            return tuple(transforms[:n]), tuple(transforms[n:])
    return None


def _ints(transforms):
    import jax
    return jax.tree.map(int, transforms)


def _bitcast(x, dtype):
    """numpy `jax._src.state.utils.bitcast` (TPU ref bitcast: a change of
    bit width scales the second-minor dimension)."""
    import numpy as np
    dtype = np.dtype(dtype)
    xb, yb = x.dtype.itemsize * 8, dtype.itemsize * 8
    if xb == yb:
        return np.ascontiguousarray(x).view(dtype)
    if x.ndim < 2:
        raise NotImplementedError("1-D bitcast with a bit-width change")
    *lead, rows, cols = x.shape
    if xb < yb:
        ratio = yb // xb
        y = x.reshape(*lead, rows // ratio, ratio, cols).swapaxes(-1, -2)
        return np.ascontiguousarray(y).view(dtype)[..., 0]
    ratio = xb // yb
    y = np.ascontiguousarray(x)[..., None].view(dtype)  # [..., rows, cols, r]
    return y.swapaxes(-1, -2).reshape(*lead, rows * ratio, cols)


def _index(x, indexer, fill=None):
    """x[indexer] for an NDIndexer of ints and Slices (stride 0: the start
    element repeated, as a broadcast load reads it). Past the end of an
    axis: `fill` (the interpreter's uninitialized value, where its settings
    allow out-of-bounds reads), else IndexError."""
    import numpy as np
    from jax._src.state import indexing
    basic, shape, repeats = [], [], []
    for dim, i in zip(x.shape, indexer.indices):
        if not isinstance(i, indexing.Slice):
            i = int(i)
            if not 0 <= i < dim:
                raise IndexError(f"index {i} out of bounds of {x.shape}")
            basic.append(i)
            continue
        start, size, stride = int(i.start), int(i.size), int(i.stride)
        if start < 0 or (start >= dim and size > 0):
            raise IndexError(f"slice start {start} out of bounds of "
                             f"{x.shape}")
        if stride == 0:
            basic.append(slice(start, start + 1))
            shape.append(1)
            repeats.append(size)
        else:
            inside = min(size, -(-(dim - start) // stride))
            basic.append(slice(start, start + inside * stride, stride))
            shape.append(size)
            repeats.append(None)
    y = x[tuple(basic)]
    if y.shape != tuple(shape):
        if fill is None:
            raise IndexError(f"view {indexer} out of bounds of {x.shape}")
        padded = np.full(shape, fill, x.dtype)
        padded[tuple(slice(0, n) for n in y.shape)] = y
        y = padded
    for axis, r in enumerate(repeats):
        if r is not None and r != 1:
            y = np.repeat(y, r, axis=axis)
    return y


def _read_view(x, transforms, fill=None):
    from jax._src.state import indexing, types
    for t in transforms:
        if isinstance(t, types.ReshapeTransform):
            x = x.reshape(t.shape)
        elif isinstance(t, types.BitcastTransform):
            x = _bitcast(x, t.dtype)
        elif isinstance(t, types.TransposeTransform):
            x = x.transpose(t.permutation)
        elif isinstance(t, indexing.NDIndexer):
            x = _index(x, t, fill)
        else:
            raise NotImplementedError(f"interpreter view {t!r}")
    return x


def _write_view(x, transforms, value):
    """x with `value` written through `transforms` (a new array)."""
    import numpy as np
    from jax._src.state import indexing, types
    if not transforms:
        return np.broadcast_to(value, x.shape).astype(x.dtype)
    t, rest = transforms[0], transforms[1:]
    if isinstance(t, types.ReshapeTransform):
        return _write_view(x.reshape(t.shape), rest, value).reshape(x.shape)
    if isinstance(t, types.BitcastTransform):
        return _bitcast(_write_view(_bitcast(x, t.dtype), rest, value),
                        x.dtype)
    if isinstance(t, types.TransposeTransform):
        inverse = np.argsort(t.permutation)
        return _write_view(x.transpose(t.permutation), rest,
                           value).transpose(inverse)
    if isinstance(t, indexing.NDIndexer):
        if any(isinstance(i, indexing.Slice) and i.stride == 0
               for i in t.indices):
            raise NotImplementedError("store through a zero-stride slice")
        sub = _index(x, t)
        x = x.copy()
        x[tuple(_basic(t))] = _write_view(sub, rest, value)
        return x
    raise NotImplementedError(f"interpreter view {t!r}")


def _fill(dtype):
    """The interpreter's uninitialized value for out-of-bounds reads, or
    None where its settings make them raise."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax._src.pallas.mosaic.interpret import utils
    memory = ipc._get_shared_memory()
    if memory.out_of_bounds_reads != "uninitialized":
        return None
    return utils.get_uninitialized_value(dtype, memory.uninitialized_memory)


def _basic(indexer):
    from jax._src.state import indexing
    return [slice(int(i.start), int(i.start) + int(i.size) * int(i.stride),
                  int(i.stride))
            if isinstance(i, indexing.Slice) else int(i)
            for i in indexer.indices]


# Positional layout of the interpreter's callbacks:
# get(token, device_id, local_core_id, memory_space, buffer_id, transforms,
#     ...), store / swap (..., transforms, val, ...).

def _viewing_get(get):
    original = get.__wrapped__

    def get_(token, device_id, local_core_id, memory_space, buffer_id,
             transforms, *args, **kwargs):
        split = _split(_ints(transforms))
        if split is None:
            return original(token, device_id, local_core_id, memory_space,
                            buffer_id, transforms, *args, **kwargs)
        region, view = split
        token, x = original(token, device_id, local_core_id, memory_space,
                            buffer_id, region, *args, **kwargs)
        return token, _read_view(x, view, _fill(x.dtype))

    return _fail_on_exception(get, get_)


def _viewing_store(store):
    original = store.__wrapped__

    def store_(token, device_id, local_core_id, memory_space, buffer_id,
               transforms, val, *args, **kwargs):
        split = _split(_ints(transforms))
        if split is None:
            return original(token, device_id, local_core_id, memory_space,
                            buffer_id, transforms, val, *args, **kwargs)
        region, view = split
        import numpy as np
        x = _region(token, device_id, local_core_id, memory_space,
                    buffer_id, region, kwargs)
        return original(token, device_id, local_core_id, memory_space,
                        buffer_id, region,
                        _write_view(x, view, np.asarray(val)),
                        *args, **kwargs)

    return _fail_on_exception(store, store_)


def _viewing_swap(swap):
    original = swap.__wrapped__

    def swap_(token, device_id, local_core_id, memory_space, buffer_id,
              transforms, val, mask, *args, **kwargs):
        split = _split(_ints(transforms))
        if split is None:
            return original(token, device_id, local_core_id, memory_space,
                            buffer_id, transforms, val, mask, *args, **kwargs)
        import numpy as np
        region, view = split
        x = _region(token, device_id, local_core_id, memory_space,
                    buffer_id, region, kwargs)
        old = _read_view(x, view)
        val = np.asarray(val)
        if mask is not None:
            val = np.where(np.asarray(mask), val, old)
        token, _ = original(token, device_id, local_core_id, memory_space,
                            buffer_id, region, _write_view(x, view, val),
                            None, *args, **kwargs)
        return token, old

    return _fail_on_exception(swap, swap_)


def _region(token, device_id, local_core_id, memory_space, buffer_id,
            region, kwargs):
    """The region a store / swap writes through a view, read first (its
    transforms are plain indexers: the interpreter's own get reads it)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    keep = {k: kwargs[k] for k in ("src_device_id", "src_local_core_id",
                                   "source_info") if k in kwargs}
    _, x = ipc.get.__wrapped__(token, device_id, local_core_id, memory_space,
                               buffer_id, region, **keep)
    return x


def _fail_on_exception(decorated, inner):
    """`inner` decorated as the interpreter decorates its callbacks (an
    error is recorded in its shared memory); its `__wrapped__` is `inner`,
    which the interpreter's DMAs call directly."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    inner = functools.wraps(decorated.__wrapped__)(inner)
    del inner.__wrapped__
    return ipc.fail_on_exception(inner)


# --- the kernels, each its own compiled program -------------------------------

_lock = threading.Lock()
_compiled: dict = {}  # (kernel, operand shapes / dtypes, flags) -> executable


def _run_interpreted(name, function, *args, **static):
    """`function(*args, **static)` under the TPU interpreter, on host arrays
    (a callback's operands); returns numpy. Each kernel shape and flag set
    is compiled once in a process (logged) and the executable kept; the
    compile goes through JAX's persistent compilation cache when the run
    has one (a test run's is shared by its processes)."""
    import time

    import jax
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu
    key = (name, jax.tree.structure(args),
           tuple((np.shape(a), np.result_type(a).name)
                 for a in jax.tree.leaves(args)),
           tuple(sorted(static.items(), key=lambda item: item[0])))
    with _lock, _interpreting():
        try:
            executable = _compiled.get(key)
            if executable is None:
                start = time.monotonic()
                executable = jax.jit(functools.partial(function, **static)) \
                    .lower(*args).compile()
                _compiled[key] = executable
                logger.info("vllm-gemma-qat interpret: compiled %s %s %s in "
                            "%.1f s", name, key[2], _flags(static),
                            time.monotonic() - start)
            return jax.tree.map(np.asarray, executable(*args))
        except Exception:
            pltpu.reset_tpu_interpret_mode_state()
            raise


def _flags(static) -> str:
    return ", ".join(f"{k}={getattr(v, '__name__', v)}"
                     for k, v in sorted(static.items()))


def _interpreting():
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.force_tpu_interpret_mode(interpret_params())


# Kernel flags static_validate_inputs does not take.
_NOT_VALIDATED = ("update_kv_cache", "debug_mode", "disable_bounds_checks",
                  "disable_semaphore_checks")


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices,
                           cu_q_lens, distribution, **flags):
    """Drop-in for tpu-inference's RPA v3 `ragged_paged_attention` on one
    device's shard (its `sharded_ragged_paged_attention` keeps its shard_map
    and KV-head replication around this): the real kernel, interpreted."""
    import jax
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel as rpa

    # The kernel's own input checks, at trace time (inside the callback an
    # error would surface as a runtime error of the whole step).
    checked = {name: value for name, value in flags.items()
               if name not in _NOT_VALIDATED}
    rpa.static_validate_inputs(q, k, v, kv_cache, kv_lens, page_indices,
                               cu_q_lens, distribution, **checked)
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype))
    return jax.pure_callback(
        functools.partial(_run_interpreted, "ragged_paged_attention",
                          rpa.ragged_paged_attention, **flags),
        shapes, q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens,
        distribution)


def gmm(lhs, rhs, group_sizes, rhs_scale=None, rhs_bias=None,
        group_offset=None, lhs_scale=None, **static):
    """Drop-in for tokamax's `gmm_v2` as tpu-inference's wNa16 linear calls
    it: the real kernel, interpreted."""
    import jax
    from tokamax._src.ops.experimental.gmm_v2 import gmm_v2 as tokamax_gmm
    arrays = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes,
                  rhs_scale=rhs_scale, rhs_bias=rhs_bias,
                  group_offset=group_offset, lhs_scale=lhs_scale)
    kernel = functools.partial(_keywords, tokamax_gmm.gmm_v2)
    with _interpreting():  # the output's shape and dtype, as the kernel says
        shape = jax.eval_shape(functools.partial(kernel, **static), arrays)
    return jax.pure_callback(
        functools.partial(_run_interpreted, "gmm_v2", kernel, **static),
        shape, arrays)


def _keywords(function, arrays, **static):
    """`function(**arrays, **static)` (the array operands as one pytree)."""
    return function(**arrays, **static)
