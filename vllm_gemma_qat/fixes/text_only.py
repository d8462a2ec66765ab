"""Text-only Gemma 4 checkpoints as transformers saves them, under
--load-format gemma_qat only. Upstream patch: patches/0011-* (write-up:
patches/README.md).

`Gemma4ForCausalLM.save_pretrained` writes a bare `gemma4_text` config and
names the tensors `model.layers.*`, `model.embed_tokens.*`, `model.norm.*`.
tpu-inference 0.32's JAX `Gemma4ForCausalLM` reads `hf_config.text_config`
(which a `Gemma4TextConfig` does not have: AttributeError in the engine) and
loads `model.language_model.*` only.

While such a model is built for gemma_qat, `model_config.hf_config` is
presented as the `gemma4` config tpu-inference reads (its `text_config` is
the checkpoint's config), and its `Gemma4Model` takes the prefix `model`:
the layers' names are then the checkpoint's module paths, which is what a
compressed-tensors `ignore` list (and `vllm-gemma-qat int4-overrides`)
names. Its `load_weights` reads `model.*` as `model.language_model.*`.
Configs with a `text_config` (the QAT exports, text or multimodal) and
other load formats are untouched.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

TARGET_MODULE = "tpu_inference.models.jax.gemma4"
# Where transformers' Gemma4ForCausalLM keeps the language model, and where
# tpu-inference's reads it.
BARE_PREFIX = "model."
WRAPPED_PREFIX = "model.language_model."

_building_bare_text = contextvars.ContextVar("building_bare_text",
                                             default=False)


def install() -> None:
    substitute.apply_on_import(
        TARGET_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only)")


def substitutions() -> list[Substitution]:
    return [
        Substitution(f"{TARGET_MODULE}:Gemma4ForCausalLM.__init__",
                     _build_bare_text_config,
                     "a bare gemma4_text config builds: presented as the "
                     "gemma4 config holding it", wraps=True),
        Substitution(f"{TARGET_MODULE}:Gemma4Model.__init__",
                     _checkpoint_prefix,
                     "a bare gemma4_text model's layers are named as its "
                     "checkpoint names them (model.layers.*)", wraps=True),
        Substitution(f"{TARGET_MODULE}:Gemma4ForCausalLM.load_weights",
                     _load_bare_names,
                     "a bare gemma4_text checkpoint's model.* tensors load "
                     "as model.language_model.*", wraps=True),
    ]


def is_bare_text_config(hf_config) -> bool:
    """A `gemma4_text` config as transformers writes for Gemma4ForCausalLM:
    no `text_config` of its own."""
    return getattr(hf_config, "text_config", None) is None


class Gemma4ConfigView:
    """A bare text config as the `gemma4` config holding it: `text_config`
    is the text config; every other attribute is the text config's."""

    def __init__(self, text_config):
        self.text_config = text_config

    def __getattr__(self, name):
        # (copy / pickle look up dunders on an instance without text_config)
        if name == "text_config" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.text_config, name)


@contextlib.contextmanager
def presented_as_gemma4(model_config):
    """`model_config.hf_config` as a Gemma4ConfigView for the block."""
    text_config = model_config.hf_config
    model_config.hf_config = Gemma4ConfigView(text_config)
    token = _building_bare_text.set(True)
    try:
        yield
    finally:
        _building_bare_text.reset(token)
        model_config.hf_config = text_config


def _build_bare_text_config(init):

    @functools.wraps(init)
    def __init__(self, vllm_config, *args, **kwargs):
        model_config = vllm_config.model_config
        if not (is_gemma_qat(vllm_config)
                and is_bare_text_config(model_config.hf_config)):
            return init(self, vllm_config, *args, **kwargs)
        with presented_as_gemma4(model_config):
            init(self, vllm_config, *args, **kwargs)

    return __init__


def _checkpoint_prefix(init):

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if (_building_bare_text.get()
                and kwargs.get("prefix") == WRAPPED_PREFIX.rstrip(".")):
            kwargs["prefix"] = BARE_PREFIX.rstrip(".")
        init(self, *args, **kwargs)

    return __init__


def _load_bare_names(load_weights):

    @functools.wraps(load_weights)
    def wrapped(self, weights):
        model_config = self.vllm_config.model_config
        if not (is_gemma_qat(self.vllm_config)
                and is_bare_text_config(model_config.hf_config)):
            return load_weights(self, weights)
        weights = ((wrapped_name(name), tensor) for name, tensor in weights)
        # (a release with patch 0001 but not 0011 reads text_config here)
        with presented_as_gemma4(model_config):
            return load_weights(self, weights)

    return wrapped


def wrapped_name(name: str) -> str:
    """`model.layers.0.…` -> `model.language_model.layers.0.…`."""
    if name.startswith(BARE_PREFIX) and not name.startswith(WRAPPED_PREFIX):
        return WRAPPED_PREFIX + name[len(BARE_PREFIX):]
    return name
