"""Image requests on Gemma 4, fixed under --load-format gemma_qat only.

Two tpu-inference 0.32 bugs break every engine step that carries image
embeddings (upstream patch: patches/0002-*):

- The runner hands a multimodal model its merged input embeddings and no
  token ids (`TPUModelRunner._get_input_ids_embeds` returns `(None,
  embeds)`). Gemma 4's per-layer inputs are a lookup by token id, which then
  uses id 0 for every token of the step: the image request's own text and
  every other request batched into that step are computed wrong. Here the
  model gets both, and the precompiled "backbone with embeds" programs are
  traced with token ids too, so a TPU finds them at run time.
- `Gemma4ForConditionalGeneration._parse_and_validate_image_input`
  reinterprets the bits of `pixel_values` as bf16 whatever their dtype
  (float32 serving crashes the engine; fp16 would be silently wrong). Here
  they are converted by value to the model's dtype.

Installed when tpu-inference's `gemma4_mm` is imported; each replacement
acts only for a model or runner built with the gemma_qat load format.
"""
from __future__ import annotations

import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

TARGET_MODULE = "tpu_inference.models.jax.gemma4_mm"
RUNNER = "tpu_inference.runner.tpu_runner:TPUModelRunner"
COMPILATION = "tpu_inference.runner.compilation_manager:CompilationManager"


def install() -> None:
    substitute.apply_on_import(
        TARGET_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, images)")


def substitutions() -> list[Substitution]:
    return [
        Substitution(f"{RUNNER}._get_input_ids_embeds", _ids_with_embeds,
                     "steps with image embeddings keep their token ids "
                     "(Gemma 4's per-layer inputs are looked up by id)",
                     wraps=True),
        Substitution(f"{COMPILATION}._precompile_backbone_helper",
                     _precompile_embeds_with_ids,
                     "the precompiled image-step programs take token ids "
                     "as the run-time steps now do", wraps=True),
        Substitution(f"{TARGET_MODULE}:Gemma4ForConditionalGeneration."
                     "_parse_and_validate_image_input", _pixels_by_value,
                     "pixel_values converted by their dtype, not bit-cast "
                     "to bf16", wraps=True),
    ]


def _ids_with_embeds(get_input_ids_embeds):

    @functools.wraps(get_input_ids_embeds)
    def wrapped(self, input_ids, mm_embeds, is_mm_embed):
        ids, embeds = get_input_ids_embeds(self, input_ids, mm_embeds,
                                           is_mm_embed)
        if (ids is None and embeds is not None
                and is_gemma_qat(self.vllm_config)):
            return input_ids, embeds
        return ids, embeds

    return wrapped


def _precompile_embeds_with_ids(helper):

    @functools.wraps(helper)
    def wrapped(self, name, *, input_ids, inputs_embeds, **kwargs):
        if (input_ids is None and inputs_embeds is not None
                and is_gemma_qat(self.runner.vllm_config)):
            import jax.numpy as jnp
            from jax.sharding import NamedSharding, PartitionSpec
            from tpu_inference.layers.common.sharding import ShardingAxisName
            # As `_precompile_backbone_text_only` makes its token ids.
            input_ids = self._create_dummy_tensor(
                (inputs_embeds.shape[0], ), jnp.int32,
                NamedSharding(self.runner.mesh,
                              PartitionSpec(ShardingAxisName.BATCH)))
        return helper(self, name, input_ids=input_ids,
                      inputs_embeds=inputs_embeds, **kwargs)

    return wrapped


def _pixels_by_value(parse):

    @functools.wraps(parse)
    def wrapped(self, **kwargs):
        import torch
        pixel_values = kwargs.get("pixel_values")
        if isinstance(pixel_values, torch.Tensor) and is_gemma_qat(
                self.vllm_config):
            from tpu_inference.models.jax.utils.multi_modal_utils import \
                convert_torch_tensor_to_jax
            from tpu_inference.utils import to_jax_dtype
            dtype = to_jax_dtype(self.vllm_config.model_config.dtype)
            kwargs["pixel_values"] = convert_torch_tensor_to_jax(pixel_values,
                                                                 dtype)
        return parse(self, **kwargs)

    return wrapped
