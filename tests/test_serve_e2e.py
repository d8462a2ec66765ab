"""`vllm serve --load-format gemma_qat` for real: vLLM's OpenAI server,
engine and scheduler, tpu-inference's runner, on JAX's CPU backend (CPU
mode), a tiny QAT checkpoint, a server process on 127.0.0.1."""
import concurrent.futures
import json
import threading
import time

import pytest
from harness import complete, guided_tool_call, hf_greedy
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
                   log=root / "server.log") as server:
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
