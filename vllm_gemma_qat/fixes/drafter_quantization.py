"""The drafter of speculative decoding is built with its own quantization
config, not the target's (twin of patches/0007), under `--load-format
gemma_qat` only.

tpu-inference 0.32's `get_flax_model` sets `vllm_config.quant_config =
get_tpu_quantization_config(vllm_config)` from the TARGET's model config
for the drafter too, and `Gemma4MTPForCausalLM` builds its linears with it.
An int4 target (compressed-tensors w4a16, or the q4_0 export with the
int4 overrides) then gets a drafter whose linears expect packed int4
tensors, and a bf16 assistant fails to load (`There is no module or
parameter named 'model.layers.0.mlp.down_proj.weight' in
Gemma4MTPForCausalLM`). vLLM's torch drafters use the draft model's own
(`get_draft_quant_config`). Here, while the drafter is built, the
quantization config comes from `speculative_config.draft_model_config`
(a bf16 assistant: unquantized), and the target's is put back afterwards.
"""
from __future__ import annotations

import contextvars
import functools
import types

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

TARGET_MODULE = "tpu_inference.models.common.model_loader"

_building_drafter = contextvars.ContextVar("building_gemma_qat_drafter",
                                           default=None)


def install() -> None:
    substitute.apply_on_import(
        TARGET_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only)")


def substitutions() -> list[Substitution]:
    return [
        Substitution(f"{TARGET_MODULE}:get_flax_model", marking_the_drafter,
                     "speculative decoding: mark the drafter's build (and "
                     "give the target its quantization config back after)",
                     wraps=True),
        Substitution(f"{TARGET_MODULE}:get_tpu_quantization_config",
                     from_the_draft_model_config,
                     "speculative decoding: the drafter's quantization "
                     "config is the draft model's (was: the target's)",
                     wraps=True),
    ]



def marking_the_drafter(get_flax_model):

    @functools.wraps(get_flax_model)
    def wrapped(vllm_config, rng, mesh, is_draft_model=False, *args,
                **kwargs):
        if not (is_draft_model and is_gemma_qat(vllm_config)):
            return get_flax_model(vllm_config, rng, mesh, is_draft_model,
                                  *args, **kwargs)
        target_quant_config = vllm_config.quant_config
        token = _building_drafter.set(
            vllm_config.speculative_config.draft_model_config)
        try:
            return get_flax_model(vllm_config, rng, mesh, True, *args,
                                  **kwargs)
        finally:
            _building_drafter.reset(token)
            vllm_config.quant_config = target_quant_config

    return wrapped


def from_the_draft_model_config(get_tpu_quantization_config):

    @functools.wraps(get_tpu_quantization_config)
    def wrapped(vllm_config, *args, **kwargs):
        draft_model_config = _building_drafter.get()
        if draft_model_config is None:
            return get_tpu_quantization_config(vllm_config, *args, **kwargs)
        # It reads only `model_config` (its quantization and hf_config).
        return get_tpu_quantization_config(
            types.SimpleNamespace(model_config=draft_model_config), *args,
            **kwargs)

    return wrapped
