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
