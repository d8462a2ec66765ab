"""Speculative decoding: the request in the last slot of the request bucket
keeps its bonus token when the draft tokens are padded, under
--load-format gemma_qat only. Upstream patch: patches/0012-* (write-up:
patches/README.md).

tpu-inference 0.32's rejection sampler takes the step's draft tokens padded
to the logits bucket. `_get_segment_info` maps each position to its request
with `jnp.repeat(arange(batch), num_draft_tokens, total_repeat_length=...)`,
which fills the padding with the LAST request's id: the padding counts as
that request's drafts 5, 6, ... A padding position whose (meaningless) draft
differs from the target's argmax is then its first mismatch, and it loses
its bonus token: one draft fewer accepted, one more step. Tokens stay right.
It hits a request in the last slot of a full request bucket in a step whose
sampled positions do not fill the logits bucket (8 requests sent together,
README: speculative decoding).

Under gemma_qat the padding positions get a segment id past the last
request (`segment_min` drops those; gathers by it clamp, as before).
Decided per engine process: the runner that builds the rejection sampler
says whether it serves gemma_qat.
"""
from __future__ import annotations

import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

SAMPLER_MODULE = "tpu_inference.layers.jax.sample.rejection_sampler"
RUNNER_MODULE = "tpu_inference.runner.tpu_runner"

# Whether this process's runner serves gemma_qat (set before any sampling
# program is traced: the runner builds its rejection sampler at start-up).
_serving_gemma_qat = False


def install() -> None:
    label = f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, rejection)"
    substitute.apply_on_import(SAMPLER_MODULE, sampler_substitutions, label)
    substitute.apply_on_import(RUNNER_MODULE, runner_substitutions, label)


def sampler_substitutions() -> list[Substitution]:
    return [Substitution(
        f"{SAMPLER_MODULE}:_get_segment_info", _padding_in_no_segment,
        "padded draft positions belong to no request (not the last one)",
        wraps=True)]


def runner_substitutions() -> list[Substitution]:
    return [Substitution(
        f"{RUNNER_MODULE}:TPUModelRunner._init_speculative_decoding",
        _noting_gemma_qat,
        "the runner says whether the rejection sampler serves gemma_qat",
        wraps=True)]


def substitutions() -> list[Substitution]:
    return sampler_substitutions() + runner_substitutions()


def _padding_in_no_segment(get_segment_info):

    @functools.wraps(get_segment_info)
    def wrapped(num_draft_tokens, total_tokens):
        segment_ids, group_indices = get_segment_info(num_draft_tokens,
                                                      total_tokens)
        if not _serving_gemma_qat:
            return segment_ids, group_indices
        import jax.numpy as jnp
        padding = jnp.arange(total_tokens) >= jnp.sum(num_draft_tokens)
        return (jnp.where(padding, num_draft_tokens.shape[0], segment_ids),
                group_indices)

    return wrapped


def _noting_gemma_qat(init_speculative_decoding):

    @functools.wraps(init_speculative_decoding)
    def wrapped(self, *args, **kwargs):
        global _serving_gemma_qat
        _serving_gemma_qat = is_gemma_qat(self.vllm_config)
        return init_speculative_decoding(self, *args, **kwargs)

    return wrapped
