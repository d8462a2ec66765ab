"""`vllm serve --load-format gemma_qat` for real: vLLM's OpenAI server,
engine and scheduler, tpu-inference's runner, on JAX's CPU backend (CPU
mode), a tiny QAT checkpoint, a server process on 127.0.0.1."""
import concurrent.futures
import math
import re
import threading
import time

import pytest
from harness import (complete, guided_tool_call, hf_greedy, next_turn_hits,
                     refusal)
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny

# One worker runs this module: its module-scoped fixture is expensive.
pytestmark = pytest.mark.xdist_group("serve_e2e")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    hf = tiny.save_servable(root / "model")
    # A random model loves whitespace; JSON without it stays short.
    with CpuServer(root / "model", "--structured-outputs-config",
                   '{"backend": "xgrammar", "disable_any_whitespace": true}',
                   "--prefix-cache-retention-interval", str(PAGE),
                   # A fresh `vllm serve`, its engine core spawned: the
                   # plugin must reach it through its entry point.
                   log=root / "server.log", zygote=False) as server:
        yield server, hf, root / "model"


def test_plugin_reaches_every_process_through_its_entry_point(served):
    server, _, _ = served
    log = server.log.read_text()
    # No import in the command: vLLM loaded the plugin in the API server and
    # in the engine core, and the engine core loaded weights with it.
    assert log.count("vllm-gemma-qat CPU mode (VLLM_GEMMA_QAT_CPU_MODE=1, "
                     "tests and demos only; VLLM_GEMMA_QAT_CPU_KERNELS="
                     "stand-in) substitutes:") >= 2
    assert "(EngineCore" in log and "gemma_qat: loaded" in log


def test_completions_greedy_tokens_equal_transformers(served):
    server, hf, model = served
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = "Hello from a QAT checkpoint"
    prompt_ids, tokens = complete(server, model, prompt, n=12)
    assert prompt_ids == tokenizer(prompt).input_ids
    assert tokens == hf_greedy(hf, prompt_ids, 12)


def test_chat_completions_use_gemma_template_and_match_transformers(served):
    server, hf, model = served
    r = server.post("/v1/chat/completions", {
        "model": str(model), "temperature": 0, "max_tokens": 8,
        "ignore_eos": True, "return_token_ids": True,
        "messages": [{"role": "user", "content": "Say hi"}]})
    prompt_ids = r["prompt_token_ids"]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.decode(prompt_ids) == (
        "<bos><start_of_turn>user\nSay hi<end_of_turn>\n<start_of_turn>model\n")
    assert r["choices"][0]["token_ids"] == hf_greedy(hf, prompt_ids, 8)


def test_continuous_batching_eight_concurrent_requests(served):
    server, hf, model = served
    prompts = ["a" * (3 + 5 * i) for i in range(8)]  # different lengths
    running, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            running.append(server.metrics().get("vllm:num_requests_running", 0))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(
                lambda p: complete(server, model, p, n=16), prompts))
    finally:
        stop.set()
        watcher.join()
    for prompt_ids, tokens in results:
        assert tokens == hf_greedy(hf, prompt_ids, 16)
    assert max(running) > 1, running  # several requests in one engine step


def test_prefix_caching_hits_and_identical_output(served):
    server, _, model = served
    prefix = "You are a careful agent. " * 4  # 100 tokens: 6 full blocks
    before = server.metrics().get("vllm:prefix_cache_hits_total", 0)
    first = complete(server, model, prefix + "Task one.")
    second = complete(server, model, prefix + "Task one.")
    hits = server.metrics()["vllm:prefix_cache_hits_total"] - before
    assert hits >= 64, hits
    assert first == second


def test_guided_decoding_json_schema(served):
    server, _, model = served
    assert guided_tool_call(server, model)["tool"] in ("search", "read")


# Sliding-window KV under gemma_qat (#3220). The tiny E2B-like model: 10
# layers, 5 KV-owning (4 sliding, head_dim 128; 1 full, head_dim 256; one
# KV head), window 8; the server: float32, pages of 16 tokens, 32 tokens a
# step, --max-model-len 256.
WINDOW, PAGE, STEP, MAX_LEN = 8, 16, 32, 256
SLIDING_ROWS = 2  # 4 sliding layers, two per 256-wide row


def _cache_layout(log: str) -> tuple[int, int, int]:
    """(blocks in vLLM's pool, cache arrays, bytes of one page: 16 tokens of
    one array) as the engine logged."""
    shape = re.search(r"regular_attn_shape=\(num_blocks, \(([\d, ]+)\)\)",
                      log)[1]
    return (int(re.search(r"num_blocks=\[(\d+)", log)[1]),
            int(re.search(r"num_total_layers=(\d+)", log)[1]),
            math.prod(int(d) for d in shape.split(",")) * 4)  # float32


