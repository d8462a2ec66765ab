"""Serving benchmark against a running `vllm serve ... --load-format gemma_qat`.

1. vLLM's own serving benchmark (`vllm bench serve`'s code, random dataset)
   at each concurrency.
2. An agent workload no standard benchmark has: N agents calling tools in
   Gemma 4's own format through vLLM's `gemma4` tool and reasoning parsers
   (streamed), each tool call answered with its result in a tool message
   (the context grows), each final answer followed by the next task; it
   reports how many turns ended in a parsed tool call and how many calls
   named a declared tool with arguments its schema accepts.
With a speculative-decoding drafter on the server (`--speculative-config`,
the Gemma 4 assistant), each sweep row and the agent workload also report
from vLLM's counters the draft acceptance rate, accepted tokens per draft
and tokens per verification step.
Writes results.json, results.md (beside the reference numbers of
../shared/GEMMA4_FACTS.md) and plot.png.

On a TPU VM (the server needs the parser flags, SERVE_FLAGS; fp8 KV is
the server's choice, recorded from its metrics and checked against
--kv-cache-dtype when given):
    vllm serve google/gemma-4-E2B-it-qat-q4_0-unquantized --load-format gemma_qat \\
        --enable-auto-tool-choice --tool-call-parser gemma4 \\
        --reasoning-parser gemma4 --kv-cache-dtype fp8 &
    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 \\
        --model google/gemma-4-E2B-it-qat-q4_0-unquantized --kv-cache-dtype fp8 \\
        --out bench-out
Smoke run on CPU (starts its own CPU-mode server, with these flags and
--kv-cache-dtype if given, on the tiny agent model of testing/agent.py,
trained in seconds):
    ./run python benchmarks/serve_bench.py --smoke --kv-cache-dtype fp8 --out /tmp/serve-bench
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from vllm_gemma_qat.cpu.server import metric_totals
from vllm_gemma_qat.testing import agent

# ../shared/GEMMA4_FACTS.md: vLLM on the regular BF16 export, TPU v6e-1,
# random 1024 in / 128 out, aggregate output tok/s by concurrency.
REFERENCE_TOK_S = {1: 209, 8: 1209, 32: 1636, 64: 2140, 100: 2215}
# What the agents ask, in turn; their tools run here (`run_tool`).
TASKS = ["Weather in Paris?", "Add 2 and 3.", "Weather in Oslo?",
         "Add 40 and 2."]
SERVE_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "gemma4",
               "--reasoning-parser", "gemma4"]


def sweep(base_url, model, tokenizer, concurrency, input_len, output_len,
          out: Path) -> list[dict]:
    # `vllm bench serve`'s own code, run here: one import for the whole sweep
    # instead of a vLLM CLI process per concurrency.
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    rows = []
    for c in concurrency:
        before = metric_totals(base_url)
        args = parser.parse_args([
            "--backend", "openai", "--base-url", base_url, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--num-prompts", str(max(4 * c, 8)),
            "--max-concurrency", str(c), "--ignore-eos", "--save-result",
            "--result-dir", str(out), "--result-filename", f"sweep-c{c}.json"])
        with contextlib.redirect_stdout(io.StringIO()):  # its report tables
            r = bench_serve(args)
        rows.append({"concurrency": c, "output_tok_s": r["output_throughput"],
                     "per_stream_tok_s": r["output_throughput"] / c,
                     "median_ttft_ms": r["median_ttft_ms"],
                     "median_tpot_ms": r["median_tpot_ms"],
                     "speculation": speculation(before,
                                                metric_totals(base_url))})
        print(f"sweep c={c}: {rows[-1]}", flush=True)
    return rows


def chat_stream(base_url, model, messages, max_tokens) -> dict:
    """One streamed chat turn with `agent.TOOLS`: its text, the tool calls
    vLLM's tool parser assembled from the deltas, time to the first delta,
    total time and completion tokens."""
    body = {"model": model, "messages": messages, "tools": agent.TOOLS,
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}}
    request = urllib.request.Request(
        base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    start, ttft, content, tokens, calls = time.perf_counter(), None, "", 0, {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if ttft is None and (delta.get("content") or delta.get(
                        "tool_calls") or delta.get("reasoning")):
                    ttft = time.perf_counter() - start
                content += delta.get("content") or ""
                for d in delta.get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {
                        "id": "", "name": "", "arguments": ""})
                    call["id"] = d.get("id") or call["id"]
                    function = d.get("function") or {}
                    call["name"] += function.get("name") or ""
                    call["arguments"] += function.get("arguments") or ""
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    return {"content": content, "calls": [calls[i] for i in sorted(calls)],
            "ttft": ttft if ttft is not None else total, "total": total,
            "tokens": tokens}


def run_tool(call: dict) -> tuple[bool, str | None]:
    """(whether the call names a tool of `agent.TOOLS` with arguments its
    schema accepts, the tool's result)."""
    import jsonschema
    schemas = {t["function"]["name"]: t["function"]["parameters"]
               for t in agent.TOOLS}
    try:
        args = json.loads(call["arguments"])
        jsonschema.validate(args, schemas[call["name"]])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False, None
    if call["name"] == "add":
        return True, str(args["a"] + args["b"])
    return True, "sunny"


def speculation(before: dict, after: dict) -> dict | None:
    """Speculative decoding between two `metric_totals` readings (None
    without a drafter): drafted and accepted tokens, the acceptance rate,
    accepted tokens per draft, and tokens a request gains per verification
    step (the accepted ones and the target's own)."""
    def added(name):
        name = f"vllm:spec_decode_num_{name}_total"
        return after.get(name, 0) - before.get(name, 0)

    drafts = added("drafts")
    if not drafts:
        return None
    drafted, accepted = added("draft_tokens"), added("accepted_tokens")
    return {"drafts": drafts, "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted,
            "accepted_per_draft": accepted / drafts,
            "tokens_per_step": 1 + accepted / drafts}


def agents(base_url, model, n_agents, turns, max_tokens) -> dict:
    """N agents, `turns` requests each: a task, then each tool call answered
    with its result in a tool message (the context grows), each final
    answer followed by the next task. Calls go through vLLM's tool and
    reasoning parsers (the server runs with SERVE_FLAGS)."""
    before = metric_totals(base_url)
    turns_done, lock, errors = [], threading.Lock(), []

    def agent(i):
        try:
            run_agent(i)
        except Exception as e:  # surfaced below, not lost in the thread
            errors.append(e)

    def run_agent(i):
        task = i
        messages = [{"role": "user", "content": TASKS[task % len(TASKS)]}]
        for _ in range(turns):
            r = chat_stream(base_url, model, messages, max_tokens)
            results = [run_tool(c) for c in r["calls"]]
            with lock:
                turns_done.append((r, results))
            if not r["calls"]:
                task += 1
                messages += [{"role": "assistant", "content": r["content"]},
                             {"role": "user",
                              "content": TASKS[task % len(TASKS)]}]
                continue
            messages.append({"role": "assistant", "content": r["content"],
                             "tool_calls": [{
                                 "id": c["id"], "type": "function",
                                 "function": {"name": c["name"],
                                              "arguments": c["arguments"]}}
                                 for c in r["calls"]]})
            messages += [{"role": "tool", "tool_call_id": c["id"],
                          "content": result or "error: invalid call"}
                         for c, (_, result) in zip(r["calls"], results)]

    start = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(i, ))
               for i in range(n_agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} agent(s) failed") from errors[0]
    after = metric_totals(base_url)
    queries = (after.get("vllm:prefix_cache_queries_total", 0) -
               before.get("vllm:prefix_cache_queries_total", 0))
    hits = (after.get("vllm:prefix_cache_hits_total", 0) -
            before.get("vllm:prefix_cache_hits_total", 0))
    responses = [r for r, _ in turns_done]
    calls = [ok for _, results in turns_done for ok, _ in results]
    tokens = sum(r["tokens"] for r in responses)
    tpots = [(r["total"] - r["ttft"]) / (r["tokens"] - 1)
             for r in responses if r["tokens"] > 1]
    return {"agents": n_agents, "turns": turns, "calls": len(responses),
            "tool_calls": len(calls),
            "tool_call_turn_rate": sum(bool(r["calls"]) for r in responses)
            / len(responses),
            "tool_call_valid_rate": sum(calls) / len(calls) if calls else None,
            "aggregate_tok_s": tokens / wall,
            "per_stream_tok_s": tokens / wall / n_agents,
            "median_ttft_ms": 1000 * statistics.median(
                r["ttft"] for r in responses),
            "median_tpot_ms": 1000 * statistics.median(tpots) if tpots else None,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "speculation": speculation(before, after)}


