"""The image-step substitutions act for gemma_qat only: tpu-inference's own
runner method and Gemma 4's pixel parsing, wrapped as the plugin installs
them, called for a runner / model built with each load format."""
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest

from vllm_gemma_qat import substitute
from vllm_gemma_qat.fixes import image_steps


@pytest.fixture(scope="module")
def installed(plugin):
    import tpu_inference.models.jax.gemma4_mm  # noqa: F401 (installs)
    for s in image_steps.substitutions():
        assert substitute.installed(s.target), s.target


def _config(load_format):
    import torch
    return SimpleNamespace(load_config=SimpleNamespace(load_format=load_format),
                           model_config=SimpleNamespace(dtype=torch.float32))


@pytest.mark.parametrize("load_format", ["gemma_qat", "auto"])
def test_token_ids_kept_with_image_embeds_for_gemma_qat_only(installed,
                                                             load_format):
    import jax.numpy as jnp
    from tpu_inference.runner.tpu_runner import TPUModelRunner
    runner = MagicMock(is_multimodal_model=True,
                       vllm_config=_config(load_format))
    runner.embed_input_ids_fn.return_value = jnp.ones((3, 8))
    ids = jnp.array([5, 7, 9], jnp.int32)
    got_ids, _ = TPUModelRunner._get_input_ids_embeds(
        runner, ids, [jnp.zeros((2, 8))], jnp.array([False, True, True]))
    if load_format == "gemma_qat":
        np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids))
    else:
        assert got_ids is None  # tpu-inference 0.32 as it is


@pytest.mark.parametrize("load_format", ["gemma_qat", "auto"])
def test_float32_pixels_read_by_value_for_gemma_qat_only(installed,
                                                         load_format):
    import torch
    from tpu_inference.models.jax.gemma4_mm import \
        Gemma4ForConditionalGeneration
    model = SimpleNamespace(vllm_config=_config(load_format))
    pixels = torch.linspace(-1, 1, 2 * 4 * 48).reshape(2, 4, 48)
    parsed = Gemma4ForConditionalGeneration._parse_and_validate_image_input(
        model, pixel_values=pixels,
        pixel_position_ids=torch.zeros((2, 4, 2), dtype=torch.int64))
    got = np.asarray(parsed["pixel_values"])
    if load_format == "gemma_qat":
        np.testing.assert_array_equal(got, pixels.numpy())
    else:  # the bit-cast: twice as wide, not the pixels
        assert got.shape == (2, 4, 96)
