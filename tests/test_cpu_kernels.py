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


def _paged_inputs(kv_dtype, seed=0, head_dim=128, kv_heads=1, heads=8,
                  page_size=16, pages=8):
    """Two sequences (a 5-token prefill chunk onto 20 cached tokens, a
    1-token decode onto 9): queries, new k / v, a cache holding random past
    K/V (already in the cache dtype) and the metadata."""
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import \
        get_kv_cache_shape
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = [5, 1], [25, 10]
    tokens = sum(q_lens)
    q = jnp.asarray(rng.standard_normal((tokens, heads, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)),
                        jnp.float32).astype(kv_dtype) for _ in range(2))
    shape = get_kv_cache_shape(pages, page_size, kv_heads, head_dim, kv_dtype)
    cache = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(kv_dtype)
    pages_per_seq = pages // 2
    return (q, k, v, cache, jnp.array(kv_lens, jnp.int32),
            jnp.arange(pages, dtype=jnp.int32),
            jnp.array([0, 5, 6], jnp.int32),
            jnp.array([1, 2, 2], jnp.int32)), pages_per_seq


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_paged_attention_stand_in_fp8_scales_match_tpu_inference_reference(
        kv_dtype):
    # tpu-inference's own pure-JAX reference of the RPA v3 kernel
    # (ref_ragged_paged_attention: same q_scale / k_scale / v_scale
    # semantics as the kernel) against the stand-in, on an fp8 cache.
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import \
        ref_ragged_paged_attention

    from vllm_gemma_qat.cpu.attention import ragged_paged_attention
    args, _ = _paged_inputs(jnp.dtype(kv_dtype))
    scales = dict(q_scale=0.5, k_scale=0.75, v_scale=1.25, sm_scale=0.1,
                  sliding_window=12)
    ref_out, ref_cache = ref_ragged_paged_attention(*args, **scales)
    out, cache = ragged_paged_attention(*args, **scales)
    assert cache.dtype == ref_cache.dtype
    np.testing.assert_array_equal(np.asarray(cache, np.float32),
                                  np.asarray(ref_cache, np.float32))
    # Same fp8 q / K / V and fp32 scores; the reference then rounds the
    # probabilities to the cache dtype and does PV in it (output rounded to
    # fp8 too), the stand-in keeps both fp32. Two roundings of half an ulp
    # (e4m3: 3 mantissa bits, 2^-4 relative; e5m2: 2 bits, 2^-3) of the
    # largest output bound the difference.
    half_ulp = {"float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}[kv_dtype]
    ref = np.asarray(ref_out, np.float32)
    err = np.abs(np.asarray(out, np.float32) - ref)
    assert err.max() <= 2 * half_ulp * np.abs(ref).max(), err.max()
    assert err.mean() <= half_ulp * np.abs(ref).mean(), err.mean()


def test_paged_attention_stand_in_refuses_an_int8_cache_as_the_kernel_does():
    import jax.numpy as jnp

    from vllm_gemma_qat.cpu.attention import ragged_paged_attention
    args, _ = _paged_inputs(jnp.dtype("int8"))
    with pytest.raises(ValueError, match="to be a floating point"):
        ragged_paged_attention(*args)
