"""Pure-JAX stand-in for tpu-inference's Pallas ragged paged attention.

What the tests show (tests/test_real_kernels.py runs the real RPA v3 kernel
in Pallas TPU interpret mode beside it): on 1 and 2 KV heads, head_dim 128 /
256 / 512, pages of 16 / 32, mixed decode / chunked / prefill batches with
permuted page tables, sliding window, KV-shared calls (update_kv_cache=
False), f32 and bf16, fp8 e4m3 / e5m2 caches with q / k / v scales, it
writes the same cache bit for bit and its output is within the stated
float tolerance of the kernel's and of a float64 dense attention (it
computes in f32 throughout: in bf16 it is closer to the dense reference than
the kernel, which keeps its softmax sums and accumulator in bf16). Soft
capping and use_causal_mask=False are implemented but not compared with the
kernel (Gemma 4 uses neither)."""
from __future__ import annotations


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices,
                           cu_q_lens, distribution, *, sm_scale=1.0,
                           sliding_window=None, soft_cap=None, q_scale=None,
                           k_scale=None, v_scale=None, update_kv_cache=True,
                           use_causal_mask=True, **kernel_tuning):
    """Drop-in for the v3 kernel `ragged_paged_attention` on one device's
    shard: tpu-inference's `sharded_ragged_paged_attention` keeps its own
    shard_map, partition specs and KV-head replication (KV heads < TP)
    around it. Returns (output (T, N, H), updated kv_cache)."""
    import jax
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import (
        merge_kv, static_validate_inputs)

    # The kernel's own input checks: its dtype rules (a floating KV cache,
    # k / v in the cache's dtype; integer caches refused), shapes, flags.
    static_validate_inputs(q, k, v, kv_cache, kv_lens, page_indices,
                           cu_q_lens, distribution, sm_scale=sm_scale,
                           sliding_window=sliding_window, soft_cap=soft_cap,
                           q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                           use_causal_mask=use_causal_mask, **kernel_tuning)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    num_pages, page_size = kv_cache.shape[:2]
    padded_head_dim = kv_cache.shape[-1]
    max_num_seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // max_num_seqs
    num_seqs = distribution[-1]

    # Which sequence each query token belongs to, and its absolute position.
    # Only the first num_seqs entries of cu_q_lens / kv_lens are meaningful
    # (the runner's persistent buffers keep stale values past them).
    t = jnp.arange(num_tokens)
    live = jnp.arange(max_num_seqs) < num_seqs
    seq = jnp.minimum(
        ((t[:, None] >= cu_q_lens[None, 1:]) & live[None, :]).sum(axis=1),
        max_num_seqs - 1)
    valid = t < cu_q_lens[num_seqs]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])

    # The cache is written and read in its own shape (a reshape of it makes
    # XLA:CPU copy all of it each call). An fp8 cache through a same-width
    # uint8 view: XLA:CPU scatters fp8 by casting the whole array to f32
    # and back. Either way the same bits land in the same places.
    fp8 = jnp.dtype(kv_cache.dtype).itemsize == 1
    store = (jax.lax.bitcast_convert_type(kv_cache, jnp.uint8) if fp8
             else kv_cache)

    def stored(x):
        x = x.astype(kv_cache.dtype)
        return jax.lax.bitcast_convert_type(x, jnp.uint8) if fp8 else x

    def loaded(x):
        return jax.lax.bitcast_convert_type(x, kv_cache.dtype) if fp8 else x

    if update_kv_cache:
        page = page_indices[seq * pages_per_seq + pos // page_size]
        page = jnp.where(valid, page, num_pages)  # out of range: dropped
        store = store.at[page, pos % page_size].set(stored(merge_kv(k, v)),
                                                    mode="drop")

    # Each sequence's context is gathered (and cast) once, not once per
    # query token: a step's tokens are mostly one sequence's, or padding.
    # Every token is scored against every sequence's context and the other
    # sequences' scores are masked out: on CPU, [T, S, C] scores cost far
    # less than a [T, C, K, H] context gathered per token.
    ctx = jnp.arange(pages_per_seq * page_size)
    seq_pages = page_indices[:max_num_seqs * pages_per_seq].reshape(
        max_num_seqs, pages_per_seq)
    # [S, C, kv_head * 2 (+pad), head_dim]; k at even, v at odd.
    kv = loaded(store[seq_pages]).reshape(max_num_seqs, ctx.size, -1,
                                          padded_head_dim)
    # fp32 math: XLA:CPU has no bf16 x bf16 -> f32 dot.
    keys = kv[:, :, 0:2 * num_kv_heads:2, :head_dim].astype(jnp.float32)
    values = kv[:, :, 1:2 * num_kv_heads:2, :head_dim].astype(jnp.float32)

    out_dtype = q.dtype  # as the kernel's: q's, before any quantization
    if q_scale is not None:
        # As the kernel: q quantized to the cache's dtype (clipped to its
        # range), the scale put back on the scores.
        info = jnp.finfo(kv_cache.dtype)
        q = jnp.clip(q / q_scale, float(info.min),
                     float(info.max)).astype(kv_cache.dtype)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgh,sckh->tkgsc", qg.astype(jnp.float32), keys,
                        preferred_element_type=jnp.float32) * sm_scale
    if k_scale is not None:
        scores = scores * k_scale
    if q_scale is not None:
        scores = scores * q_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    own = jnp.arange(max_num_seqs)[None, :] == seq[:, None]  # [T, S]
    mask = (own[:, :, None] & (ctx[None, None, :] < kv_lens[None, :, None])
            & valid[:, None, None])  # [T, S, C]
    if use_causal_mask:
        mask &= ctx[None, None, :] <= pos[:, None, None]
        if sliding_window is not None:
            mask &= pos[:, None, None] - ctx[None, None, :] < sliding_window
    mask = mask[:, None, None]  # [T, 1, 1, S, C]
    scores = jnp.where(mask, scores, -jnp.inf)
    shape = scores.shape
    probs = jax.nn.softmax(scores.reshape(*shape[:3], -1),
                           axis=-1).reshape(shape)
    probs = jnp.where(mask, probs, 0.0)
    out = jnp.einsum("tkgsc,sckh->tkgh", probs, values)
    if v_scale is not None:
        out = out * v_scale
    out = out.reshape(num_tokens, num_heads, head_dim).astype(out_dtype)
    return out, loaded(store)
