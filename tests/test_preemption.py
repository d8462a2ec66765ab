"""Under KV pressure vLLM preempts requests and recomputes them later; with
async scheduling tpu-inference 0.32 recomputed a resumed request with a
placeholder token 0 (issue #21). Under `--load-format gemma_qat` the plugin
restores its tokens (`fixes/preemption.py`): answers equal transformers, an
aborted preempted / waiting request leaves nothing behind, and three times
`--max-num-seqs` concurrent requests are each answered once, right."""
import http.client
import json
import threading
import time
from types import SimpleNamespace

import pytest
from kv_pressure import N, PROMPTS, SMALL_CACHE, answers, wrong_answers
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


def _stream(server, model, prompt, progress, key, stop):
    """A streaming completion; counts its tokens in progress[key]; closes
    the connection (vLLM aborts the request) once `stop[key]` is set."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": str(model), "prompt": prompt, "max_tokens": N,
        "temperature": 0, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    response = conn.getresponse()
    try:
        while not stop[key].is_set():
            line = response.fp.readline()
            if not line or line.startswith(b"data: [DONE]"):
                progress[key] = (progress[key][0], "done")
                return
            if line.startswith(b"data: {"):
                progress[key] = (progress[key][0] + 1, "streaming")
        progress[key] = (progress[key][0], "aborted")
    finally:
        conn.close()


def _settled(server, timeout=60):
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        state = (m["vllm:num_requests_running"],
                 m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"])
        if state == (0, 0, 0) or time.time() > deadline:
            return state, m
        time.sleep(0.2)


def test_abort_while_preempted_or_waiting_leaves_nothing_behind(served):
    """Eight streams; as soon as one that has streamed tokens stops while
    others go on (preempted: not running), it and every stream not started
    yet (waiting) are closed by the client. KV blocks and request counts go
    back to idle, and the aborted prompts' answers are unchanged."""
    server, hf, model = served
    before = server.metrics()
    progress = {i: (0, "streaming") for i in range(len(PROMPTS))}
    stop = {i: threading.Event() for i in progress}
    threads = [threading.Thread(target=_stream, args=(
        server, model, p, progress, i, stop)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    stalled, waiting, last = None, [], {}
    deadline = time.time() + 120
    while stalled is None and time.time() < deadline:
        now = dict(progress)
        for i, (count, status) in now.items():
            if last.get(i, (None,))[0] != count:
                last[i] = (count, sum(c for c, _ in now.values()))
        total = sum(c for c, _ in now.values())
        for i, (count, status) in now.items():
            # Started, not done, and 6 tokens streamed by the others since
            # its last: it is out of the running batch (decodes are
            # scheduled every step while they run).
            if status == "streaming" and 0 < count < N and \
                    total - last[i][1] >= 6:
                stalled = i
        time.sleep(0.01)
    assert stalled is not None, f"no stream stalled: {progress}"
    waiting = [i for i, (count, status) in progress.items()
               if count == 0 and status == "streaming"]
    for i in [stalled, *waiting]:
        stop[i].set()
    for t in threads:
        t.join(timeout=300)
    aborted = [i for i, (_, status) in progress.items() if status == "aborted"]
    assert stalled in aborted and set(waiting) <= set(aborted), progress

    state, after = _settled(server)
    assert state == (0, 0, 0), state  # running, waiting, KV cache usage
    finished = (after["vllm:request_success_total"]
                - before["vllm:request_success_total"])
    assert finished == len(PROMPTS) - len(aborted), (finished, progress)
    # Preemptions counted beyond those of the finished requests: an aborted
    # request had been preempted.
    preemptions = (after["vllm:num_preemptions_total"]
                   - before["vllm:num_preemptions_total"])
    of_finished = (after.get("vllm:request_num_preemptions_sum", 0)
                   - before.get("vllm:request_num_preemptions_sum", 0))
    assert preemptions > of_finished, (preemptions, of_finished)

    results = answers(server, model, [PROMPTS[i] for i in aborted])
    assert wrong_answers(hf, results) == []
    assert _settled(server)[0] == (0, 0, 0)


def test_three_times_max_num_seqs_concurrent_requests(served):
    """24 requests at once (--max-num-seqs 8) on the same 384-token cache:
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