def served_kv_cache_dtype(base_url) -> str:
    """The server's --kv-cache-dtype, from its cache_config_info metric."""
    text = urllib.request.urlopen(base_url + "/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            found = re.search(r'cache_dtype="([^"]*)"', line)
            if found:
                return found.group(1)
    raise RuntimeError(f"{base_url}/metrics has no vllm:cache_config_info "
                       "with a cache_dtype label")


def write_markdown(out: Path, sweep_rows, agent_row, label,
                   kv_dtype) -> None:
    lines = [f"# Serving benchmark: {label}", "",
             "| concurrency | output tok/s | per stream tok/s | median TTFT ms "
             "| median TPOT ms | reference tok/s (v6e-1, BF16 export) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in sweep_rows:
        ref = REFERENCE_TOK_S.get(r["concurrency"], "")
        lines.append(f"| {r['concurrency']} | {r['output_tok_s']:.1f} | "
                     f"{r['per_stream_tok_s']:.1f} | {r['median_ttft_ms']:.1f} "
                     f"| {r['median_tpot_ms']:.1f} | {ref} |")
    a = agent_row
    valid = a["tool_call_valid_rate"]
    lines += ["", f"Agents (KV cache {kv_dtype}):", "",
              "| agents x turns | aggregate tok/s | per stream tok/s | "
              "median TTFT ms | median TPOT ms | prefix-cache hit rate | "
              "turns ending in a tool call | tool calls valid |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |",
              f"| {a['agents']} x {a['turns']} | {a['aggregate_tok_s']:.1f} | "
              f"{a['per_stream_tok_s']:.1f} | {a['median_ttft_ms']:.1f} | "
              f"{a['median_tpot_ms'] or float('nan'):.1f} | "
              f"{a['prefix_cache_hit_rate'] or 0:.2f} | "
              f"{a['tool_call_turn_rate']:.2f} | "
              f"{'-' if valid is None else f'{valid:.2f}'} |"]
    spec = [(f"c={r['concurrency']}", r["speculation"]) for r in sweep_rows]
    spec = [(name, x) for name, x in spec + [("agents", a["speculation"])]
            if x]
    if spec:
        lines += ["", "Speculative decoding (vLLM's counters):", "",
                  "| run | acceptance rate | accepted per draft | "
                  "tokens per step |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {x['acceptance_rate']:.2f} | "
                  f"{x['accepted_per_draft']:.2f} | "
                  f"{x['tokens_per_step']:.2f} |" for name, x in spec]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, sweep_rows, label) -> None:
    """Output tok/s vs concurrency, measured and reference (PIL only)."""
    from PIL import Image, ImageDraw
    w, h, m = 640, 400, 50
    image = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(image)
    series = {label: {r["concurrency"]: r["output_tok_s"] for r in sweep_rows},
              "reference v6e-1 BF16": REFERENCE_TOK_S}
    xs = sorted({c for s in series.values() for c in s})
    top = max(v for s in series.values() for v in s.values()) * 1.1
    draw.line([(m, h - m), (w - m, h - m)], fill="black")
    draw.line([(m, m), (m, h - m)], fill="black")

    def point(c, v):
        x = m + (w - 2 * m) * (xs.index(c) / max(len(xs) - 1, 1))
        return x, h - m - (h - 2 * m) * v / top

    for c in xs:
        draw.text((point(c, 0)[0] - 6, h - m + 6), str(c), fill="black")
    draw.text((m, 10), f"output tok/s (max {top / 1.1:.0f}) vs concurrency",
              fill="black")
    for (name, s), color in zip(series.items(), ("blue", "gray")):
        pts = [point(c, s[c]) for c in sorted(s)]
        if len(pts) > 1:
            draw.line(pts, fill=color, width=2)
        for p in pts:
            draw.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=color)
        draw.text((w - 220, 30 + 15 * list(series).index(name)), name,
                  fill=color)
    image.save(out / "plot.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model")
    parser.add_argument("--tokenizer")
    parser.add_argument("--concurrency", type=int, nargs="+",
                        default=[1, 2, 4, 8])
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("serve-bench-out"))
    parser.add_argument("--kv-cache-dtype", help="the KV cache dtype the "
                        "server must run (smoke: passed to its server)")
    parser.add_argument("--smoke", action="store_true", help="start a "
                        "CPU-mode server on the tiny agent model; small sizes, "
                        "the test servers' 32-token steps")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from vllm_gemma_qat.cpu.server import CpuServer
        model_dir = args.out / "tiny-agent-model"
        if model_dir.exists():
            shutil.rmtree(model_dir)
        agent.save_servable(model_dir)
        kv = ["--kv-cache-dtype", args.kv_cache_dtype] \
            if args.kv_cache_dtype else []
        # The test servers' one step size: one model compile, not one per
        # token bucket the sweep meets (what a smoke run need not time).
        server = CpuServer(model_dir, "--max-model-len", "1024", *SERVE_FLAGS,
                           *kv, log=args.out / "server.log")
        args.model = args.tokenizer = str(model_dir)
        args.concurrency, args.input_len, args.output_len = [1, 2], 48, 8
        args.agents, args.turns = 2, 2
        label = "CPU smoke (tiny agent model, CPU mode)"
    else:
        server, label = None, f"{args.model} via gemma_qat"
    with server or contextlib.nullcontext():
        base_url = server.url if server else args.base_url
        kv_dtype = served_kv_cache_dtype(base_url)
        if args.kv_cache_dtype and kv_dtype != args.kv_cache_dtype:
            raise SystemExit(f"{base_url} runs --kv-cache-dtype {kv_dtype}, "
                             f"not {args.kv_cache_dtype}")
        rows = sweep(base_url, args.model, args.tokenizer or args.model,
                     args.concurrency, args.input_len, args.output_len,
                     args.out)
        agent_row = agents(base_url, args.model, args.agents, args.turns,
                           max_tokens=48)
        print(f"agents: {agent_row}", flush=True)
    (args.out / "results.json").write_text(json.dumps(
        {"label": label, "kv_cache_dtype": kv_dtype, "sweep": rows,
         "agents": agent_row, "reference_tok_s": REFERENCE_TOK_S}, indent=1))
    write_markdown(args.out, rows, agent_row, label, kv_dtype)
    plot(args.out, rows, label)
    print(f"wrote {args.out}/results.json, results.md, plot.png")


if __name__ == "__main__":
    main()
