"""Wrong variants of the serving path that no fix removes, put back on
request in CPU mode for evidence runs (#34: each serving check is shown to
fail on the bug it guards; `tests/test_evidence.py`).

`VLLM_GEMMA_QAT_CPU_BUG=<name>` (CPU mode only; unset to serve):

- `shared_layers_read_unrounded_kv`: the KV-shared layers attend over
  their source layer's K/V as that layer computed them in this step, not as
  its cache stored them (an fp8 cache rounds them): what a shared-layer path
  that bypassed the cache would read. Earlier steps' tokens come from the
  cache either way. Only an fp8 cache makes a difference (a bf16 or fp32
  cache stores K/V as computed). The target model at TP=1 only (a drafter
  or TP > 1 is refused).
- `int4_highest_nibble_first`: compressed-tensors int4 words unpacked in
  the wrong nibble order (each word's eight columns reversed): the classic
  packing bug, for the int4 serving checks.
- `kv_heads_replicated_in_tile_order`: with fewer KV heads than TP,
  tpu-inference replicates each KV head to the shards of its query heads
  (`jnp.repeat`); tiled instead, some shards attend with another group's
  KV head: for the tensor-parallel serving checks (E4B's 2 KV heads at
  TP=4).
"""
from __future__ import annotations

import functools
import os

BUG_ENV = "VLLM_GEMMA_QAT_CPU_BUG"
GEMMA4 = "tpu_inference.models.jax.gemma4"
INTERFACE = "tpu_inference.layers.common.attention_interface"
QUANTIZATION = "tpu_inference.layers.common.quantization"


def requested() -> str | None:
    """The bug VLLM_GEMMA_QAT_CPU_BUG names, or None; an unknown name is an
    error."""
    name = os.environ.get(BUG_ENV, "")
    if not name:
        return None
    if name not in BUGS:
        raise ValueError(f"{BUG_ENV}={name!r}: no such bug (known: "
                         f"{', '.join(BUGS)})")
    return name


def install(name: str) -> None:
    """Put `name` back, each part when its tpu-inference module is imported
    (`attention` before Gemma 4 imports it by name)."""
    import sys

    from vllm_gemma_qat import substitute
    if GEMMA4 in sys.modules:
        raise RuntimeError(f"{BUG_ENV}={name}: {GEMMA4} is imported already")
    for module, table in BUGS[name]().items():
        substitute.apply_on_import(
            module, lambda table=table: table, f"vllm-gemma-qat CPU mode: "
            f"bug {name} put back for an evidence run ({BUG_ENV}={name})")


def _shared_layers_read_unrounded_kv() -> dict:
    from vllm_gemma_qat.fixes import sliding_window
    from vllm_gemma_qat.substitute import Substitution

    # Within one trace of the step the layers run in order: a shared layer's
    # source is the last cache-owning layer with its window (None: full).
    computed = []  # this layer's K/V / scale, before the cache rounds them
    by_window = {}

    def record_unrounded(quantize_kv):
        @functools.wraps(quantize_kv)
        def quantize(dtype, key, value=None, k_scale=1.0, v_scale=1.0):
            computed[:] = [key / k_scale, value / v_scale]
            return quantize_kv(dtype, key, value, k_scale, v_scale)
        return quantize

    # Below gemma_qat's row layout (fixes/sliding_window.py puts sliding
    # layers' K/V side by side in one cache row): patched before Gemma 4
    # imports `attention`, so the row wrapper calls this one.
    def read_unrounded(attention):
        @functools.wraps(attention)
        def attend(kv_cache, q, k, v, *args, update_kv_cache=True,
                   attention_chunk_size=None, **kwargs):
            import jax.numpy as jnp
            from tpu_inference.layers.common.sharding import \
                ShardingAxisName
            from tpu_inference.utils import get_mesh_shape_product
            unrounded = tuple(computed)
            computed.clear()
            if update_kv_cache:
                by_window[attention_chunk_size] = unrounded or (k, v)
                return attention(kv_cache, q, k, v, *args,
                                 attention_chunk_size=attention_chunk_size,
                                 **kwargs)
            # The source's cache with this step's K/V as computed: a copy
            # in the activations' dtype, written and then dropped.
            fresh = by_window.get(attention_chunk_size)
            if fresh is None or getattr(fresh[0], "_trace", None) \
                    is not getattr(q, "_trace", None):
                raise NotImplementedError(
                    f"{BUG_ENV}: the target's KV-shared layers only (this "
                    "call's source layer ran in another trace: a drafter's)")
            if get_mesh_shape_product(args[1], ShardingAxisName.ATTN_HEAD) > 1:
                raise NotImplementedError(f"{BUG_ENV}: TP=1 only (the copy "
                                          "does not repeat KV heads)")
            place = sliding_window._place.get()
            if k.shape[-1] != fresh[0].shape[-1]:  # in its slot of a row
                dim = fresh[0].shape[-1]
                fresh = [jnp.zeros(k.shape, q.dtype).at[
                    ..., place.slot * dim:(place.slot + 1) * dim].set(
                        x.astype(q.dtype)) for x in fresh]
            _, out = attention(
                _unrounded_copy(kv_cache, k.shape[1], q.dtype), q,
                *(x.astype(q.dtype) for x in fresh), *args,
                update_kv_cache=True,
                attention_chunk_size=attention_chunk_size, **kwargs)
            return kv_cache, out
        return attend

    why = ("bug put back: KV-shared layers read this step's K/V before the "
           "cache rounded them")
    return {GEMMA4: [Substitution(f"{GEMMA4}:quantize_kv", record_unrounded,
                                  why, wraps=True)],
            INTERFACE: [Substitution(f"{INTERFACE}:attention", read_unrounded,
                                     why, wraps=True)]}


