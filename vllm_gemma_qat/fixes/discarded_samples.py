"""Speculative decoding with async scheduling: a request whose sampled tokens
a step discards gets no placeholder, under --load-format gemma_qat only.
Upstream patch: patches/0009-*.

With async scheduling (vLLM's default) tpu-inference 0.32's runner does not
wait for a step's sampled tokens: it lists the requests that will get one
(`TPUModelRunner._update_placeholder` -> `placeholder_req_id_to_index`) and,
at the next step, swaps the device's tokens into those requests' inputs
(`_prepare_async_token_substitution_indices`). Without a drafter the list
leaves out the requests whose samples the step discards (a partial prefill:
the chunk did not reach the request's end). With a drafter the list is
rebuilt from every request of the step (`spec_decode_metadata.req_ids_dp`),
discarded ones included. A prompt's chunks are then skipped as prefill, but
the recompute of a request resumed after preemption (prompt + its output
so far) is chunked past its prompt: its next chunk is taken for a decode
whose tokens come from the device, and the engine dies
(`AssertionError: num_scheduled_tokens_per_req[i] <= max_num_spec_tokens + 1`
in `_prepare_async_token_substitution_indices`); a chunk of at most k + 1
tokens would pass the check and have its input tokens overwritten.

Here the list drops the requests whose samples were discarded, as the path
without a drafter does.
"""
from __future__ import annotations

import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

RUNNER_MODULE = "tpu_inference.runner.tpu_runner"


def install() -> None:
    substitute.apply_on_import(
        RUNNER_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, speculative "
        "decoding under async scheduling)")


def substitutions() -> list[Substitution]:
    return [Substitution(
        f"{RUNNER_MODULE}:TPUModelRunner._update_placeholder",
        _without_discarded, "with a drafter and async scheduling, requests "
        "whose sampled tokens the step discards (a chunk of a resumed "
        "request's recompute) get no placeholder", wraps=True)]


def _without_discarded(update_placeholder):

    @functools.wraps(update_placeholder)
    def wrapped(self, discard_sampled_tokens_req_indices, *args, **kwargs):
        placeholders = update_placeholder(
            self, discard_sampled_tokens_req_indices, *args, **kwargs)
        if self.speculative_config is not None \
                and is_gemma_qat(self.vllm_config):
            for i in discard_sampled_tokens_req_indices:
                placeholders.pop(self.input_batch.req_ids[i], None)
        return placeholders

    return wrapped
