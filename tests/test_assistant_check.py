"""A Gemma 4 assistant (`--speculative-config '{"model": ASSISTANT}'`) is
checked against its target as strictly as the target itself: header-level
unit tests of `assistant.check`, and `vllm serve` stopping before any engine
starts with one CheckpointError naming both values (#30)."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from vllm_gemma_qat import assistant as spec
from vllm_gemma_qat.checkpoint import CheckpointError, open_checkpoint
from vllm_gemma_qat.testing import assistant, tiny


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target") / "t"
    tiny.save_servable(path, "e2b", multimodal=False)
    return path


def config_of(path):
    return json.loads((path / "config.json").read_text())


def write(tmp_path, target, name="a", **kwargs):
    model = assistant.build(assistant.target_text_config(target), **kwargs)
    return assistant.save(model, tmp_path / name)


def report(path, target):
    return spec.check(open_checkpoint(path), config_of(target), str(target))


def test_a_fitting_assistant_passes(tmp_path, target):
    path = write(tmp_path, target)
    r = report(path, target)
    assert r.errors() == [] and r.loads_with_gemma_qat
    # per Q-only layer: 4 norms, layer_scalar, q_proj, q_norm, o_proj and
    # the MLP (11); embed_tokens, norm, pre_ and post_projection
    assert len(r.expected) == 2 * 11 + 4
    assert not any("k_proj" in n or "v_proj" in n for n in r.expected)


def test_centroid_masking_tensors_are_expected(tmp_path, target):
    path = write(tmp_path, target, use_ordered_embeddings=True)
    r = report(path, target)
    assert r.errors() == []
    assert r.expected["masked_embedding.centroids.weight"] == (16, 64)
    assert r.expected["masked_embedding.token_ordering"] == (512, )


@pytest.mark.parametrize("overrides,message", [
    (dict(global_head_dim=512), "layer 1 (full_attention) has head_dim 512, "
     "the target's layer 4 whose cache it reads has 256"),
    (dict(head_dim=256), "layer 0 (sliding_attention) has head_dim 256, the "
     "target's layer 3 whose cache it reads has 128"),
    (dict(num_key_value_heads=2, num_global_key_value_heads=2),
     "layer 0 (sliding_attention) has KV heads 2, the target's layer 3 whose "
     "cache it reads has 1"),
    (dict(sliding_window=16), "sliding_window is 16, the target's is 8"),
])
def test_geometry_mismatch_names_both_values(tmp_path, target, overrides,
                                             message):
    path = write(tmp_path, target, **overrides)
    with pytest.raises(CheckpointError) as e:
        report(path, target).raise_if_invalid()
    assert str(e.value).startswith(f"assistant {path} does not fit target "
                                   f"{target}: ")
    assert message in str(e.value)


def test_config_mismatches_name_both_values(tmp_path, target):
    path = write(tmp_path, target)
    config = config_of(path)
    config["backbone_hidden_size"] = 96
    config["text_config"]["num_kv_shared_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    errors = report(path, target).errors()
    assert "backbone_hidden_size is 96, the target's hidden_size is 64" in errors
    assert ("num_kv_shared_layers is 1, but an assistant's 2 layers must all "
            "be KV-shared (num_kv_shared_layers = num_hidden_layers = 2)"
            in errors)


def test_kv_projection_and_missing_tensor(tmp_path, target):
    path = write(tmp_path, target)
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.k_proj.weight"] = \
        tensors["model.layers.0.self_attn.q_proj.weight"][:128].clone()
    del tensors["post_projection.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    errors = report(path, target).errors()
    assert ("unexpected tensor model.layers.0.self_attn.k_proj.weight (a K/V "
            "tensor: an assistant's layers are Q-only)") in errors
    assert "missing tensor post_projection.weight (expected shape [64, 64])" \
        in errors


def test_not_an_assistant(tmp_path, target):
    copy = shutil.copytree(target, tmp_path / "t")
    errors = report(copy, target).errors()
    assert len(errors) == 1 and "is not a Gemma 4 assistant" in errors[0]


def test_vllm_serve_fails_fast_on_a_mismatched_assistant(tmp_path, target):
    # Checked where vLLM turns its arguments into a config, with the target:
    # no engine starts, the last line names both values.
    from test_bad_input import _vllm_serve
    path = write(tmp_path, target, sliding_window=16)
    out = _vllm_serve(target, "--speculative-config", json.dumps(
        {"model": str(path), "num_speculative_tokens": 2}))
    assert out.returncode != 0
    last = out.stdout.strip().splitlines()[-1]
    assert last == (f"vllm_gemma_qat.checkpoint.CheckpointError: assistant "
                    f"{path} does not fit target {target}: sliding_window is "
                    "16, the target's is 8"), last
    assert "EngineCore" not in out.stdout


def test_plan_counts_the_assistant_with_the_target(tmp_path, target):
    # The assistant's weights (bf16 here) join the target's on every chip
    # and come out of the KV budget; a mismatched one is the loader's error.
    import torch
    from test_preflight import cli
    path = assistant.save(assistant.build(
        assistant.target_text_config(target)).to(torch.bfloat16),
        tmp_path / "a")
    numel = sum(t.numel for t in open_checkpoint(path).tensors.values())
    args = ("plan", target, "--agents", "1", "--context", "256", "--json")
    rc, out, _ = cli(*args)
    alone = json.loads(out)
    rc, out, _ = cli(*args, "--assistant", path)
    both = json.loads(out)
    assert rc == 0 and both["assistant_bytes"] == 2 * numel
    assert both["weight_bytes"] - alone["weight_bytes"] == 2 * numel
    assert alone["budget_bytes"] - both["budget_bytes"] == 2 * numel
    assert both["kv_bytes_per_token"] == alone["kv_bytes_per_token"]
    rc, out, _ = cli(*args[:-1], "--assistant", path)
    assert "assistant   0.00 GB of it, whole on every chip" in out
    assert "no KV of its own" in out
    bad = write(tmp_path, target, "bad", sliding_window=16)
    rc, out, err = cli(*args[:-1], "--assistant", bad)
    assert rc == 2 and "sliding_window is 16, the target's is 8" in out + err


def test_vllm_serve_refuses_a_draft_that_is_not_an_assistant(tmp_path, target):
    # Without a draft_load_config of its own, gemma_qat's loader would get
    # it: named before any engine starts, with the way out.
    from test_bad_input import _vllm_serve
    out = _vllm_serve(target, "--speculative-config", json.dumps(
        {"model": str(target), "num_speculative_tokens": 2}))
    assert out.returncode != 0
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("vllm_gemma_qat.checkpoint.CheckpointError: draft "
                           f"model {target}: architectures "
                           "['Gemma4ForCausalLM']"), last
    assert last.endswith('"draft_load_config": {"load_format": "auto"}'), last
    assert "EngineCore" not in out.stdout
