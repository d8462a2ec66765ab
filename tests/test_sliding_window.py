"""Which cache row each sliding layer of a Gemma 4 gets under gemma_qat's
sliding-window KV (#3220), from the config alone: the fix's layout (read
with tpu-inference's helpers) and `plan`'s (header-only) agree."""
import json

import pytest

from vllm_gemma_qat import plan
from vllm_gemma_qat.fixes.sliding_window import row_layout
from vllm_gemma_qat.geometry import Geometry, text_config_of
from vllm_gemma_qat.testing import synthetic, tiny


class _Attrs:
    def __init__(self, d):
        self.__dict__.update(d)


def _text(geometry, full_size, tmp_path):
    if full_size:
        path = synthetic.write_header_only(tmp_path / geometry, geometry, "qat")
        return text_config_of(json.loads((path / "config.json").read_text()))
    return tiny.text_config_kwargs(geometry)


@pytest.mark.parametrize("geometry, full_size, place", [
    # tiny E2B-like: 4 sliding + 1 full KV-owning layers, 128 / 256 wide
    ("e2b", False, {0: (0, 0), 1: (0, 1), 2: (2, 0), 3: (2, 1)}),
    # tiny E4B-like: 5 sliding, the last alone in its row
    ("e4b", False, {0: (0, 0), 1: (0, 1), 2: (2, 0), 3: (2, 1), 4: (4, 0)}),
])
def test_sliding_layers_pair_up_in_layer_order(geometry, full_size, place,
                                               tmp_path):
    layout = row_layout(_Attrs(_text(geometry, full_size, tmp_path)))
    assert layout.slots_per_row == 2 and layout.place == place


