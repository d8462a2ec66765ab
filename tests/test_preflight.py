"""`vllm-gemma-qat inspect` / `plan` on header-only checkpoints with the real
E2B / E4B shapes (sparse files), and on tiny transformers checkpoints."""
import json
import shutil
import subprocess

import pytest

from vllm_gemma_qat.testing import synthetic

CLI = shutil.which("vllm-gemma-qat")


def cli(*args):
    out = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True,
                         timeout=60)
    return out.returncode, out.stdout, out.stderr


def inspect_json(path):
    rc, out, err = cli("inspect", path, "--json")
    return rc, json.loads(out)


# Language-model tensors: 5 global + 17 per layer, 3 fewer (k_proj, v_proj,
# k_norm) per KV-shared layer in the QAT exports (../shared/GEMMA4_FACTS.md
# states E2B's 600 / 540, test_geometry checks that list name by name); E4B
# by the same rule from its config (42 layers, 18 KV-shared), no E4B
# header having been seen here.
E2B = (35, 20)
E4B = (42, 18)


def _lm_tensors(layers_shared, layout):
    layers, shared = layers_shared
    return 5 + 17 * layers - (3 * shared if layout == "qat" else 0)


@pytest.mark.parametrize("name,layout,tensors,skipped,gemma_qat,auto", [
    ("e2b", "regular", _lm_tensors(E2B, "regular"), 3 * E2B[1], True, True),
    ("e2b", "qat", _lm_tensors(E2B, "qat"), 0, True, False),
    ("e4b", "regular", _lm_tensors(E4B, "regular"), 3 * E4B[1], True, True),
    ("e4b", "qat", _lm_tensors(E4B, "qat"), 0, True, False),
])
def test_inspect_counts_and_verdicts(tmp_path, name, layout, tensors, skipped,
                                     gemma_qat, auto):
    path = synthetic.write_header_only(tmp_path / "c", name, layout)
    rc, s = inspect_json(path)
    assert rc == 0
    assert s["language_model_tensors"] == tensors
    assert s["expected_tensors"] == tensors - skipped
    assert s["skipped_shared_kv_tensors"] == skipped
    assert (s["missing"], s["unexpected"], s["wrong_shape"]) == ([], [], [])
    assert (s["loads_with_gemma_qat"], s["loads_with_auto"]) == (gemma_qat, auto)
    assert s["export_kind"] == {"regular": "regular-bf16",
                                "qat": "qat-bf16"}[layout]


def test_inspect_e2b_geometry_text(tmp_path):
    path = synthetic.write_header_only(tmp_path / "c", "e2b", "qat")
    rc, out, _ = cli("inspect", path)
    assert rc == 0
    assert "35 (28 sliding, 7 full)" in out
    assert "20 layers (15-34); K/V from sliding -> 13, full -> 14" in out
    assert "with stock auto: no" in out and "#3225" in out


def test_inspect_w4a16_export_kind(tmp_path):
    path = synthetic.write_header_only(tmp_path / "c", "e2b", "w4a16")
    rc, s = inspect_json(path)
    assert rc == 0 and s["export_kind"] == "qat-w4a16-ct"
    # Every language-model Linear is packed, per_layer_model_projection too:
    # 7 per layer (q, o, gate, up, down, per-layer gate / projection), k and v
    # on the 15 non-shared layers, and the model-level projection.
    quantized = s["quantized_modules"]
    assert len(quantized) == 35 * 7 + 15 * 2 + 1
    assert "model.language_model.per_layer_model_projection" in quantized
    assert not any("embed" in m or "tower" in m for m in quantized)
    rc, out, _ = cli("inspect", path)
    assert "int4 modules  276 (layers.*.mlp.down_proj x35" in out
    assert s["loads_with_gemma_qat"] and not s["loads_with_auto"]
    assert set(s["weight_bytes_by_dtype"]) == {"BF16", "I32", "I64"}


