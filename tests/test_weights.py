"""weights.py in-process on a tiny regular export (shared-layer K/V shipped):
what is fed to `load_weights`, what is skipped, and the strict accounting."""
import pytest

from vllm_gemma_qat import geometry, weights
from vllm_gemma_qat.checkpoint import CheckpointError, open_checkpoint


@pytest.fixture(scope="module")
def regular(tiny_models):
    ckpt = open_checkpoint(tiny_models.checkpoint("e2b", True, "regular"))
    return ckpt, geometry.check(ckpt)


def test_feed_skips_exactly_the_reports_shared_kv(regular):
    ckpt, report = regular
    feed = weights.WeightFeed(report)
    names = [name for name, _ in feed.tensors(ckpt)]
    assert report.skipped and set(names).isdisjoint(report.skipped)
    assert sorted(names + report.skipped) == sorted(ckpt.tensors)
    assert feed.handed_over == len(names)
    assert "skipped 15 unused k_proj/v_proj/k_norm tensors of KV-shared " \
        "layers 5-9" in feed.skip_summary()


@pytest.mark.parametrize("served", ["bfloat16", "float32"])
def test_feed_hands_over_floating_tensors_in_the_served_dtype(regular, served):
    # tpu-inference's JAX loader keeps a tensor's own dtype; vLLM's --dtype
    # arrives as a JAX dtype there (as a torch dtype on vLLM's torch model).
    import jax.numpy as jnp
    import torch
    ckpt, report = regular
    stored = {n: t.dtype for n, t in weights.stream_tensors(ckpt, bool)}
    assert set(stored.values()) - {torch.bfloat16, torch.float32} == set()
    for dtype in (jnp.dtype(served), getattr(torch, served)):
        fed = dict(weights.WeightFeed(report, dtype=dtype).tensors(ckpt))
        assert {t.dtype for t in fed.values()} == {getattr(torch, served)}


def test_feed_keeps_int4_tensors_as_stored(tmp_path):
    import torch

    from vllm_gemma_qat.testing import tiny
    tiny.save_servable_int4(tmp_path, "w4a16")
    ckpt = open_checkpoint(tmp_path)
    report = geometry.check(ckpt)
    fed = dict(weights.WeightFeed(report, dtype=torch.float32).tensors(ckpt))
    stored = dict(weights.stream_tensors(ckpt, bool))
    packed = [n for n in fed if n.endswith(("weight_packed", "weight_scale"))]
    assert packed and all(fed[n].dtype == stored[n].dtype for n in packed)
    assert {fed[n].dtype for n in fed if n not in packed
            and fed[n].is_floating_point()} == {torch.float32}


def test_verify_counts_tensors_never_read(regular):
    import torch
    ckpt, report = regular
    feed = weights.WeightFeed(report)
    next(feed.tensors(ckpt))
    with pytest.raises(CheckpointError, match=rf"only 1\d* of "
                       rf"{len(ckpt.tensors)} checkpoint tensors were read"):
        feed.verify(torch.nn.Linear(2, 2), {"weight", "bias"}, ckpt)


def test_verify_names_parameters_not_loaded(regular):
    import torch
    ckpt, report = regular
    feed = weights.WeightFeed(report)
    for _ in feed.tensors(ckpt):
        pass
    with pytest.raises(CheckpointError, match=r"model parameters not "
                       r"initialized from the checkpoint: \['bias'\]"):
        feed.verify(torch.nn.Linear(2, 2), {"weight"}, ckpt)
    feed.verify(torch.nn.Linear(2, 2), {"weight", "bias"}, ckpt)


def test_param_bytes_count_int4_as_half_a_byte():
    import jax.numpy as jnp

    class Params:
        def named_parameters(self):
            return [("w", jnp.zeros((4, 8), jnp.int4)),
                    ("b", jnp.zeros((4, ), jnp.bfloat16))]

    assert weights.param_bytes_by_dtype(Params()) == {"int4": 16,
                                                      "bfloat16": 8}


def test_shared_layer_kv_params_are_the_language_models_only():
    # Parameter names as tpu-inference 0.32's multimodal Gemma 4 has them:
    # its vision tower numbers its layers too, each with its own k_proj.
    names = ["model.language_model.layers.4.self_attn.k_proj.weight",
             "model.language_model.layers.5.self_attn.q_proj.weight",
             "model.language_model.layers.5.self_attn.k_norm.weight",
             "model.vision_tower.layers.5.self_attn.k_proj.weight"]

    class Params:
        def named_parameters(self):
            return [(name, None) for name in names]

    assert weights.shared_layer_kv_params(Params(), {5: 4}) == [
        "model.language_model.layers.5.self_attn.k_norm.weight"]
