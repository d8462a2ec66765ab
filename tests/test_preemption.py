"""Under KV pressure vLLM preempts requests and recomputes them later; with
async scheduling tpu-inference 0.32 recomputed a resumed request with a
placeholder token 0 (issue #21). Under `--load-format gemma_qat` the plugin
restores its tokens (`fixes/preemption.py`): answers equal transformers, an
aborted preempted / waiting request leaves nothing behind, and three times
`--max-num-seqs` concurrent requests are each answered once, right."""
import http.client
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from kv_pressure import PROMPTS, SMALL_CACHE, answers, wrong_answers
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny

# One worker runs this module: its module-scoped fixture is expensive.
pytestmark = pytest.mark.xdist_group("preemption")

RESTORED_LINE = "had a placeholder output token; its tokens were restored"


# In-process: tpu-inference's own PersistentBatchManager and InputBatch.

def _manager():
    from unittest.mock import MagicMock

    from tpu_inference.runner.input_batch import InputBatch
    from tpu_inference.runner.persistent_batch_manager import \
        PersistentBatchManager
    batch = InputBatch(max_num_reqs=4, max_model_len=64,
                       max_num_batched_tokens=64, pin_memory=False,
                       vocab_size=1000, block_sizes=[16])
    # model_config is only stored by the manager.
    return PersistentBatchManager({}, batch, {}, False, MagicMock(),
                                  is_last_rank=True)


def _step(num_scheduled, new=(), cached=None):
    from vllm.v1.core.sched.output import SchedulerOutput
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = list(new)
    if cached is not None:
        out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = dict(num_scheduled)
    out.total_num_scheduled_tokens = sum(num_scheduled.values())
    return out


PROMPT, SAMPLED = list(range(100, 110)), 42


def _preempted_with_placeholder_then_resumed(manager):
    """Steps 1-2 of the bug: prefill, the first token in flight (the
    runner's placeholder 0, as `_update_placeholder` appends it), then
    preempted. Returns step 3's scheduler output: resumed, with the
    scheduler's tokens (it sends all of them: not scheduled last step)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    new = NewRequestData(req_id="r", prompt_token_ids=PROMPT, mm_features=[],
                         sampling_params=SamplingParams(temperature=0),
                         pooling_params=None, block_ids=([1],),
                         num_computed_tokens=0, lora_request=None)
    manager.update_states(_step({"r": len(PROMPT)}, [new]), None)
    manager.requests["r"].output_token_ids.append(0)
    manager.input_batch.num_tokens[0] += 1
    manager.input_batch.num_tokens_no_spec[0] += 1
    manager.update_states(_step({}), None)  # preempted: not scheduled
    assert "r" not in manager.input_batch.req_id_to_index
    return _step({"r": len(PROMPT) + 1}, cached=CachedRequestData(
        req_ids=["r"], resumed_req_ids={"r"}, new_token_ids=[],
        all_token_ids={"r": PROMPT + [SAMPLED]}, new_block_ids=[([2],)],
        num_computed_tokens=[0], num_output_tokens=[1]))


def _batch_row(manager):
    batch = manager.input_batch
    index = batch.req_id_to_index["r"]
    return batch.token_ids_cpu[index, :batch.num_tokens[index]].tolist()


def test_stock_manager_resumes_with_the_placeholder():
    """The bug itself, in tpu-inference 0.32's code: what the resumed
    request's prefill would be recomputed from."""
    manager = _manager()
    manager.update_states(_preempted_with_placeholder_then_resumed(manager),
                          None)
    assert _batch_row(manager) == PROMPT + [0]


def test_restored_before_update_states_the_batch_holds_the_real_token():
    from vllm_gemma_qat.fixes.preemption import restore_resumed_tokens
    manager = _manager()
    step = _preempted_with_placeholder_then_resumed(manager)
    assert restore_resumed_tokens(manager.requests, manager.input_batch,
                                  step) == 1
    manager.update_states(step, None)
    assert _batch_row(manager) == PROMPT + [SAMPLED]
    assert manager.requests["r"].output_token_ids == [SAMPLED]


