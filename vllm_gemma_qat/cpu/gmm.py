"""Pure-JAX stand-in for tokamax's TPU-only `gmm_v2` kernel, as
tpu-inference's wNa16 path calls it (CPU mode: int4 serving without a TPU).

Semantics (those of tokamax's own `reference_gmm`): rows of `lhs` are split
into consecutive groups by `group_sizes`; row group g (shifted by
`group_offset`) multiplies `rhs[g]` block by block along k, each block's
product scaled by `rhs_scale[g, block, 0, :]`, summed in fp32; rows outside
the local groups give zeros.

What the tests show (tests/test_real_kernels.py, beside the real gmm_v2 in
Pallas TPU interpret mode): for one group, as tpu-inference's wNa16 linear
calls it (int4 the plugin packs from q4_0, group 32, no bias), on the tiny
models' linears and E2B's q / o / gate-up / down shapes in f32 and bf16,
both are within f32 summation error of the exact product (bf16: correctly
rounded). Several groups, group_offset and rhs_bias are implemented, not
compared with the kernel.
"""
import jax.numpy as jnp


def gmm(lhs, rhs, group_sizes, rhs_scale=None, rhs_bias=None,
        group_offset=None, lhs_scale=None, *, preferred_element_type=None,
        maybe_quantize_lhs=True, transpose_rhs=False, fuse_act=None, **_):
    if lhs_scale is not None or transpose_rhs or fuse_act is not None:
        raise NotImplementedError("cpu gmm: lhs_scale / transpose / fuse_act")
    num_groups, size_k, size_n = rhs.shape
    num_blocks = 1 if rhs_scale is None else rhs_scale.shape[1]
    block = size_k // num_blocks
    offset = 0 if group_offset is None else group_offset[0]
    rows = jnp.arange(lhs.shape[0])
    row_group = jnp.searchsorted(jnp.cumsum(group_sizes), rows,
                                 side="right") - offset
    x = lhs.astype(jnp.float32).reshape(lhs.shape[0], num_blocks, block)
    out = jnp.zeros((lhs.shape[0], size_n), jnp.float32)
    for g in range(num_groups):
        w = rhs[g].astype(jnp.float32).reshape(num_blocks, block, size_n)
        acc = jnp.einsum("mbk,bkn->mbn", x, w)
        if rhs_scale is not None:
            acc = acc * rhs_scale[g, :, 0, :].astype(jnp.float32)[None]
        acc = acc.sum(axis=1)
        if rhs_bias is not None:
            acc = acc + rhs_bias[g].astype(jnp.float32)
        out = jnp.where((row_group == g)[:, None], acc, out)
    return out.astype(preferred_element_type or lhs.dtype)
