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
kernel (Gemma 4 uses neither). Contexts longer than its 128-position
chunks and steps of decodes only (their own rows) are among the cases
compared."""
from __future__ import annotations

# Context positions read per step of the online softmax.
_CHUNK_POSITIONS = 128


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

    out_dtype = q.dtype  # as the kernel's: q's, before any quantization
    if q_scale is not None:
        # As the kernel: q quantized to the cache's dtype (clipped to its
        # range), the scale put back on the scores.
        info = jnp.finfo(kv_cache.dtype)
        q = jnp.clip(q / q_scale, float(info.min),
                     float(info.max)).astype(kv_cache.dtype)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(
        jnp.float32)  # f32 math: XLA:CPU has no bf16 x bf16 -> f32 dot

    # The context is read a chunk of pages at a time, from the first
    # position a query token still sees (a sliding window's start) to the
    # end of the longest sequence read, with an online softmax as the
    # kernel's: a step costs what its context holds, not what the page
    # table could (the runner's tables span max_model_len). Each chunk is
    # gathered (and cast) once per sequence, not once per query token.
    chunk_pages = max(1, min(pages_per_seq, _CHUNK_POSITIONS // page_size))
    num_chunks = -(-pages_per_seq // chunk_pages)
    chunk = chunk_pages * page_size
    seq_pages = page_indices[:max_num_seqs * pages_per_seq].reshape(
        max_num_seqs, pages_per_seq)
    seq_pages = jnp.pad(seq_pages, (
        (0, 0), (0, num_chunks * chunk_pages - pages_per_seq)))

    def attend(queries, seq_of, pos_of, valid_of, scoring, mixing):
        """Online softmax of `queries` ([R, K, G, H]; row r: a query of the
        sequences seq_of[r] ([R, S]) at position pos_of[r], if valid_of[r])
        over the chunks those rows see; `scoring` / `mixing`: the einsums
        between the rows and a chunk's [S, C, K, H] keys / values."""
        end = jnp.max(jnp.where(seq_of.any(axis=0), kv_lens, 0))
        first = 0
        if use_causal_mask and sliding_window is not None:
            first = jnp.maximum(jnp.min(jnp.where(
                valid_of, pos_of - sliding_window + 1, end)), 0) // chunk

        def read_chunk(i, carry):
            seen_max, seen_sum, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(seq_pages, i * chunk_pages,
                                                 chunk_pages, axis=1)
            # [S, C, kv_head * 2 (+pad), head_dim]; k at even, v at odd.
            kv = loaded(store[pages]).reshape(max_num_seqs, chunk, -1,
                                              padded_head_dim)
            keys = kv[:, :, 0:2 * num_kv_heads:2, :head_dim].astype(
                jnp.float32)
            values = kv[:, :, 1:2 * num_kv_heads:2, :head_dim].astype(
                jnp.float32)
            scores = jnp.einsum(scoring, queries, keys,
                                preferred_element_type=jnp.float32) * sm_scale
            if k_scale is not None:
                scores = scores * k_scale
            if q_scale is not None:
                scores = scores * q_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            ctx = i * chunk + jnp.arange(chunk)
            seen = (ctx[None, None, :] < kv_lens[None, :, None]) & \
                seq_of[:, :, None]  # [R, S, C]
            if use_causal_mask:
                seen &= ctx[None, None, :] <= pos_of[:, None, None]
                if sliding_window is not None:
                    seen &= (pos_of[:, None, None] - ctx[None, None, :]
                             < sliding_window)
            seen &= valid_of[:, None, None]
            if scores.ndim == 4:  # rows are the sequences themselves
                seen = jnp.diagonal(seen, axis1=0, axis2=1).T  # [R, C]
            seen = seen[:, None, None]
            scores = jnp.where(seen, scores, -jnp.inf)
            axes = tuple(range(3, scores.ndim))
            new_max = jnp.maximum(seen_max, scores.max(axis=axes))
            shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            probs = jnp.exp(scores - shift.reshape(
                shift.shape + (1,) * len(axes)))  # unseen: 0
            rescale = jnp.exp(seen_max - shift)
            seen_sum = seen_sum * rescale + probs.sum(axis=axes)
            acc = acc * rescale[..., None] + jnp.einsum(mixing, probs, values)
            return new_max, seen_sum, acc

        rows = queries.shape[:3]
        _, total, acc = jax.lax.fori_loop(
            first, (end + chunk - 1) // chunk, read_chunk,
            (jnp.full(rows, -jnp.inf, jnp.float32),
             jnp.zeros(rows, jnp.float32),
             jnp.zeros((*rows, head_dim), jnp.float32)))
        # Rows that see nothing (padding) get zeros.
        return jnp.where(total[..., None] > 0,
                         acc / jnp.where(total > 0, total, 1.0)[..., None],
                         0.0)

    # A sequence with one query token (decoding) is scored on its own: S
    # rows against their own sequence's chunk. The others' tokens are
    # scored against every sequence's chunk, the other sequences masked
    # out: on CPU, [T, S, C] scores cost far less than a [T, C, K, H]
    # context gathered per token. Each loop reads only as far as its own
    # sequences reach (none: no iteration), so a step of decodes only
    # costs S rows, not T x S.
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    decoding = live & (q_lens == 1)  # [S]
    one_token = qg[jnp.minimum(cu_q_lens[:-1], num_tokens - 1)]
    decoded = attend(one_token, jnp.eye(max_num_seqs, dtype=bool) &
                     decoding[:, None], kv_lens - 1, decoding,
                     "skgh,sckh->skgc", "skgc,sckh->skgh")
    rest = valid & ~decoding[seq]
    own = (jnp.arange(max_num_seqs)[None, :] == seq[:, None]) & rest[:, None]
    out = attend(qg, own, pos, rest, "tkgh,sckh->tkgsc", "tkgsc,sckh->tkgh")
    out = jnp.where((valid & decoding[seq])[:, None, None, None],
                    decoded[seq], out)
    if v_scale is not None:
        out = out * v_scale
    out = out.reshape(num_tokens, num_heads, head_dim).astype(out_dtype)
    return out, loaded(store)