@pytest.mark.parametrize("load_format,async_scheduling,restored", [
    ("gemma_qat", True, True), ("auto", True, False),
    ("gemma_qat", False, False)])
def test_only_gemma_qat_with_async_scheduling_changes_anything(
        load_format, async_scheduling, restored):
    from vllm_gemma_qat.fixes.preemption import _restoring_resumed
    manager = _manager()
    step = _preempted_with_placeholder_then_resumed(manager)
    seen = []
    runner = SimpleNamespace(
        requests=manager.requests, input_batch=manager.input_batch,
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        vllm_config=SimpleNamespace(
            load_config=SimpleNamespace(load_format=load_format)))
    execute = _restoring_resumed(
        lambda self, out: seen.append(list(self.requests["r"].output_token_ids)))
    execute(runner, step)
    assert seen == [[SAMPLED] if restored else [0]]


# Through `vllm serve --load-format gemma_qat` (CPU mode).

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    hf = tiny.save_servable(root / "model", "e4b", multimodal=False)
    with CpuServer(root / "model", *SMALL_CACHE,
                   log=root / "server.log") as server:
        yield server, hf, root / "model"


def test_answers_under_kv_pressure_equal_transformers(served):
    # How often vLLM preempts depends on how the eight requests reach the
    # engine (a busy machine staggers them): the workload is sent again,
    # up to 4 times, until a preemption of a decoding request with its
    # token in flight (the case that went wrong) has happened; every
    # round's answers must equal transformers.
    server, hf, model = served
    before = server.metrics().get("vllm:num_preemptions_total", 0)
    for _ in range(4):
        results = answers(server, model, PROMPTS)
        assert wrong_answers(hf, results) == []
        preempted = server.metrics()["vllm:num_preemptions_total"] - before
        if preempted >= 1 and RESTORED_LINE in server.log.read_text():
            break
    assert preempted >= 1
    # ... and the plugin restored its tokens.
    assert RESTORED_LINE in server.log.read_text()


