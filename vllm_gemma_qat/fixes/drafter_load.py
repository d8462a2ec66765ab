"""The drafter of speculative decoding is loaded with its own load config
(twin of patches/0006), under `--load-format gemma_qat` only.

tpu-inference 0.32 builds the drafter (`Eagle3Proposer.load_model` ->
`get_model(is_draft_model=True)`) through `_get_nnx_model`, which loads it
with `get_model_loader(vllm_config.load_config)`: the target's loader,
whatever `--speculative-config`'s `draft_load_config` says (vLLM's GPU
worker honours it: `get_draft_load_config`). Here the drafter is loaded
with `draft_load_config` when one is given. Without one it goes, as in
vLLM, to the target's loader: gemma_qat's, which checks a Gemma 4
assistant against its target and loads it strictly (`loader.py`,
`assistant.py`).
"""
from __future__ import annotations

import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

TARGET_MODULE = "tpu_inference.models.common.model_loader"


def install() -> None:
    substitute.apply_on_import(
        TARGET_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only)")


def substitutions() -> list[Substitution]:
    return [Substitution(
        f"{TARGET_MODULE}:_get_nnx_model", with_draft_load_config,
        "speculative decoding: the drafter is loaded with --speculative-"
        "config's draft_load_config when given (was: always the target's)",
        wraps=True)]



def draft_load_config(vllm_config):
    """The load config for the drafter: `draft_load_config` if given, else
    the target's (vLLM's `get_draft_load_config`, without its ipc_cache
    case, which tpu-inference does not have)."""
    spec = getattr(vllm_config, "speculative_config", None)
    given = getattr(spec, "draft_load_config", None)
    return given if given is not None else vllm_config.load_config


def with_draft_load_config(get_nnx_model):

    @functools.wraps(get_nnx_model)
    def wrapped(model_class, vllm_config, *args, is_draft_model=False,
                **kwargs):
        if not (is_draft_model and is_gemma_qat(vllm_config)):
            return get_nnx_model(model_class, vllm_config, *args,
                                 is_draft_model=is_draft_model, **kwargs)
        target_load_config = vllm_config.load_config
        vllm_config.load_config = draft_load_config(vllm_config)
        try:
            return get_nnx_model(model_class, vllm_config, *args,
                                 is_draft_model=True, **kwargs)
        finally:
            vllm_config.load_config = target_load_config

    return wrapped
