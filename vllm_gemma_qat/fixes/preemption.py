"""Requests resumed after preemption keep their real tokens (async
scheduling), under --load-format gemma_qat only. Upstream patch:
patches/0003-*.

With async scheduling (vLLM's default) tpu-inference 0.32's runner appends a
placeholder token 0 to a request's `output_token_ids` for the token still
being sampled (`TPUModelRunner._update_placeholder`) and swaps in the real
one at the next step only for requests still in the persistent batch
(`_modify_prev_results`). A request preempted (or left unscheduled) in
between keeps the 0; when it comes back, `PersistentBatchManager.
update_states` re-adds it from those tokens and the recomputed prefill
writes K/V for token 0 at that position: its answer changes. Any model on
tpu-inference 0.32 is affected; `--no-async-scheduling` avoids it.

Here, before each step, a request that (re-)enters the persistent batch takes
its output tokens from the scheduler's `scheduled_cached_reqs.all_token_ids`,
as vLLM's GPU model runner does for the same case
(`gpu_model_runner.py`: "We must recover the output token ids for resumed
requests in the async scheduling case").

Each request the scheduler resumes is logged by id (`gemma_qat: request ...
resumed after preemption`): vLLM counts preemptions but names no request,
and a resumed request's steps legitimately differ from an uninterrupted
run's (tests/test_serve_spec_decode.py tells them apart by it).
"""
from __future__ import annotations

import functools

from vllm.logger import init_logger

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

RUNNER_MODULE = "tpu_inference.runner.tpu_runner"

# Under the "vllm" logger so the lines show in vLLM's own log output.
logger = init_logger(f"vllm.{__name__}")


def install() -> None:
    """Patch the runner when its module is imported (by the worker), not
    now: importing tpu-inference would cost every vLLM process seconds."""
    substitute.apply_on_import(
        RUNNER_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, preemption)")


def substitutions() -> list[Substitution]:
    return [Substitution(
        f"{RUNNER_MODULE}:TPUModelRunner.execute_model", _restoring_resumed,
        "with async scheduling, a request re-entering the persistent batch "
        "(resumed after preemption) takes its output tokens from the "
        "scheduler, not the runner's placeholder 0; each resumed request is "
        "logged by id", wraps=True)]


def restore_resumed_tokens(requests, input_batch, scheduler_output) -> int:
    """Give each cached request that `update_states` is about to (re-)add to
    the persistent batch the output tokens the scheduler holds for it.
    Returns how many of them had a token the scheduler does not (a
    placeholder)."""
    data = scheduler_output.scheduled_cached_reqs
    resumed = data.resumed_req_ids or ()
    corrected = 0
    for req_id, num_output in zip(data.req_ids, data.num_output_tokens):
        # update_states re-adds exactly these: requests not in the batch
        # (preempted, or not scheduled last step) and resumed ones it drops.
        if num_output <= 0 or (req_id in input_batch.req_id_to_index
                               and req_id not in resumed):
            continue
        state = requests.get(req_id)
        tokens = data.all_token_ids.get(req_id)
        if state is None or tokens is None:
            continue
        restored = list(tokens[-num_output:])
        if state.output_token_ids != restored:
            corrected += 1
        state.output_token_ids = restored
    return corrected


def log_resumed(scheduler_output) -> None:
    """One line per request the scheduler resumes after preemption: its
    KV is recomputed, so its steps from there on (speculative decoding's
    drafts and acceptance among them) are not those of an uninterrupted
    run. vLLM counts preemptions (`vllm:num_preemptions_total`) but names
    no request."""
    data = scheduler_output.scheduled_cached_reqs
    for req_id in data.resumed_req_ids or ():
        logger.info("gemma_qat: request %s resumed after preemption", req_id)


def _restoring_resumed(execute_model):

    @functools.wraps(execute_model)
    def wrapped(self, scheduler_output, *args, **kwargs):
        if not is_gemma_qat(self.vllm_config):
            return execute_model(self, scheduler_output, *args, **kwargs)
        log_resumed(scheduler_output)
        if self.scheduler_config.async_scheduling:
            corrected = restore_resumed_tokens(self.requests, self.input_batch,
                                               scheduler_output)
            if corrected:  # once per process: preemption can be frequent
                logger.info_once("vllm-gemma-qat: a request re-entering the "
                                 "batch had a placeholder output token; its "
                                 "tokens were restored from the scheduler")
        return execute_model(self, scheduler_output, *args, **kwargs)

    return wrapped