class _Stream(threading.Thread):
    """A streaming completion that counts its tokens (by their ids: a chunk
    carries several when the engine's outputs come faster than the API
    server streams them, vLLM then merges the deltas); `close()` shuts its
    connection from outside (vLLM then aborts the request), also while no
    token arrives (a preempted or waiting request sends none)."""

    def __init__(self, server, model, prompt, max_tokens):
        super().__init__()
        self.tokens, self.status, self.closed = 0, "connecting", False
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port,
                                               timeout=300)
        self.body = json.dumps({
            "model": str(model), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True})
        self.start()

    def run(self):
        try:
            self.conn.request("POST", "/v1/completions", self.body,
                              {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            self.status = "streaming"
            while True:
                line = response.fp.readline()
                if not line or line.startswith(b"data: [DONE]"):
                    break
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[len(b"data: "):])
                    self.tokens += len(chunk["choices"][0]["token_ids"])
        except OSError:
            pass
        self.status = "aborted" if self.closed else "done"

    def close(self):
        self.closed = True
        self.conn.sock.shutdown(socket.SHUT_RDWR)


def _wait_for(condition, what, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _settled(server, timeout=60):
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        state = (m["vllm:num_requests_running"],
                 m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"])
        if state == (0, 0, 0) or time.time() > deadline:
            return state, m
        time.sleep(0.2)


# Sizes for the abort test on the 40-block cache (kv_pressure): A (40 + 200
# tokens) and B (60 + 180) fit together at first and outgrow the cache
# after ~130 steps each; vLLM (FCFS) then preempts the later one, B, which
# cannot come back while A runs (its ~190 tokens need 12 + 18 free blocks
# to be admitted, A holds over 20); C, sent then, waits behind B.
LONG = (("A reads the log. " * 3)[:40], 200)
PREEMPTED = (("B writes the report. " * 3)[:60], 180)
WAITING = (("C asks. " * 6)[:40], 24)


def test_abort_while_preempted_or_waiting_leaves_nothing_behind(served):
    """A client disconnects while the engine holds its request preempted
    (B) and another while its request waits (C), both states read from
    the engine's own gauges: KV blocks and request counts go back to idle,
    only A finishes, and B's and C's prompts answer right when sent again."""
    server, hf, model = served
    before = server.metrics()

    def added(name):
        return server.metrics().get(name, 0) - before.get(name, 0)

    def engine(running, waiting):
        m = server.metrics()
        return (m["vllm:num_requests_running"],
                m["vllm:num_requests_waiting"]) == (running, waiting)

    a = _Stream(server, model, *LONG)
    _wait_for(lambda: a.tokens >= 1, "A's first token")
    b = _Stream(server, model, *PREEMPTED)
    _wait_for(lambda: b.tokens >= 1, "B's first token")
    # The engine preempted one of the two and holds it in its waiting queue
    # while the other runs; A's stream goes on, so the held one is B.
    _wait_for(lambda: added("vllm:num_preemptions_total") >= 1
              and engine(running=1, waiting=1), "a preemption")
    a_then = a.tokens
    _wait_for(lambda: a.tokens >= a_then + 2, "A to go on")
    b_held = b.tokens  # its last token in flight at the preemption is in
    c = _Stream(server, model, *WAITING)
    _wait_for(lambda: engine(running=1, waiting=2), "C to queue behind B")
    assert c.tokens == 0 and 0 < b.tokens == b_held < PREEMPTED[1]
    b.close()
    c.close()
    # Both leave the engine's queue while A still runs.
    _wait_for(lambda: engine(running=1, waiting=0), "the aborts")
    assert a.status == "streaming"
    for s in (a, b, c):
        s.join(timeout=300)
    assert (a.status, a.tokens) == ("done", LONG[1])
    assert (b.status, c.status, c.tokens) == ("aborted", "aborted", 0)
    # No token reached B from A's going on to its disconnect: B was not
    # scheduled again meanwhile.
    assert b.tokens == b_held

    state, after = _settled(server)
    assert state == (0, 0, 0), state  # running, waiting, KV cache usage
    assert (after["vllm:request_success_total"]
            - before["vllm:request_success_total"]) == 1
    # Preemptions beyond those of the finished request: B's.
    preemptions = (after["vllm:num_preemptions_total"]
                   - before["vllm:num_preemptions_total"])
    of_finished = (after.get("vllm:request_num_preemptions_sum", 0)
                   - before.get("vllm:request_num_preemptions_sum", 0))
    assert preemptions > of_finished, (preemptions, of_finished)

    results = answers(server, model, [PREEMPTED[0], WAITING[0]])
    assert wrong_answers(hf, results) == []
    assert _settled(server)[0] == (0, 0, 0)


def test_three_times_max_num_seqs_concurrent_requests(served):
    """24 requests at once (--max-num-seqs 8) on the same small cache:
    each answered once, each equal to transformers."""
    server, hf, model = served
    prompts = [(f"Request {i} asks for the file. " * 5)[:40 + 4 * i]
               for i in range(24)]
    n = 12
    before = server.metrics()
    results = answers(server, model, prompts, n=n)
    after = server.metrics()

    def added(name):
        return after.get(name, 0) - before.get(name, 0)

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Each response is its own prompt's (none lost, none swapped), right.
    assert [ids for ids, _ in results] == [tokenizer(p).input_ids
                                           for p in prompts]
    assert [len(tokens) for _, tokens in results] == [n] * len(prompts)
    assert wrong_answers(hf, results, n) == []
    # The engine ran each exactly once (none duplicated).
    assert added("vllm:request_success_total") == len(prompts)
    assert added("vllm:generation_tokens_total") == n * len(prompts)
    assert added("vllm:prompt_tokens_total") == sum(
        len(ids) for ids, _ in results)
