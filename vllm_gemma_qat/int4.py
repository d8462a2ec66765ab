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

import concurrent.futures
import functools
import os

import ml_dtypes
import numpy as np

from vllm_gemma_qat.quantization import GROUP_SIZE

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
    [out, in] on the q4_0 grid. Raises OffGridError otherwise.

    Fast path, one fused pass: d from the group's signed peak on level -8
    (d = -peak / 8, so d < 0 for a positive peak, as GGML's q4_0 writes it)
    or from its smallest |value| on level +-1, if bf16(q * d) == weight for
    every value. The other groups get the full search: per group, the first
    that holds of q * d == weight exactly; bf16(q * d) == weight;
    |q * d - weight| <= 1 bf16 ulp for every value."""
    if weight.dtype != BF16:
        raise OffGridError(f"{name}: expected bf16, got {weight.dtype}")
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise OffGridError(f"{name}: input dim {in_features} is not a multiple "
                           f"of the group size {group_size}")
    groups = weight.reshape(-1, group_size)
    q, d, ok = _chunked("peak", groups)
    for kind in ("smallest", "search"):
        retry = np.flatnonzero(~ok)
        if not retry.size:
            break
        subset = groups[retry]
        q[retry], d[retry], ok[retry] = _chunked(
            kind, subset.astype(np.float32) if kind == "search" else subset)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        row, group = divmod(int(bad[0]), in_features // group_size)
        cols = f"{group * group_size}:{(group + 1) * group_size}"
        raise OffGridError(
            f"{name}: {bad.size} group(s) off the int4 grid, first row {row} "
            f"group {group} (columns {cols}); not a q4_0 QAT weight")
    return (q.reshape(out_features, in_features),
            d.astype(BF16).reshape(out_features, in_features // group_size))


def _chunked(kind: str, groups: np.ndarray):
    """Run the compiled `kind` over `groups` in fixed-shape chunks (the last
    zero-padded): two compilations per kind serve every tensor."""
    chunk = _CHUNK_GROUPS[0] if len(groups) <= _CHUNK_GROUPS[0] else \
        _CHUNK_GROUPS[1]
    fn = _compiled(kind, chunk, groups.shape[1], groups.dtype)

    def run(start):
        part = groups[start:start + chunk]
        if len(part) < chunk:
            part = np.pad(part, ((0, chunk - len(part)), (0, 0)))
        n = min(chunk, len(groups) - start)
        return [np.asarray(a)[:n] for a in fn(part)]

    # The compiled call releases the GIL: one chunk per core at a time.
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        parts = list(pool.map(run, range(0, len(groups), chunk)))
    return [np.concatenate(a) for a in zip(*parts)]


@functools.cache
def _compiled(kind: str, groups: int, group_size: int, dtype: np.dtype):
    """`kind` compiled once per chunk shape for the host CPU. Ahead-of-time
    compiled, so the mesh / device contexts the model loader runs under
    neither retrigger compilation nor move the work."""
    import jax
    fn = _recover_fn() if kind == "search" else _level_fn(kind)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return fn.lower(jax.ShapeDtypeStruct((groups, group_size),
                                             dtype)).compile()


def _level_fn(kind: str):
    """One fused pass trying each group's d on a fixed level: "peak" puts
    the signed peak on level -8 (exact: / 8 is a power of two), "smallest"
    the smallest nonzero |value| on level +1 or -1."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def on_level(w):
        x = w.astype(jnp.float32)
        if kind == "peak":
            hi, lo = x.max(-1, keepdims=True), x.min(-1, keepdims=True)
            candidates = (jnp.where(-lo >= hi, -lo, -hi) / 8, )
        else:
            m = jnp.where(x == 0, jnp.inf, jnp.abs(x)).min(-1, keepdims=True)
            m = jnp.where(jnp.isinf(m), 0.0, m)
            candidates = (m, -m)
        q = d = ok = None
        for cand in candidates:
            # rint absorbs the reciprocal's rounding; the test below is exact.
            qc = jnp.rint(x * jnp.where(cand == 0, 0.0, 1 / cand))
            good = ((qc >= -8) & (qc <= 7) &
                    (_round_bf16(qc * cand) == x)).all(-1, keepdims=True)
            if q is None:
                q, d, ok = qc, cand, good
            else:
                take = good & ~ok
                q, d, ok = (jnp.where(take, qc, q), jnp.where(take, cand, d),
                            ok | good)
        return q.astype(jnp.int8), d[:, 0], ok[:, 0]

    return on_level


def _round_bf16(x):
    """Nearest bf16 (ties to even), kept in fp32."""
    import jax
    import jax.numpy as jnp
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _recover_fn():
    """Jitted search over levels x (least-squares d and its two bf16
    neighbours); the best (test, level, candidate) per group wins."""
    import jax
    import jax.numpy as jnp

    def as_u32(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)

    def as_f32(x):
        return jax.lax.bitcast_convert_type(x, jnp.float32)

    round_bf16 = _round_bf16

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
    column 8j + i, stored as q + 8. Integer arithmetic throughout: columns
    2k, 2k + 1 fill byte k's low and high nibble; four bytes read as a
    little-endian word put nibble i at bits 4i."""
    out_features, in_features = q.shape
    if in_features % 8:
        raise ValueError(f"input dim {in_features} is not a multiple of 8")
    nibbles = q.view(np.uint8) + np.uint8(8)  # two's complement + 8 = q + 8
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << np.uint8(4))
    return np.ascontiguousarray(packed).view("<u4").view(np.int32)


def unpack_int4(packed: np.ndarray, in_features: int) -> np.ndarray:
    words = packed.view(np.uint32)[..., None]
    shifts = np.arange(8, dtype=np.uint32) * 4
    nibbles = ((words >> shifts) & 0xF).astype(np.int8) - 8
    return nibbles.reshape(packed.shape[0], -1)[:, :in_features]


def off_grid_modules(ckpt, modules) -> dict[str, str]:
    """{module: why} for each of `modules` (bf16 linears of `ckpt`) whose
    weight is not on the q4_0 grid; reads each weight once."""
    from vllm_gemma_qat.checkpoint import read_bf16
    out = {}
    for module in modules:
        name = module + ".weight"
        try:
            recover_grid(read_bf16(ckpt, name), name)
        except (OffGridError, ValueError) as e:
            out[module] = str(e)
    return out
