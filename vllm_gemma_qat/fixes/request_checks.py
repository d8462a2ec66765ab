"""Requests tpu-inference's runner cannot serve are refused by the API
server (400, naming the field), under --load-format gemma_qat only.
Upstream patch: patches/0010-*.

tpu-inference 0.32's runner raises in the engine for a request with
`prompt_logprobs` on a multimodal model ("prompt_logprobs is not supported
for multimodal models") or with a speculative-decoding drafter ("... with
speculative decoding"): the engine core dies and every open request gets a
500. All Gemma 4 E2B / E4B exports are multimodal. vLLM validates a
request's parameters in the API server (`InputProcessor._validate_params`,
where `TpuPlatform.validate_request` cannot see the model); the same two
conditions are checked there.
"""
from __future__ import annotations

import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"


def install() -> None:
    substitute.apply_on_import(
        INPUT_PROCESSOR_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, request checks)")


def substitutions() -> list[Substitution]:
    return [Substitution(
        f"{INPUT_PROCESSOR_MODULE}:InputProcessor._validate_params",
        _refusing_what_the_runner_cannot_serve, "a request with "
        "prompt_logprobs on a multimodal model or with a drafter is a 400, "
        "not an engine that dies", wraps=True)]


def unservable(params, vllm_config) -> str | None:
    """Why tpu-inference 0.32's runner would stop the engine on a request
    with these sampling parameters, or None."""
    if getattr(params, "prompt_logprobs", None) is None:
        return None
    if vllm_config.model_config.is_multimodal_model:
        return ("prompt_logprobs is not supported for multimodal models "
                "on tpu-inference 0.32 (every Gemma 4 E2B / E4B export is "
                "one)")
    if vllm_config.speculative_config is not None:
        return ("prompt_logprobs is not supported with speculative "
                "decoding on tpu-inference 0.32")
    return None


def _refusing_what_the_runner_cannot_serve(validate_params):

    @functools.wraps(validate_params)
    def wrapped(self, params, *args, **kwargs):
        result = validate_params(self, params, *args, **kwargs)
        if is_gemma_qat(self.vllm_config):
            why = unservable(params, self.vllm_config)
            if why:
                from vllm.exceptions import VLLMValidationError
                raise VLLMValidationError(why, parameter="prompt_logprobs",
                                          value=params.prompt_logprobs)
        return result

    return wrapped
