"""What agents run, through `vllm serve --load-format gemma_qat` with vLLM's
Gemma 4 recipe flags (`--enable-auto-tool-choice --tool-call-parser gemma4
--reasoning-parser gemma4`), bf16 or fp32, bf16 or fp8 (e4m3, e5m2) KV: a
tiny Gemma 4 trained here to answer in Gemma 4's tool format
(testing/agent.py) returns parsed tool calls (streamed and not), separated
reasoning, an answer to a tool result, greedy tokens equal to transformers
(fp32), and prompt logprobs within derived tolerances of transformers in
fp32 with exact K/V."""
import json
import re
import shutil
import subprocess

import pytest

import numpy as np

from harness import (fp8_flip_allowance, hf_greedy, hf_token_logprobs,
                     next_turn_hits, streamed_tool_calls)
from vllm_gemma_qat import quantization
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import agent

PARSERS = ["--enable-auto-tool-choice", "--tool-call-parser", "gemma4",
           "--reasoning-parser", "gemma4"]
# name: (export form, flags, activation dtype, KV cache dtype). The QAT bf16
# export (its other tensors fp32: --dtype bfloat16 casts them) with a bf16
# cache; the q4_0 export served as int4 with a float8_e4m3fn cache; the QAT
# export in fp32 with a float8_e5m2 cache (fp32 isolates the cache's
# rounding: the server must then match transformers with K/V so rounded).
CONFIGS = {
    "bf16": (None, ["--dtype", "bfloat16"], "bfloat16", "bfloat16"),
    "int4-fp8": ("q4_0", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
                          "--hf-overrides", json.dumps({
                              "quantization_config":
                              quantization.w4a16_quantization_config()})],
                 "bfloat16", "float8_e4m3fn"),
    "fp32-e5m2": (None, ["--dtype", "float32", "--kv-cache-dtype",
                         "fp8_e5m2"], "float32", "float8_e5m2"),
}
PARIS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module", params=[
    pytest.param(c, marks=pytest.mark.xdist_group(f"agent-{c}"))
    for c in CONFIGS])
