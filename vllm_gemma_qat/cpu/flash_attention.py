"""Pure-JAX stand-in for tpu-inference's Pallas flash attention (the kernel
Gemma 4's vision tower calls through `sharded_flash_attention`)."""
from __future__ import annotations


def flash_attention(q, k, v, ab=None, segment_ids=None, *, causal=False,
                    sm_scale=1.0, block_sizes=None, vmem_limit_bytes=None,
                    debug=False):
    """Drop-in for `kernels.flash_attention.kernel.flash_attention` on one
    device's shard ([batch, heads, seq, head_dim] operands): softmax(q k^T *
    sm_scale + ab) v, a query attending only to keys of its own segment id
    (and, causal, not past its position). fp32 math, output in q's dtype."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("bnqh,bnkh->bnqk", q.astype(jnp.float32),
                        k.astype(jnp.float32)) * sm_scale
    if ab is not None:
        scores = scores + ab.astype(jnp.float32)
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = jnp.ones((1, 1, q_len, kv_len), bool)
    if segment_ids is not None:
        mask &= (segment_ids.q[:, None, :, None]
                 == segment_ids.kv[:, None, None, :])
    if causal:
        mask &= (jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :])
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bnqk,bnkh->bnqh", probs, v.astype(jnp.float32))
    return out.astype(q.dtype)