def test_sliding_layers_keep_only_their_window(served):
    server, _, _ = served
    log = server.log.read_text()
    blocks, arrays, page_bytes = _cache_layout(log)
    concurrency = float(re.search(
        r"Maximum concurrency for 256 tokens per request: ([\d.]+)x",
        log)[1])
    # What vLLM admits a request at --max-model-len for: its full-layer
    # blocks, and per row what a window needs with two steps in flight.
    per_request = (MAX_LEN // PAGE + SLIDING_ROWS
                   * (math.ceil((WINDOW - 1 + 2 * STEP) / PAGE) + 1))
    assert concurrency == round(blocks / per_request, 2)
    # The same bytes with every layer at full context (tpu-inference 0.32):
    # K and V of 4 layers x 128 and 1 x 256 per token, float32.
    full_context = blocks * arrays * page_bytes / (
        MAX_LEN * 2 * (4 * 128 + 256) * 4)
    assert concurrency > 1.6 * full_context, (concurrency, full_context)
    assert ("gemma_qat: sliding-window KV (#3220): 4 sliding layers in 2 "
            "rows of 2, window 8") in log
    # Two groups of rows and the full layer's group share one array.
    assert "num_kv_cache_groups=3," in log
    assert "Init kv-cache | num_total_layers=1 |" in log


def _reference(hf, prompt_ids, n):
    import torch
    with torch.no_grad():  # not stopping at EOS: the requests ignore it
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n,
                          do_sample=False, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def test_pages_past_the_window_are_freed_answers_stay_right(served):
    """Four long requests at once: the pages their rows leave behind the
    window go back to the pool (what the engine's usage gauge says is held
    stays near the full layer's pages) while the stale ids stay in the
    runner's block tables; every answer equals transformers'. Freed pages
    handed to other requests: tests/test_preemption.py, whose pool is
    small enough that they must be (tests/kv_pressure.py)."""
    server, hf, model = served
    prompts = [(f"Window {i} slides over the log. " * 8)[:150 + 15 * i]
               for i in range(4)]
    n = 40
    blocks, arrays, _ = _cache_layout(server.log.read_text())
    used, stop = [], threading.Event()  # pages (16 tokens of one array)

    def watch():
        while not stop.is_set():
            used.append(server.metrics()["vllm:kv_cache_usage_perc"]
                        * (blocks - 1) * arrays)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(
                lambda p: complete(server, model, p, n=n), prompts))
    finally:
        stop.set()
        watcher.join()
    for prompt_ids, tokens in results:
        assert tokens == _reference(hf, prompt_ids, n)
    full = sum(math.ceil((len(ids) + n) / PAGE) for ids, _ in results)
    # Held at most: every full-layer page, and per row a window's 2-4
    # pages (prefix caching may keep finished requests' pages cached, not
    # held). Rows at full context would hold 3x the full layer's.
    assert max(used) <= full + len(prompts) * SLIDING_ROWS * 4, (used, full)
    assert max(used) >= full / 2, (max(used), full)  # the gauge saw the run


def test_next_turn_hits_through_the_answer_with_a_retention_interval(served):
    """vLLM keeps a sliding-window group's blocks for prefix caching at
    checkpoints only (`--prefix-cache-retention-interval`): by default the
    end of each prompt, so an agent's next turn hits up to its previous
    prompt only (test_serve_agent); with an interval of one page (this
    server) at every page, so it hits through the previous answer too."""
    server, _, model = served
    prompt, answer, hits = next_turn_hits(
        server, model, "Turn one of an agent's session, window 8. " * 3, 40,
        b"Turn two.")
    print("turn 1:", prompt, "+", answer, "tokens; turn 2 hits", hits)
    assert hits == (prompt + answer) // PAGE * PAGE, (prompt, answer, hits)


def test_prompt_logprobs_are_a_named_400_and_the_engine_serves_on(served):
    # tpu-inference 0.32's runner raises in the engine on prompt_logprobs
    # for a multimodal model (every Gemma 4 export): the engine died and
    # every open request got a 500 (fixes/request_checks.py).
    server, hf, model = served
    status, message = refusal(server, "/v1/completions", {
        "model": str(model), "prompt": "Score me.", "max_tokens": 1,
        "prompt_logprobs": 0})
    assert status == 400, message
    assert "prompt_logprobs is not supported for multimodal models" in message
    prompt_ids, tokens = complete(server, model, "Still serving?", n=6)
    assert tokens == hf_greedy(hf, prompt_ids, 6)