def served(request, tmp_path_factory):
    form, flags, _, _ = CONFIGS[request.param]
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
    got, finish, chunks = streamed_tool_calls(server, {
        "model": model, "temperature": 0, "max_tokens": 40,
        "messages": PARIS, "tools": agent.TOOLS,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert chunks > 1 and finish == "tool_calls"
    assert got == [("get_weather", {"city": "Paris"})]


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


def test_next_turn_hits_the_prefix_cache_up_to_the_previous_prompt(served):
    # vLLM's defaults (--prefix-cache-retention-interval 0): a sliding
    # window group keeps blocks for prefix caching at the end of each prompt
    # only, so the next turn of a conversation whose contexts run past the
    # 32-token window hits up to the previous prompt, not through the
    # answer (with an interval, through it: test_serve_e2e).
    server, _, model, _ = served
    prompt, answer, hits = next_turn_hits(
        server, model, "Turn one of an agent's session, window 32. " * 3,
        40, [agent.tiny_id("<turn|>")])
    print("turn 1:", prompt, "+", answer, "tokens; turn 2 hits", hits)
    assert prompt + answer > (prompt // 16 + 2) * 16  # an answer page more
    assert hits == (prompt - 1) // 16 * 16, (prompt, answer, hits)


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
    assert f"regular_attn_dtype={CONFIGS[config][3]}" in log
    if config == "int4-fp8":
        assert "q4_0 bf16 linears recovered exactly" in log


# fp32 with an fp8 cache: the server and transformers with K/V rounded the
# same way compute the same thing in a different order; fp32 accumulation
# over ~100 positions and 6 layers differs by ~1e-5 (measured <= 3.2e-5),
# except where a K/V element that lies within fp32 error of the midpoint
# between two fp8 values is stored as the other one: what such elements
# can move is derived per position (harness.fp8_flip_allowance).
SAME_MATH = 1e-4
# bf16: two implementations of the same computation, each rounding to bf16
# at its own places, drift from fp32 by errors of the same size; the
# server may drift twice as far (root mean square over the positions) as
# transformers in the same precision (bf16 weights and activations, K/V
# rounded to the cache dtype) does. Their maxima are single positions where
# a few K/V elements round to other fp8 values: 0.579 against 0.291 on one
# machine, with the same model.
BF16_ALLOWANCE = 2.0


def test_prompt_logprobs_within_derived_tolerance_of_fp32_exact_kv(served):
    # Every trained conversation (~80-95 tokens: past the 32-token window)
    # read as a prompt; the logprob vLLM returns for each token against
    # transformers in fp32 with exact K/V.
    server, hf, model, config = served
    import copy

    import torch
    from transformers import AutoTokenizer
    _, _, dtype, kv = CONFIGS[config]
    kv = kv if kv.startswith("float8") else None
    same_precision = copy.deepcopy(hf).to(getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(model)
    served_lp, exact, same, shared_exact, allowance = [], [], [], [], []
    flips = 0
    for prompt_ids, answer_ids in agent.examples(tokenizer):
        ids = prompt_ids + answer_ids
        r = server.post("/v1/completions", {
            "model": model, "prompt": ids, "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 0})
        rows = r["choices"][0]["prompt_logprobs"][1:]
        served_lp.append([row[str(t)]["logprob"]
                          for row, t in zip(rows, ids[1:])])
        exact.append(hf_token_logprobs(hf, ids))
        same.append(hf_token_logprobs(same_precision, ids, kv))
        if kv and dtype == "float32":
            shared_exact.append(hf_token_logprobs(hf, ids, kv, True))
            allowed, n = fp8_flip_allowance(hf, ids, kv)
            allowance.append(allowed)
            flips += n
    served_lp, exact, same = (np.concatenate(x)
                              for x in (served_lp, exact, same))
    bound = SAME_MATH + (np.concatenate(allowance) if allowance else 0)
    drift = np.abs(served_lp - exact)
    reference_drift = np.abs(same - exact)
    print(f"{config}: {drift.size} positions, max |served - fp32 exact KV| "
          f"{drift.max():.3g}, transformers in {dtype} / {kv or dtype} KV "
          f"{reference_drift.max():.3g}")
    if dtype == "float32":
        gap = np.abs(served_lp - same)
        print(f"{config}: max |served - transformers, same rounding| "
              f"{gap.max():.3g}; bound {SAME_MATH:g} + what {flips} K/V "
              f"elements within fp32 error of an fp8 midpoint move, at most "
              f"{np.max(bound):.3g}")
        assert (gap <= bound).all(), gap.max()
        assert (drift <= reference_drift + bound).all()
        if kv:  # the shared layers read their source's rounded cache
            bug = np.abs(np.concatenate(shared_exact) - same)
            print(f"{config}: ... if shared layers read exact K/V: "
                  f"{bug.max():.3g}, {(bug > bound).sum()} positions past "
                  "the bound")
            assert (bug > bound).any(), "the check cannot see that bug"
    else:  # root mean square: a max over 437 positions is one outlier
        rms, reference_rms = (np.sqrt(np.mean(x ** 2))
                              for x in (drift, reference_drift))
        print(f"{config}: rms |served - fp32 exact KV| {rms:.3g}, "
              f"transformers in {dtype} / {kv or dtype} KV {reference_rms:.3g}")
        assert rms <= BF16_ALLOWANCE * reference_rms


def test_plan_predicts_the_kv_cache_the_server_allocates(served):
    # `plan` as a user runs it, for the server's --dtype and
    # --kv-cache-dtype, the CPU's "HBM" and vLLM's default utilization,
    # against what the server logs.
    # int4 weights count packed, two a byte, as a TPU holds them (CPU mode
    # counts its live int4 buffers so too).
    server, _, model, config = served
    form, _, dtype, kv = CONFIGS[config]
    log = server.log.read_text()
    logged = int(re.search(r"TPU KV cache size: ([\d,]+) tokens",
                           log).group(1).replace(",", ""))
    # The pool vLLM's KV cache config holds (one per group's page size).
    blocks = int(re.search(r"kv_cache_config\.num_blocks=(\d+)", log)[1])
    hbm = re.search(r"VLLM_GEMMA_QAT_CPU_MEMORY_GIB: ([\d.]+) GiB", log)[1]
    kv_flag = {"bfloat16": "bf16", "float8_e5m2": "fp8_e5m2",
               "float8_e4m3fn": "fp8"}[kv]
    out = subprocess.run(
        [shutil.which("vllm-gemma-qat"), "plan", model, "--agents", "1",
         "--context", "256", "--kv-dtype", kv_flag, "--dtype", dtype,
         "--weights", "int4" if form else "bf16",
         "--hbm-gib", hbm, "--max-num-batched-tokens",
         str(server.step_tokens), "--json"],
        capture_output=True, text=True, check=True)
    planned = json.loads(out.stdout)
    # The pool (sliding-window KV: blocks of the full layer's page) and what
    # vLLM makes of it for a request at --max-model-len.
    assert planned["kv_sliding_window"]
    assert (planned["kv_pool_blocks"], planned["kv_cache_tokens"]) == (
        blocks, logged)
