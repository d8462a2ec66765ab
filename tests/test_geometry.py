"""geometry.py in-process on header-only checkpoints with the real E2B / E4B
shapes: what gemma_qat loads, what it skips, and the one error each bad
checkpoint gets before any tensor is read."""
import json

import pytest

from vllm_gemma_qat import geometry
from vllm_gemma_qat.checkpoint import CheckpointError, open_checkpoint
from vllm_gemma_qat.testing import synthetic

LM = "model.language_model."


def check(path):
    return geometry.check(open_checkpoint(path))


def edit_config(path, edit):
    file = path / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


@pytest.mark.parametrize("name,layers,shared,share_map_tail", [
    ("e2b", 35, 20, {15: 13, 19: 14, 34: 14}),
    ("e4b", 42, 18, {24: 22, 29: 23, 41: 23}),
])
def test_kv_share_map_from_tpu_inference(name, layers, shared, share_map_tail):
    geo = geometry.Geometry.from_text_config(
        synthetic.CONFIGS[name]["text_config"])
    assert (geo.num_layers, geo.num_kv_shared_layers) == (layers, shared)
    assert share_map_tail.items() <= geo.kv_share_map.items()


@pytest.mark.parametrize("layout,kind,skipped", [
    ("regular", "regular-bf16", 60), ("qat", "qat-bf16", 0),
    ("w4a16", "qat-w4a16-ct", 0)])
def test_layouts_load_and_skip_exactly_the_shared_kv(tmp_path, layout, kind,
                                                     skipped):
    report = check(synthetic.write_header_only(tmp_path, "e2b", layout))
    assert report.errors() == [] and report.loads_with_gemma_qat
    assert report.export_kind == kind
    assert len(report.skipped) == skipped
    assert all(geometry.is_shared_kv_tensor(n, report.geometry.kv_share_map)
               for n in report.skipped)
    assert report.loads_with_auto == (layout == "regular")


def test_shared_layers_expect_no_kv_and_towers_are_left_alone():
    geo = geometry.Geometry.from_text_config(
        synthetic.CONFIGS["e2b"]["text_config"])
    expected = geo.expected(LM)
    assert f"{LM}layers.14.self_attn.k_proj.weight" in expected
    assert not any(f"{LM}layers.{i}.self_attn.{p}" in n for n in expected
                   for i in geo.kv_share_map for p in ("k_proj", "v_proj",
                                                       "k_norm"))
    tower_k = "model.vision_tower.encoder.layers.20.self_attn.k_proj.weight"
    assert not geometry.is_shared_kv_tensor(tower_k, geo.kv_share_map)
    assert not geometry.is_language_model_tensor(tower_k, LM)


def test_linear_modules_are_the_2d_weights_minus_embeddings():
    geo = geometry.Geometry.from_text_config(
        synthetic.CONFIGS["e2b"]["text_config"])
    linears = geo.linear_modules(LM)
    assert f"{LM}per_layer_model_projection" in linears
    assert f"{LM}embed_tokens" not in linears
    assert f"{LM}embed_tokens_per_layer" not in linears
    # q, o, gate, up, down, per-layer gate / projection on 35 layers, k and v
    # on the 15 non-shared ones, and the model-level projection.
    assert len(linears) == 7 * 35 + 2 * 15 + 1


def test_not_gemma4(tmp_path):
    path = synthetic.write_header_only(tmp_path, "e2b", "qat")
    edit_config(path, lambda c: c.update(architectures=["Qwen3ForCausalLM"],
                                         model_type="qwen3"))
    with pytest.raises(CheckpointError, match=r"Qwen3ForCausalLM.*not Gemma 4"):
        check(path)


def test_missing_tensor_names_it_and_its_shape(tmp_path):
    name = f"{LM}layers.3.mlp.down_proj.weight"
    report = check(synthetic.write_header_only(tmp_path, "e2b", "qat",
                                               exclude={name}))
    assert report.errors() == [f"missing tensor {name} (expected shape "
                               "[1536, 6144])"]
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: missing tensor "):
        report.raise_if_invalid(tmp_path)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    path = synthetic.write_header_only(tmp_path, "e2b", "qat", shards=1)
    shard = next(path.glob("*.safetensors"))
    with open(shard, "r+b") as f:  # the header only: the data is ~10 GB
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        name = f"{LM}layers.2.self_attn.q_proj.weight"
        start = header.index(f'"{name}"'.encode())
        end = header.index(b"]", header.index(b'"shape"', start))
        old = header[start:end + 1]
        new = old.replace(b"[2048, 1536]", b"[1536, 2048]")
        assert new != old and len(new) == len(old)
        f.seek(8)
        f.write(header.replace(old, new))
    report = check(path)
    assert report.errors() == [f"tensor {name} has shape [1536, 2048], "
                               "expected [2048, 1536]"]


def test_unexpected_tensor(tmp_path):
    stray = f"{LM}layers.3.mlp.extra.weight"
    report = check(synthetic.write_header_only(
        tmp_path, "e2b", "qat", extra={stray: ("BF16", (4, 4))}))
    assert report.errors() == [f"unexpected tensor {stray}"]


def test_num_kv_shared_layers_disagreeing_with_tensors(tmp_path):
    path = synthetic.write_header_only(tmp_path, "e2b", "qat")
    edit_config(path, lambda c: c["text_config"].update(num_kv_shared_layers=19))
    with pytest.raises(CheckpointError, match=r"num_kv_shared_layers=19, but "
                       r"the checkpoint has K/V projections for 15 of 35 "
                       r"layers \(i\.e\. 20 shared\)"):
        check(path).raise_if_invalid(path)


