"""CPU mode's kernel stand-ins against a dense float64 reference written
here, called through tpu-inference's own sharded wrappers."""
import numpy as np
import pytest

from vllm_gemma_qat import cpu


def dense_attention(q, k, v, q_segments, kv_segments, sm_scale):
    """float64 softmax(q k^T * scale) v, a query seeing its segment only."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bnqh,bnkh->bnqk", q, k) * sm_scale
    same = q_segments[:, None, :, None] == kv_segments[:, None, None, :]
    scores = np.where(same, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnqk,bnkh->bnqh", probs, v)


# fp32: scores of unit-normal q, k reach ~15, so fp32 rounding of the
# logits (eps 1.2e-7 x 15) moves outputs by ~2e-6. bf16: the same math on
# bf16-rounded inputs, output rounded to bf16 (2^-9 relative of |out| <= 3).
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5),
                                              ("bfloat16", 1e-2)])
def test_vision_flash_attention_stand_in_matches_dense(dtype, tolerance):
    # As Gemma 4's vision tower calls it: non-causal, scale 1, 128-padded
    # sequence whose padding is segment 2 (valid patches segment 1).
    import jax.numpy as jnp
    from tpu_inference.layers.common.attention_interface import \
        sharded_flash_attention
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.models.jax.gemma4_mm import SegmentIds

    from vllm_gemma_qat.testing import runner

    rng = np.random.default_rng(0)
    batch, heads, seq, head_dim, valid = 2, 8, 128, 16, 100
    q, k, v = (rng.standard_normal((batch, heads, seq, head_dim))
               .astype(np.float32) for _ in range(3))
    segments = np.where(np.arange(seq) < valid, 1, 2)[None].repeat(batch, 0)
    segments[1, 64:] = 2  # a smaller second image
    mesh = runner.mesh()
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    with cpu.kernels():
        out = sharded_flash_attention(
            mesh=mesh, causal=False, sm_scale=1.0,
            batch_axis=ShardingAxisName.VIT_BATCH,
            head_axis=ShardingAxisName.VIT_MODEL)(
                cast(q), cast(k), cast(v),
                SegmentIds(q=jnp.asarray(segments, jnp.int32),
                           kv=jnp.asarray(segments, jnp.int32)))
    assert out.dtype == jnp.dtype(dtype)
    rounded = [np.asarray(cast(a), np.float64) for a in (q, k, v)]
    ref = dense_attention(*rounded, segments, segments, 1.0)
    err = np.abs(np.asarray(out, np.float64) - ref)
    # Only valid patches are read by the tower; padding must not leak in.
    assert err[0, :, :valid].max() < tolerance
    assert err[1, :, :64].max() < tolerance
