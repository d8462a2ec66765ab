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