def test_layer_types_length_must_match(tmp_path):
    path = synthetic.write_header_only(tmp_path, "e2b", "qat")
    edit_config(path, lambda c: c["text_config"].update(
        layer_types=c["text_config"]["layer_types"][:-1]))
    with pytest.raises(CheckpointError, match="layer_types has 34 entries, "
                       "num_hidden_layers is 35"):
        check(path)


def test_packed_module_incomplete_or_also_bf16(tmp_path):
    module = f"{LM}layers.0.mlp.down_proj"
    report = check(synthetic.write_header_only(
        tmp_path, "e2b", "w4a16", exclude={f"{module}.weight_scale"}))
    assert f"missing tensor {module}.weight_scale" in report.errors()[0]
    report = check(synthetic.write_header_only(
        tmp_path / "x", "e2b", "w4a16",
        extra={f"{module}.weight": ("BF16", (1536, 6144))}))
    assert report.errors() == [f"unexpected tensor {module}.weight (the module "
                               "is also pack-quantized)"]


@pytest.mark.parametrize("name", ["e2b", "e4b"])
def test_real_int4_geometries_split_over_up_to_8_chips(tmp_path, name):
    # Every row-parallel input (o_proj 2048 / 4096, down_proj 6144 / 12288 /
    # 10240 columns) holds a multiple of 8 groups of 32.
    report = check(synthetic.write_header_only(tmp_path / name, name))
    linears = set(report.geometry.linear_modules(report.prefix))
    for tp in (2, 4, 8):
        assert geometry.int4_groups_indivisible(
            report.geometry, report.prefix, linears, tp) == []
        geometry.check_tensor_parallel(report, linears, tp)
    bad = geometry.int4_groups_indivisible(report.geometry, report.prefix,
                                           linears, 128)
    assert bad and all(".o_proj" in b or ".down_proj" in b for b in bad)


def test_indivisible_int4_groups_name_module_groups_and_tp(tmp_path):
    report = check(synthetic.write_header_only(tmp_path / "e2b", "e2b"))
    down = LM + "layers.0.mlp.down_proj"  # 6144 inputs: 192 groups
    q = LM + "layers.0.self_attn.q_proj"  # column-parallel: not checked
    with pytest.raises(CheckpointError, match=rf"^{down}: 192 int4 groups of "
                       r"32 input columns do not split over "
                       r"--tensor-parallel-size 128; serve it"):
        geometry.check_tensor_parallel(report, {down, q}, 128)
    geometry.check_tensor_parallel(report, {down}, 64)  # 192 = 3 x 64
    # bf16 modules (not in the int4 set) are not constrained.
    geometry.check_tensor_parallel(report, {q}, 128)


def _documented_e2b(layout: str) -> dict[str, list[int]]:
    """E2B's language-model tensors and shapes as ../shared/GEMMA4_FACTS.md
    lists them ("Tensor names": 35 layers, the last 20 KV-shared, every
    fifth a full layer, double-wide MLP on shared layers), written out here
    by hand, independently of `Geometry.expected` (which generates the
    synthetic fixtures)."""
    hidden, heads, layers, per_layer, vocab = 1536, 8, 35, 256, 262144
    shared = range(layers - 20, layers)
    out = {"embed_tokens.weight": [vocab, hidden],
           "embed_tokens_per_layer.weight": [vocab, layers * per_layer],
           "per_layer_model_projection.weight": [layers * per_layer, hidden],
           "per_layer_projection_norm.weight": [per_layer],
           "norm.weight": [hidden]}
    for i in range(layers):
        hd = 512 if i % 5 == 4 else 256
        mlp = 12288 if i in shared else 6144
        p = f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm",
                     "post_per_layer_input_norm"):
            out[f"{p}{norm}.weight"] = [hidden]
        out[f"{p}layer_scalar"] = [1]
        out[f"{p}self_attn.q_proj.weight"] = [heads * hd, hidden]
        out[f"{p}self_attn.o_proj.weight"] = [hidden, heads * hd]
        out[f"{p}self_attn.q_norm.weight"] = [hd]
        if layout == "regular" or i not in shared:
            out[f"{p}self_attn.k_proj.weight"] = [hd, hidden]
            out[f"{p}self_attn.v_proj.weight"] = [hd, hidden]
            out[f"{p}self_attn.k_norm.weight"] = [hd]
        out[f"{p}mlp.gate_proj.weight"] = [mlp, hidden]
        out[f"{p}mlp.up_proj.weight"] = [mlp, hidden]
        out[f"{p}mlp.down_proj.weight"] = [hidden, mlp]
        out[f"{p}per_layer_input_gate.weight"] = [per_layer, hidden]
        out[f"{p}per_layer_projection.weight"] = [hidden, per_layer]
    return out


@pytest.mark.parametrize("layout,count", [("regular", 600), ("qat", 540)])
def test_full_size_fixture_is_the_documented_e2b(tmp_path, layout, count):
    # The synthetic full-size E2B (what test_preflight, test_checkpoint and
    # test_hub_preflight check) against the tensor list written out from
    # the facts, not from the code under test: names and shapes.
    documented = _documented_e2b(layout)
    assert len(documented) == count  # the facts' own count
    path = synthetic.write_header_only(tmp_path, "e2b", layout)
    lm = {name.removeprefix(LM): list(info.shape)
          for name, info in open_checkpoint(path).tensors.items()
          if name.startswith(LM)}
    assert lm == documented
