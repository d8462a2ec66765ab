"""Bad checkpoints end in one clear error that names the culprit, raised by
the real load path before anything could be served."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

import harness
from vllm_gemma_qat.checkpoint import CheckpointError


@pytest.fixture
def qat_copy(tiny_models, tmp_path):
    src = tiny_models.checkpoint("e2b", True, "qat")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit):
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_non_gemma4_model(plugin, tmp_path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=128)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"Qwen3ForCausalLM.*not Gemma 4"):
        harness.load(tmp_path, "gemma_qat")


def test_missing_tensor(plugin, qat_copy):
    name = "model.language_model.layers.3.mlp.down_proj.weight"
    _edit_tensors(qat_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensor {name}"):
        harness.load(qat_copy, "gemma_qat")


def test_wrong_shape_names_tensor_and_both_shapes(plugin, qat_copy):
    import torch
    name = "model.language_model.layers.2.self_attn.q_proj.weight"

    def edit(t):
        t[name] = torch.zeros(100, 64)

    _edit_tensors(qat_copy, edit)
    with pytest.raises(CheckpointError,
                       match=rf"{name} has shape \[100, 64\], expected \[256, 64\]"):
        harness.load(qat_copy, "gemma_qat")


def test_truncated_shard_names_file(plugin, qat_copy):
    shard = qat_copy / "model.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        harness.load(qat_copy, "gemma_qat")


def test_corrupt_header_entry_names_file_and_tensor(plugin, qat_copy):
    # Still valid JSON (vLLM's own config-time header scan accepts it), but
    # the entry's byte range no longer matches its dtype and shape.
    shard = qat_copy / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].decode()
    name = "model.language_model.norm.weight"
    start = header.index(f'"{name}"')
    header = header[:start] + header[start:].replace('"F32"', '"F16"', 1)
    raw[8:8 + n] = header.encode()
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError,
                       match=rf"model\.safetensors: corrupt safetensors header "
                       rf"entry for tensor {name}"):
        harness.load(qat_copy, "gemma_qat")


def test_num_kv_shared_layers_disagreeing_with_tensors(plugin, qat_copy):
    config_file = qat_copy / "config.json"
    config = json.loads(config_file.read_text())
    config["text_config"]["num_kv_shared_layers"] = 4  # checkpoint has 5
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError,
                       match=r"num_kv_shared_layers=4, but the checkpoint has "
                       r"K/V projections for 5 of 10 layers"):
        harness.load(qat_copy, "gemma_qat")
