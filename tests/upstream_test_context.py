"""What the tests the patch appends to tpu-inference's
tests/models/jax/test_gemma4_kv_share.py rely on from the top of that file
(not in the wheel, so not here): imports, the one-device `mesh` fixture,
pipeline-parallel group stand-in, `_make_text_config`, `_make_vllm_config`.
Written for this repository with the same names and signatures; the
upstream-patch test runs the appended tests under it."""
from unittest.mock import MagicMock, patch

import jax
import numpy as np
import pytest
from flax import nnx  # noqa: F401 (used by the appended tests)
from jax.sharding import Mesh
from transformers import Gemma4TextConfig

from tpu_inference.models.common.kv_share import (  # noqa: F401
    compute_kv_share_map, skip_kv_shared_layer_weights)
from tpu_inference.models.jax.gemma4 import Gemma4Model  # noqa: F401


@pytest.fixture(scope="module")
def mesh():
    devices = np.array(jax.local_devices()[:1]).reshape((1, 1, 1, 1))
    with Mesh(devices, axis_names=("data", "attn_dp", "expert", "model")) as m:
        yield m


@pytest.fixture(autouse=True)
def single_pp_group():
    group = MagicMock(is_first_rank=True, is_last_rank=True, rank_in_group=0,
                      world_size=1)
    with patch("tpu_inference.models.jax.gemma4.get_pp_group",
               return_value=group), \
            patch("tpu_inference.layers.jax.pp_utils.get_pp_group",
                  return_value=group):
        yield


def _make_text_config(*, num_hidden_layers, num_kv_shared_layers, layer_types,
                      hidden_size_per_layer_input=0):
    return Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=8,
        rms_norm_eps=1e-6, layer_types=list(layer_types),
        num_kv_shared_layers=num_kv_shared_layers,
        hidden_size_per_layer_input=hidden_size_per_layer_input,
        attention_bias=False)


def _make_vllm_config(text_config):
    hf_config = MagicMock(text_config=text_config, tie_word_embeddings=False)
    model_config = MagicMock(hf_config=hf_config, dtype=jax.numpy.float32)
    model_config.get_vocab_size = lambda: text_config.vocab_size
    return MagicMock(model_config=model_config, quant_config=None,
                     cache_config=MagicMock(cache_dtype="auto"))