def _unrounded_copy(kv_cache, num_kv_heads: int, dtype):
    """The cache in `dtype` (its values exactly), in tpu-inference's layout
    for that dtype: (blocks, block size, cdiv(2K, packing), packing, H)."""
    import jax.numpy as jnp
    from tpu_inference.utils import get_dtype_packing
    blocks, size, *_, head_dim = kv_cache.shape
    rows = kv_cache.astype(dtype).reshape(blocks, size, -1, head_dim)
    rows = rows[:, :, :2 * num_kv_heads]
    packing = get_dtype_packing(dtype)
    pad = -rows.shape[2] % packing
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, pad), (0, 0)))
    return rows.reshape(blocks, size, -1, packing, head_dim)


def _int4_highest_nibble_first() -> dict:
    from vllm_gemma_qat.substitute import Substitution

    def unpack(u32_packed_i4):
        import jax.numpy as jnp
        shifts = (7 - jnp.arange(8, dtype=jnp.int32)) * 4  # the wrong order
        unpacked = jnp.bitwise_and(
            jnp.bitwise_right_shift(u32_packed_i4[..., None], shifts), 0xF)
        return jnp.reshape((unpacked - 8).astype(jnp.int4),
                           u32_packed_i4.shape[:-1] + (-1, ))

    return {QUANTIZATION: [Substitution(
        f"{QUANTIZATION}:u32_unpack_i4", unpack, "bug put back: int4 words "
        "unpacked highest nibble first (compressed-tensors packs the lowest "
        "first)")]}


class _TiledRepeat:
    """jax.numpy as attention_interface sees it, but `repeat` tiles."""

    def __getattr__(self, name):
        import jax.numpy as jnp
        return getattr(jnp, name)

    @staticmethod
    def repeat(x, repeats, axis=None, **kwargs):
        import jax.numpy as jnp
        reps = [1] * x.ndim
        reps[axis] = repeats
        return jnp.tile(x, reps)


def _kv_heads_replicated_in_tile_order() -> dict:
    from vllm_gemma_qat.substitute import Substitution
    return {INTERFACE: [Substitution(
        f"{INTERFACE}:jnp", _TiledRepeat(), "bug put back: KV heads fewer "
        "than TP replicated as h0 h1 h0 h1 (tile), not h0 h0 h1 h1: shards "
        "pair query heads with another group's KV head")]}


BUGS = {"shared_layers_read_unrounded_kv": _shared_layers_read_unrounded_kv,
        "int4_highest_nibble_first": _int4_highest_nibble_first,
        "kv_heads_replicated_in_tile_order":
        _kv_heads_replicated_in_tile_order}