def test_inspect_missing_tensor_is_a_no(tmp_path):
    name = "model.language_model.layers.7.mlp.up_proj.weight"
    path = synthetic.write_header_only(tmp_path / "c", "e2b", "qat",
                                       exclude={name})
    rc, s = inspect_json(path)
    assert rc == 1
    assert s["missing"] == [name] and not s["loads_with_gemma_qat"]


@pytest.mark.parametrize("damage,message", [
    ("truncate", r"model-00002-of-00002\.safetensors: truncated"),
    ("garbage", r"model-00001-of-00002\.safetensors: corrupt safetensors header"),
    ("missing_shard", r"model-00002-of-00002\.safetensors: shard named in "
     r"model\.safetensors\.index\.json is missing"),
    ("missing_config", r"config\.json: missing config\.json"),
    ("non_gemma", r"not Gemma 4"),
])
def test_damaged_checkpoints_exit_2_with_one_message(tmp_path, damage, message):
    import re
    path = synthetic.write_header_only(tmp_path / "c", "e2b", "qat")
    if damage == "truncate":
        shard = path / "model-00002-of-00002.safetensors"
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 1)
    elif damage == "garbage":
        with open(path / "model-00001-of-00002.safetensors", "r+b") as f:
            f.seek(8)
            f.write(b"\xff\xfe not json")
    elif damage == "missing_shard":
        (path / "model-00002-of-00002.safetensors").unlink()
    elif damage == "missing_config":
        (path / "config.json").unlink()
    elif damage == "non_gemma":
        (path / "config.json").write_text(json.dumps(
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    rc, out, err = cli("inspect", path)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_plan_e2b_reproduces_18_kib_per_token_and_1_21_gb(tmp_path):
    path = synthetic.write_header_only(tmp_path / "c", "e2b", "qat")
    rc, out, _ = cli("plan", path, "--agents", 8, "--context", 8192, "--json")
    p = json.loads(out)
    assert rc == 0 and p["fits"]
    assert p["kv_bytes_per_token"] == 18 * 1024
    # tpu-inference 0.32 as it is: every layer at full context.
    assert p["kv_total_bytes_full_context"] == 8 * 8192 * 18 * 1024
    assert round(p["kv_total_bytes_full_context"] / 1e9, 2) == 1.21
    # gemma_qat (#3220): the 12 sliding layers in 6 rows of a full layer's
    # page (tpu-inference's 256 tokens at --max-model-len 8192 x K and V x
    # 512 x 2 bytes), grouped with the 3 full layers in 3 groups of 3
    # pages; a request at 8192 tokens holds 32 blocks of the full group
    # and, per row group, what vLLM reserves for the 512-token window with
    # 2 x 1024 tokens in flight.
    assert p["kv_sliding_window"] and p["kv_block_size"] == 256
    assert p["kv_block_bytes"] == 3 * 256 * 2 * 512 * 2
    assert p["kv_blocks_per_agent"] == 32 + 2 * (-(-(511 + 2048) // 256) + 1)
    assert p["kv_total_bytes"] == 8 * 54 * 3 * 256 * 2 * 512 * 2
    assert p["max_agents_at_context"] > \
        1.5 * p["max_agents_at_context_full_context"]


def test_plan_from_config_and_int4_and_overflow(tmp_path):
    path = synthetic.write_header_only(tmp_path / "c", "e4b", "qat")
    rc, out, _ = cli("plan", path / "config.json", "--json")
    bf16 = json.loads(out)
    rc4, out, _ = cli("plan", path / "config.json", "--weights", "int4", "--json")
    int4 = json.loads(out)
    assert rc == rc4 == 0
    assert int4["weight_bytes"] < 0.75 * bf16["weight_bytes"]
    # E4B: 24 non-shared layers, 20 sliding x 256 + 4 full x 512, 2 KV heads.
    assert bf16["kv_bytes_per_token"] == (20 * 256 + 4 * 512) * 2 * 2 * 2
    rc, out, _ = cli("plan", path, "--agents", 64, "--context", 131072)
    assert rc == 1 and "does NOT fit" in out


def test_inspect_agrees_with_transformers_checkpoints(tiny_models):
    for layout, skipped in (("qat", 0), ("regular", 15)):
        rc, s = inspect_json(tiny_models.checkpoint("e2b", True, layout))
        assert rc == 0, s["errors"]
        assert s["skipped_shared_kv_tensors"] == skipped
        assert s["language_model_tensors"] == s["expected_tensors"] + skipped


def test_config_only_directory(tmp_path):
    # What `hf download REPO config.json` leaves: plan works from the
    # config, inspect says what is missing and points to plan.
    full = synthetic.write_header_only(tmp_path / "full", "e2b", "qat")
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(full / "config.json", only / "config.json")
    rc, out, err = cli("plan", only, "--json")
    assert rc == 0, err
    p = json.loads(out)
    assert p["weights_from"] == "config (language model only)"
    assert p["kv_bytes_per_token"] == 18 * 1024
    rc, out, err = cli("inspect", only)
    assert rc == 2 and out == ""
    assert "config.json but no *.safetensors shards" in err
    assert f"vllm-gemma-qat plan {only}" in err


def test_structural_guard_on_gemma4_sources():
    import importlib.util
    from pathlib import Path

    from vllm_gemma_qat.fixes.kv_share import unsupported_structure_in_source
    source = Path(importlib.util.find_spec("tpu_inference").origin).parent.joinpath(
        "models/jax/gemma4.py").read_text()
    assert unsupported_structure_in_source(source) is None
    anchor = "class Gemma4Attention(JaxModule):\n"
    fused = source.replace(anchor, anchor + "    qkv_proj = None\n", 1)
    assert unsupported_structure_in_source(fused) == (
        "Gemma4Attention fuses Q/K/V into one qkv_proj")
    no_sharing = source.replace("compute_kv_share_map", "share_map")
    assert "no KV sharing" in unsupported_structure_in_source(no_sharing)
    renamed = source.replace("self.k_norm =", "self.key_norm =")
    assert unsupported_structure_in_source(renamed) == (
        "Gemma4Attention no longer sets self.k_norm")


def test_plan_validates_inputs_and_caps_at_the_model_context(tmp_path):
    path = synthetic.write_header_only(tmp_path / "c", "e2b", "qat")
    rc, out, _ = cli("plan", path, "--agents", 2, "--context", 200000)
    assert rc == 1
    assert ("200000 tokens exceeds the model's max_position_embeddings "
            "131072: does NOT fit") in out
    rc, out, _ = cli("plan", path, "--agents", 1, "--json")
    p = json.loads(out)
    assert rc == 0 and p["max_context_for_agents"] == 131072
    assert p["context_limit"] == 131072
    for args, message in ((("--agents", 0), "must be > 0, got 0"),
                          (("--context", -5), "must be > 0, got -5"),
                          (("--utilization", 1.5), r"must be in (0, 1], got 1.5")):
        rc, out, err = cli("plan", path, *args)
        assert rc == 2 and out == "" and message in err, err
    # --json: errors are JSON too.
    rc, out, _ = cli("plan", tmp_path / "nowhere", "--json")
    assert rc == 2 and "nowhere" in json.loads(out)["error"]
    rc, out, _ = cli("plan", "--help")
    assert "(default: 8192)" in out and "exit codes" in out


def test_plan_reports_weight_dtypes_as_they_are(tiny_models):
    # transformers wrote this tiny checkpoint in fp32.
    rc, out, _ = cli("plan", tiny_models.checkpoint("e2b", True, "qat"),
                     "--context", 1024)
    assert rc == 0 and "(f32; from checkpoint headers)" in out, out


def test_plan_per_chip_under_tensor_parallelism(tmp_path):
    e2b = synthetic.write_header_only(tmp_path / "e2b", "e2b", "qat")
    one = json.loads(cli("plan", e2b, "--json")[1])
    four = json.loads(cli("plan", e2b, "--tp", 4, "--json")[1])
    assert (one["tp"], four["tp"]) == (1, 4)
    assert four["weight_bytes"] == one["weight_bytes"]
    # Embeddings, attention and MLP split 4 ways; the per-layer-input
    # projections and norms stay whole on every chip.
    assert one["weight_bytes"] / 4 < four["weight_bytes_per_chip"] < \
        one["weight_bytes"] / 3
    # E2B's one KV head: every chip holds it whole (padded to TP).
    assert four["kv_bytes_per_token"] == one["kv_bytes_per_token"] == 18 * 1024
    assert four["max_agents_at_context"] > one["max_agents_at_context"]
    e4b = synthetic.write_header_only(tmp_path / "e4b", "e4b", "qat")
    one = json.loads(cli("plan", e4b, "--json")[1])
    two = json.loads(cli("plan", e4b, "--tp", 2, "--json")[1])
    four = json.loads(cli("plan", e4b, "--tp", 4, "--json")[1])
    # Two KV heads: split over 2 chips, padded to one per chip over 4.
    assert two["kv_bytes_per_token"] == four["kv_bytes_per_token"] == \
        one["kv_bytes_per_token"] // 2
    rc, out, _ = cli("plan", e4b, "--tp", 4, "--agents", 32)
    assert rc == 0 and "per chip (TP=4;" in out


def test_images_in_inspect_and_plan(tiny_models):
    # The vision tower's bytes summed here from the shard itself; tokens
    # per image from the config (vLLM budgets each image at the tower's
    # default_output_length soft tokens, plus boi / eoi).
    from safetensors import safe_open
    path = tiny_models.checkpoint("e2b", True, "qat")
    config = json.loads((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "np") as f:
        vision = sum(f.get_tensor(n).nbytes for n in f.keys()
                     if ".vision_tower." in n or ".embed_vision." in n)
    tokens = config["vision_config"]["default_output_length"] + 2
    rc, s = inspect_json(path)
    assert rc == 0 and vision > 0
    assert (s["vision_tower_bytes"], s["tokens_per_image"]) == (vision, tokens)
    rc, out, _ = cli("plan", path, "--context", 256, "--images", 3, "--json")
    p = json.loads(out)
    assert p["vision_tower_bytes"] == vision
    assert p["kv_bytes_per_image"] == tokens * p["kv_bytes_per_token"]
    assert p["images_per_agent"] == 3
    rc, out, _ = cli("plan", path, "--context", 256, "--images", 3)
    assert f"3 images per agent take {3 * tokens} of its 256" in out
    rc, s = inspect_json(tiny_models.checkpoint("e4b", False, "qat"))
    assert s["tokens_per_image"] is None and s["vision_tower_bytes"] == 0


def test_audio_in_inspect_and_plan(tmp_path):
    # A checkpoint with an audio tower: gemma_qat serves it, so inspect
    # and plan count its bytes (summed here from the shard itself) whole on
    # every chip, and a clip's KV positions (Gemma4Processor's default
    # budget, 750 soft tokens, plus boa / eoa).
    from safetensors import safe_open

    from vllm_gemma_qat.testing import tiny, tiny_mm
    path = tiny.save_checkpoint(tiny_mm.build_model("e2b", audio=True),
                                tmp_path / "audio")
    with safe_open(path / "model.safetensors", "np") as f:
        audio = sum(f.get_tensor(n).nbytes for n in f.keys()
                    if ".audio_tower." in n or ".embed_audio." in n)
    rc, s = inspect_json(path)
    assert rc == 0 and audio > 0 and s["loads_with_gemma_qat"]
    assert (s["audio_tower_bytes"], s["tokens_per_audio_clip"]) == (audio, 752)
    rc, out, _ = cli("plan", path, "--context", 1024, "--json")
    with_audio = json.loads(out)
    assert with_audio["audio_tower_bytes"] == audio
    assert with_audio["tokens_per_audio_clip"] == 752
    rc, out, _ = cli("plan", tiny.save_checkpoint(
        tiny_mm.build_model("e2b"), tmp_path / "no-audio"), "--context",
        1024, "--json")
    without = json.loads(out)
    assert without["tokens_per_audio_clip"] is None
    assert with_audio["weight_bytes_per_chip"] - without[
        "weight_bytes_per_chip"] == audio
