"""What agents run, through `vllm serve --load-format gemma_qat` with vLLM's
Gemma 4 recipe flags (`--enable-auto-tool-choice --tool-call-parser gemma4
--reasoning-parser gemma4`), `--dtype bfloat16`, bf16 or fp8 KV: a tiny
Gemma 4 trained here to answer in Gemma 4's tool format (testing/agent.py)
returns parsed tool calls (streamed and not), separated reasoning, an answer
to a tool result, and greedy tokens equal to transformers (fp32)."""
import json
import urllib.request

import pytest

from harness import hf_greedy
from vllm_gemma_qat import quantization
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import agent

PARSERS = ["--enable-auto-tool-choice", "--tool-call-parser", "gemma4",
           "--reasoning-parser", "gemma4"]
# The QAT bf16 export (its other tensors fp32: --dtype bfloat16 casts them);
# the q4_0 export served as int4 with a float8_e4m3fn KV cache.
CONFIGS = {
    "bf16": (None, ["--dtype", "bfloat16"]),
    "int4-fp8": ("q4_0", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
                          "--hf-overrides", json.dumps({
                              "quantization_config":
                              quantization.w4a16_quantization_config()})]),
}
PARIS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module", params=[
    pytest.param(c, marks=pytest.mark.xdist_group(f"agent-{c}"))
    for c in CONFIGS])
def served(request, tmp_path_factory):
    form, flags = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(f"agent-{request.param}")
    hf = agent.save_servable(root / "model", form)
    with CpuServer(root / "model", *flags, *PARSERS,
                   log=root / "server.log") as server:
        yield server, hf, str(root / "model"), request.param


def chat(served, messages, thinking=False, **extra):
    server, _, model, _ = served
    return server.post("/v1/chat/completions", {
        "model": model, "temperature": 0, "max_tokens": 40,
        "messages": messages, "tools": agent.TOOLS,
        "chat_template_kwargs": {"enable_thinking": thinking}, **extra})


def calls(message_or_delta_list) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message_or_delta_list]


def test_chat_with_tools_returns_parsed_tool_calls(served):
    for messages, expected in [
            (PARIS, ("get_weather", {"city": "Paris"})),
            ([{"role": "user", "content": "Add 2 and 3."}],
             ("add", {"a": 2, "b": 3}))]:  # integers stay integers
        choice = chat(served, messages)["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert calls(choice["message"]["tool_calls"]) == [expected]
        assert not choice["message"]["content"]


def test_streamed_tool_call_assembles_to_the_same_call(served):
    server, _, model, _ = served
    request = urllib.request.Request(
        server.url + "/v1/chat/completions", data=json.dumps({
            "model": model, "temperature": 0, "max_tokens": 40,
            "messages": PARIS, "tools": agent.TOOLS, "stream": True,
            "chat_template_kwargs": {"enable_thinking": False}}).encode(),
        headers={"Content-Type": "application/json"})
    name, arguments, finish, chunks = "", "", None, 0
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            choice = json.loads(line[len("data: "):])["choices"][0]
            for call in choice["delta"].get("tool_calls") or []:
                assert call["index"] == 0
                name += call.get("function", {}).get("name") or ""
                arguments += call.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    assert chunks > 1 and finish == "tool_calls"
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Paris"})


def test_thinking_on_separates_reasoning_from_the_call(served):
    message = chat(served, PARIS, thinking=True)["choices"][0]["message"]
    assert message["reasoning"] == agent.THOUGHT["get_weather"]
    assert calls(message["tool_calls"]) == [("get_weather", {"city": "Paris"})]


def test_tool_result_turn_continues_the_conversation(served):
    first = chat(served, PARIS)["choices"][0]["message"]
    turn = PARIS + [
        {"role": "assistant", "content": None,
         "tool_calls": first["tool_calls"]},
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
         "content": "sunny"}]
    choice = chat(served, turn)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "Sunny in Paris."
    assert not choice["message"].get("tool_calls")
    hello = chat(served, [{"role": "user", "content": "Hello!"}])
    assert hello["choices"][0]["message"]["content"] == "Hello! Ask me."


def test_greedy_tokens_equal_transformers_on_every_trained_turn(served):
    # The training left every answer token ahead of the runner-up by >= 2
    # logits in fp32: bf16 activations, fp8 K/V and the int4 matmul move
    # logits by less on this model, so greedy must equal transformers.
    server, hf, model, config = served
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    for prompt_ids, answer_ids in agent.examples(tokenizer):
        r = server.post("/v1/completions", {
            "model": model, "prompt": prompt_ids, "temperature": 0,
            "max_tokens": len(answer_ids), "return_token_ids": True,
            "skip_special_tokens": False})
        tokens = r["choices"][0]["token_ids"]
        assert tokens == answer_ids == hf_greedy(hf, prompt_ids,
                                                 len(answer_ids)), config
    log = server.log.read_text()
    if config == "int4-fp8":
        assert "q4_0 bf16 linears recovered exactly" in log
        assert "float8_e4m3fn" in log  # the KV cache's dtype
