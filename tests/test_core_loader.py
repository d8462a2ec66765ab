"""--load-format gemma_qat against the real tpu-inference JAX Gemma 4 on CPU."""
import re
import subprocess
import sys

import numpy as np
import pytest

import harness
from vllm_gemma_qat import cpu
from vllm_gemma_qat.testing import runner

CASES = [("e2b", True), ("e4b", False)]  # E2B-like multimodal, E4B-like text


def _shared_layers(model_interface):
    text = model_interface.model.vllm_config.model_config.hf_config.text_config
    from tpu_inference.models.common.kv_share import compute_kv_share_map
    return compute_kv_share_map(text)


def _layer_params(model_interface, layer):
    # The language model's layers (`language_model.layers.N` since
    # tpu-inference 0.23, `model.layers.N` before), never the towers'.
    pattern = re.compile(rf"(?:^|\.)layers\.{layer}\.self_attn\.(\w+)\.")
    return {m.group(1) for name, _ in model_interface.model.named_parameters()
            if not name.startswith(("vision_tower.", "audio_tower."))
            and (m := pattern.search(name))}


@pytest.mark.parametrize("layout", ["qat", "regular"])
@pytest.mark.parametrize("geometry,multimodal", CASES)
def test_gemma_qat_loads_both_layouts_without_shared_kv_params(
        plugin, tiny_models, geometry, multimodal, layout):
    path = tiny_models.checkpoint(geometry, multimodal, layout)
    model, _, _ = runner.load(path, "gemma_qat")
    share = _shared_layers(model)
    assert share, "tiny geometry must have KV-shared layers"
    for layer in range(max(share) + 1):
        params = _layer_params(model, layer)
        if layer in share:
            assert params == {"q_proj", "q_norm", "o_proj"}, (layer, params)
        else:
            assert {"k_proj", "v_proj", "k_norm"} <= params, (layer, params)


@pytest.mark.parametrize("geometry,multimodal", CASES)
def test_logits_match_transformers_prefill_and_decode(plugin, tiny_models,
                                                      geometry, multimodal):
    from vllm_gemma_qat.testing.tiny import SLIDING_WINDOW
    hf = tiny_models.model(geometry, multimodal)
    path = tiny_models.checkpoint(geometry, multimodal, "qat")
    model, config, mesh = runner.load(path, "gemma_qat")
    prompt = list(np.random.RandomState(0).randint(3, 500, size=21))
    assert len(prompt) > 2 * SLIDING_WINDOW
    with cpu.kernels():
        paged = runner.PagedRunner(model, config, mesh)
        logits = paged.step(prompt)
        np.testing.assert_allclose(logits, harness.hf_logits(hf, prompt),
                                   atol=1e-4, rtol=0)
        tokens = list(prompt)
        for _ in range(8):
            tokens.append(int(np.argmax(logits[-1])))
            logits = paged.step(tokens[-1:])
            full = runner.PagedRunner(model, config, mesh).step(tokens)
            np.testing.assert_allclose(logits[-1], full[-1], atol=1e-4, rtol=0)
            np.testing.assert_allclose(logits[-1],
                                       harness.hf_logits(hf, tokens)[-1],
                                       atol=1e-4, rtol=0)


def test_auto_still_fails_on_qat_layout_with_3225_error(plugin, tiny_models):
    path = tiny_models.checkpoint("e2b", True, "qat")
    with pytest.raises(ValueError, match=r"Following weights were not "
                       r"initialized from checkpoint.*layers\.\d+\.self_attn"
                       r"\.k_norm\.weight"):
        runner.load(path, "auto")


def test_auto_still_loads_regular_layout_unchanged(plugin, tiny_models):
    path = tiny_models.checkpoint("e2b", True, "regular")
    model, _, _ = runner.load(path, "auto")
    for layer in _shared_layers(model):
        assert {"k_proj", "v_proj", "k_norm"} <= _layer_params(model, layer)


def test_entry_point_registers_gemma_qat_loader_in_a_fresh_process():
    code = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins(); load_general_plugins()  # idempotent
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
loader = get_model_loader(LoadConfig(load_format="gemma_qat"))
print(type(loader).__module__, type(loader).__name__)
assert "tpu_inference.models.jax.gemma4" not in sys.modules  # stays lazy
import tpu_inference.models.jax.gemma4
from vllm_gemma_qat.substitute import installed
print("patched", installed(
    "tpu_inference.models.jax.gemma4:Gemma4Attention.__init__"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vllm_gemma_qat.loader GemmaQatModelLoader" in out.stdout
    assert "patched True" in out.stdout