@pytest.mark.parametrize("geometry, rows", [("e2b", 6), ("e4b", 10)])
def test_full_size_rows_and_plan_agree(geometry, rows, tmp_path):
    text = _text(geometry, True, tmp_path)
    layout = row_layout(_Attrs(text))
    assert sum(slot == 0 for _, slot in layout.place.values()) == rows
    # KV-shared layers read the row of their source.
    geo = Geometry.from_text_config(text)
    for layer, source in geo.kv_share_map.items():
        if not geo.is_full(source):
            assert layout.source_place(geo.kv_share_map, layer) == \
                layout.place[source]
    # plan's figure: a block of `group size` full-layer pages, one group
    # of full layers and the rows in groups of that size (vLLM's rule as
    # plan restates it; vLLM's own grouping is held to plan's bytes by
    # test_aot, arrays compiled from get_kv_cache_groups, and by
    # test_serve_agent, the server's logged pool).
    full = sum(geo.is_full(i) for i in range(geo.num_layers)
               if i not in geo.kv_share_map)
    p = plan.sliding_window_layout(geo, "bf16", 1, 16)
    size = p.block_bytes // (16 * plan.kv_bytes_per_layer_token(
        geo, next(i for i in range(geo.num_layers) if geo.is_full(i)),
        "bf16"))
    assert (p.full_groups, p.sliding_groups) == (-(-full // size),
                                                 -(-rows // size))


def test_geometries_that_do_not_pack_keep_the_full_context():
    text = tiny.text_config_kwargs("e2b")
    # A sliding head dim that does not divide the full one (384 / 512).
    odd = dict(text, head_dim=384, global_head_dim=512)
    assert row_layout(_Attrs(odd)) is None
    assert plan.sliding_window_layout(Geometry.from_text_config(odd),
                                      "bf16", 1, 16) is None
    # Full layers with other KV heads than the sliding ones (26B / 31B's
    # attention_k_eq_v): a row would mix head counts.
    heads = dict(text, attention_k_eq_v=True,
                 num_global_key_value_heads=2 * text["num_key_value_heads"])
    assert row_layout(_Attrs(heads)) is None
    assert plan.sliding_window_layout(Geometry.from_text_config(heads),
                                      "bf16", 1, 16) is None
    # No sliding window at all.
    assert row_layout(_Attrs(dict(text, sliding_window=None))) is None


def test_draft_layers_read_their_source_slot_through_their_groups_table():
    """The assistant's attention under sliding-window KV
    (`_draft_attention` over tpu-inference's `attention`, CPU mode's
    kernel), two requests: a draft layer whose source sits in slot 1 of a
    packed row, its group's block table second of two interleaved per
    request, gets what the same query gets over its source's own cache and
    table; a full draft layer (no slot) the first table's. The spec-decode
    servers' assistant reads slot 0 only."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import \
        get_kv_cache_shape
    from tpu_inference.layers.common.attention_interface import attention
    from tpu_inference.layers.common.attention_metadata import \
        AttentionMetadata

    from vllm_gemma_qat import cpu
    from vllm_gemma_qat.fixes import sliding_window as sw
    from vllm_gemma_qat.testing import runner

    page, dim, window, per_request = 16, 128, 8, 6
    rng = np.random.RandomState(0)
    shape = get_kv_cache_shape(32, page, 1, dim, jnp.float32)
    source, partner, full = (jnp.asarray(rng.randn(*shape), jnp.float32)
                             for _ in range(3))
    row = jnp.concatenate([partner, source], axis=-1)  # [slot 0 | slot 1]
    seq_lens = np.array([40, 70], np.int32)
    # Each group's pages for each request (a block id belongs to one group).
    tables = [np.array([[0, 1, 2, 0, 0, 0], [3, 4, 5, 6, 7, 0]]),
              np.array([[20, 9, 17, 0, 0, 0], [8, 30, 12, 25, 11, 0]])]
    interleaved = np.stack(tables, axis=1).reshape(-1)

    def metadata(block_tables):
        return AttentionMetadata(
            input_positions=jnp.asarray(seq_lens - 1),
            block_tables=jnp.asarray(block_tables, jnp.int32),
            seq_lens=jnp.asarray(seq_lens),
            query_start_loc=jnp.array([0, 1, 2], jnp.int32),
            request_distribution=jnp.array([0, 0, 2], jnp.int32))

    q = jnp.asarray(rng.randn(2, 2, dim), jnp.float32)
    kv = jnp.zeros((2, 1, dim), jnp.float32)  # a draft layer writes nothing
    mesh = runner.mesh()
    draft_attention = sw._draft_attention(attention)
    place = sw.RowPlace(owner=2, slot=1, slots=2)
    cases = [  # (what the draft layer reads, window) -> its own cache, table
        ((sw.DraftRead(1, 2, place), window), (source, tables[1])),
        ((sw.DraftRead(0, 2, None), None), (full, tables[0]))]
    with cpu.kernels(), jax.set_mesh(mesh):
        for (read, chunk), (own, table) in cases:
            _, want = attention(own, q, kv, kv, metadata(table.reshape(-1)),
                                mesh, sm_scale=dim**-0.5,
                                attention_chunk_size=chunk,
                                update_kv_cache=False)
            token = sw._draft_read.set(read)
            try:
                cache = row if read.place else full
                _, got = draft_attention(cache, q, kv, kv,
                                         metadata(interleaved), mesh,
                                         sm_scale=dim**-0.5,
                                         attention_chunk_size=chunk,
                                         update_kv_cache=False)
            finally:
                sw._draft_read.reset(token)
            assert np.isfinite(want).all()
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            # The other table (or slot) reads other keys.
            wrong = tables[1 - read.table].reshape(-1)
            _, other = attention(own, q, kv, kv, metadata(wrong), mesh,
                                 sm_scale=dim**-0.5,
                                 attention_chunk_size=chunk,
                                 update_kv_cache=False)
            assert not np.allclose(other, want)


@pytest.mark.parametrize("window,block,context,ahead", [
    (512, 64, 32768, 2), (512, 256, 8192, 2), (512, 16, 131072, 1),
    (8, 16, 200, 2), (8, 16, 20, 2), (32, 16, 100, 1)])
def test_decode_blocks_equal_vllms_sliding_window_manager(window, block,
                                                          context, ahead):
    # plan's blocks per decoding agent in a sliding group against vLLM's own
    # SlidingWindowManager: free what lies before the window, allocate
    # `ahead` slots past the computed tokens, for every alignment of the
    # window on a page up to `context`; the most held equals plan's.
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    spec = SlidingWindowSpec(block_size=block, num_kv_heads=1, head_size=256,
                             dtype=torch.bfloat16, sliding_window=window)
    pool = BlockPool(num_gpu_blocks=-(-(context + ahead) // block) + 2,
                     enable_caching=False, hash_block_size=block)
    manager = SlidingWindowManager(spec, block_pool=pool, enable_caching=False,
                                   kv_cache_group_id=0,
                                   scheduler_block_size=block)
    held = 0
    start = max(0, context - 2 * block)  # a prefill up to here, then decode
    for computed in range(start, context + 1):
        manager.remove_skipped_blocks("r", computed)
        manager.allocate_new_blocks("r", computed + ahead, computed + ahead)
        if computed > start:
            held = max(held, sum(not b.is_null
                                 for b in manager.req_to_blocks["r"]))
    layout = plan.Layout(block, 1, full_groups=0, sliding_groups=1,
                         window=window, sliding_window=True)
    assert layout.blocks_decoding(context, ahead) == held
