"""Exact int4 for Gemma 4 QAT weights: recover (q, d) from the bf16
`-qat-q4_0-unquantized` export, and pack int4 the way compressed-tensors'
`pack-quantized` format does (what tpu-inference's wNa16 method unpacks).

On the q4_0 grid every group of 32 consecutive input columns of a row holds
w = d * q with q in [-8, 7]. Recovery works in fp32 on the HF [out, in]
layout. The peak |w| of a group need not sit on level 8 (then d = max|w| / 8
is wrong), so the level is searched; d is then refined by least squares and
rounded to the bf16 the scale is stored in. Every value must come back:
q * d equal to it (what the int4 matmul computes), else bit-exact after bf16
rounding, else (the export's own d had more bits than bf16) within one bf16
ulp.
A group that does not is an error naming tensor and group: nothing is
re-gridded silently.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from vllm_gemma_qat.geometry import LINEAR_SUFFIXES

GROUP_SIZE = 32
BF16 = ml_dtypes.bfloat16
_LEVELS = (8, 7, 6, 5, 4, 3, 2, 1)  # finest grid first
_CHUNK_GROUPS = (4096, 65536)


class OffGridError(ValueError):
    """A bf16 tensor that does not lie on the 4-bit q4_0 grid."""


def _to_bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(BF16)


def recover_grid(weight: np.ndarray, name: str = "tensor",
                 group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [out, in], d bf16 [out, in // group_size]) for a bf16 `weight`
    [out, in] on the q4_0 grid. Per group, the first that holds of: q * d ==
    weight exactly; bf16(q * d) == weight; |q * d - weight| <= 1 bf16 ulp
    for every value. Raises OffGridError otherwise."""
    if weight.dtype != BF16:
        raise OffGridError(f"{name}: expected bf16, got {weight.dtype}")
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise OffGridError(f"{name}: input dim {in_features} is not a multiple "
                           f"of the group size {group_size}")
    w = weight.astype(np.float32).reshape(-1, group_size)
    # Fixed chunk shapes (zero-padded): two compilations serve every tensor.
    chunk = _CHUNK_GROUPS[0] if len(w) <= _CHUNK_GROUPS[0] else _CHUNK_GROUPS[1]
    recover = _compiled_recover(chunk, group_size)
    parts = []
    for start in range(0, len(w), chunk):
        part = w[start:start + chunk]
        padded = np.pad(part, ((0, chunk - len(part)), (0, 0)))
        parts.append([np.asarray(a)[:len(part)] for a in recover(padded)])
    q, d, ok = (np.concatenate(a) for a in zip(*parts))
    if not ok.all():
        bad = np.flatnonzero(~ok)
        row, group = divmod(int(bad[0]), in_features // group_size)
        cols = f"{group * group_size}:{(group + 1) * group_size}"
        raise OffGridError(
            f"{name}: {bad.size} group(s) off the int4 grid, first row {row} "
            f"group {group} (columns {cols}); not a q4_0 QAT weight")
    return (q.reshape(out_features, in_features),
            d.astype(BF16).reshape(out_features, in_features // group_size))


@functools.cache
def _compiled_recover(groups: int, group_size: int):
    """The search below, compiled once per chunk shape for the host CPU.
    Ahead-of-time compiled, so the mesh / device contexts the model loader
    runs under neither retrigger compilation nor move the work."""
    import jax
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return _recover_fn().lower(
            jax.ShapeDtypeStruct((groups, group_size), np.float32)).compile()


def _recover_fn():
    """Jitted search over levels x (least-squares d and its two bf16
    neighbours); the best (test, level, candidate) per group wins."""
    import jax
    import jax.numpy as jnp

    def as_u32(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)

    def as_f32(x):
        return jax.lax.bitcast_convert_type(x, jnp.float32)

    def round_bf16(x):  # nearest bf16 (ties to even), kept in fp32
        u = as_u32(x)
        return as_f32((u + (0x7FFF + ((u >> 16) & 1))) & jnp.uint32(0xFFFF0000))

    def bf16_ulp(x):  # bf16 spacing at |x|; 0 at 0
        exponent = (as_u32(x) >> 23) & 0xFF
        ulp = as_f32(((jnp.maximum(exponent, 8) - 7) << 23).astype(jnp.uint32))
        return jnp.where(x == 0, 0.0, ulp)

    @jax.jit
    def recover(w):
        peak = jnp.abs(w).max(-1, keepdims=True)
        scale = jnp.where(peak > 0, 1.0 / peak, 0.0)  # all-zero: q = 0, d = 0
        tol = bf16_ulp(w)
        none = jnp.int32(1 << 20)
        best = jnp.where(peak > 0, none, -1)
        best_level = jnp.zeros(peak.shape, jnp.float32)
        best_d = jnp.zeros(peak.shape, jnp.float32)
        for li, level in enumerate(_LEVELS):
            ql = jnp.rint(w * (level * scale))
            in_range = ((ql >= -8) & (ql <= 7)).all(-1, keepdims=True)
            d_ls = round_bf16((ql * w).sum(-1, keepdims=True) /
                              jnp.maximum((ql * ql).sum(-1, keepdims=True), 1))
            for ci, step in enumerate((0, 1, -1)):
                cand = as_f32(as_u32(d_ls) +
                              jnp.uint32((step << 16) & 0xFFFFFFFF))
                dq = ql * cand
                test = jnp.where(
                    (dq == w).all(-1, keepdims=True), 0,
                    jnp.where((round_bf16(dq) == w).all(-1, keepdims=True), 1,
                              jnp.where((jnp.abs(dq - w) <= tol).all(
                                  -1, keepdims=True), 2, 3)))
                key = jnp.where(in_range & (test < 3),
                                (test * len(_LEVELS) + li) * 3 + ci, none)
                take = key < best
                best = jnp.where(take, key, best)
                best_level = jnp.where(take, level, best_level)
                best_d = jnp.where(take, cand, best_d)
        q = jnp.rint(w * (best_level * scale)).astype(jnp.int8)
        return q, best_d[:, 0], best[:, 0] < none

    return recover


def dequantize(q: np.ndarray, d: np.ndarray,
               group_size: int = GROUP_SIZE) -> np.ndarray:
    """bf16(q * d), [out, in]."""
    out_features, in_features = q.shape
    w = (q.reshape(out_features, -1, group_size).astype(np.float32) *
         d.astype(np.float32)[..., None])
    return _to_bf16(w).reshape(out_features, in_features)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 [out, in] in [-8, 7] -> int32 [out, in / 8]: nibble i of word j is
    column 8j + i, stored as q + 8. Integer arithmetic throughout."""
    out_features, in_features = q.shape
    if in_features % 8:
        raise ValueError(f"input dim {in_features} is not a multiple of 8")
    nibbles = (q.astype(np.int32) + 8).astype(np.uint32).reshape(
        out_features, -1, 8)
    shifts = np.arange(8, dtype=np.uint32) * 4
    return (nibbles << shifts).sum(axis=-1, dtype=np.uint32).view(np.int32)


def unpack_int4(packed: np.ndarray, in_features: int) -> np.ndarray:
    words = packed.view(np.uint32)[..., None]
    shifts = np.arange(8, dtype=np.uint32) * 4
    nibbles = ((words >> shifts) & 0xF).astype(np.int8) - 8
    return nibbles.reshape(packed.shape[0], -1)[:, :in_features]


# The linear layers the w4a16 export quantizes: attention and MLP projections
# and the per-layer-input gate/projection of every decoder layer. Embeddings,
# norms, per_layer_model_projection and the towers stay bf16.
W4A16_TARGET = (r"re:.*language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                r"mlp\.(gate|up|down)_proj|per_layer_input_gate|"
                r"per_layer_projection)$")


def w4a16_quantization_config(group_size: int = GROUP_SIZE) -> dict:
    """compressed-tensors `quantization_config` (pack-quantized, symmetric
    int4, group 32) selecting tpu-inference's wNa16 linear method."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": [W4A16_TARGET],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                            "strategy": "group", "group_size": group_size,
                            "dynamic": False, "actorder": None,
                            "observer": "minmax"},
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": [],
        "kv_cache_scheme": None,
    }


def quantized_modules(quantization_config: dict, names) -> set[str]:
    """Module names among `names` (checkpoint tensor names ending in
    `.weight`) that `quantization_config` quantizes, matched the way vLLM's
    compressed-tensors config matches layers ("Linear" = any linear layer)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import \
        should_ignore_layer
    from vllm.model_executor.layers.quantization.utils.config_utils import \
        is_equal_or_regex_match
    targets = [t for group in quantization_config.get("config_groups", {})
               .values() if isinstance(group, dict)
               for t in group.get("targets", [])]
    ignore = quantization_config.get("ignore") or []
    out = set()
    for name in names:
        module = name.removesuffix(".weight")
        if module == name or not module.rsplit(".", 1)[-1].endswith(
                LINEAR_SUFFIXES):
            continue
        if should_ignore_layer(module, ignore=ignore):
            continue
        if any(t == "Linear" or is_equal_or_regex_match(module, t)
               for t in targets):
            out.add(module)
    return out
