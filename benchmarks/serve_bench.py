"""Serving benchmark against a running `vllm serve ... --load-format gemma_qat`.

1. vLLM's own serving benchmark (`vllm bench serve`'s code, random dataset)
   at each concurrency.
2. An agent workload no standard benchmark has: N agents, each a multi-turn
   loop over a shared system prompt whose context grows by appending tool
   results, every turn ending in a JSON tool call under guided decoding
   (`response_format` json_schema).
Writes results.json, results.md (beside the reference numbers of
../shared/GEMMA4_FACTS.md) and plot.png.

On a TPU VM:
    vllm serve google/gemma-4-E2B-it-qat-q4_0-unquantized --load-format gemma_qat &
    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 \\
        --model google/gemma-4-E2B-it-qat-q4_0-unquantized --out bench-out
Smoke run on CPU (starts its own CPU-mode server on the tiny model):
    ./run python benchmarks/serve_bench.py --smoke --out /tmp/serve-bench
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from vllm_gemma_qat.cpu.server import metric_totals

# ../shared/GEMMA4_FACTS.md: vLLM on the regular BF16 export, TPU v6e-1,
# random 1024 in / 128 out, aggregate output tok/s by concurrency.
REFERENCE_TOK_S = {1: 209, 8: 1209, 32: 1636, 64: 2140, 100: 2215}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {"tool": {"type": "string", "enum": ["search", "read",
                                                       "write", "finish"]},
                   "arg": {"type": "string", "maxLength": 24}},
    "required": ["tool", "arg"], "additionalProperties": False}
SYSTEM = ("You are an agent. Each turn, answer with exactly one JSON tool "
          "call {\"tool\": ..., \"arg\": ...}. Tools: search, read, write, "
          "finish. ")


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
                     "median_tpot_ms": r["median_tpot_ms"]})
        print(f"sweep c={c}: {rows[-1]}", flush=True)
    return rows


def chat_stream(base_url, model, messages, max_tokens):
    """(content, ttft_s, total_s, completion_tokens) of one streamed call."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "tool_call", "schema": TOOL_SCHEMA}}}
    request = urllib.request.Request(
        base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    start, ttft, content, tokens = time.perf_counter(), None, "", 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                content += piece
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    return content, ttft if ttft is not None else total, total, tokens


def agents(base_url, model, n_agents, turns, max_tokens) -> dict:
    import jsonschema
    before = metric_totals(base_url)
    calls, lock = [], threading.Lock()

    errors = []

    def agent(i):
        try:
            run_agent(i)
        except Exception as e:  # surfaced below, not lost in the thread
            errors.append(e)

    def run_agent(i):
        rng = random.Random(i)
        messages = [{"role": "system", "content": SYSTEM * 4},
                    {"role": "user", "content": f"Task {i}: find file {i}."}]
        for _ in range(turns):
            content, ttft, total, tokens = chat_stream(base_url, model,
                                                       messages, max_tokens)
            try:
                jsonschema.validate(json.loads(content), TOOL_SCHEMA)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            with lock:
                calls.append((ttft, total, tokens, valid))
            messages.append({"role": "assistant", "content": content})
            result = " ".join(rng.choice(["ok", "file", "line", "match", "42"])
                              for _ in range(24))
            messages.append({"role": "user", "content": f"Tool result: {result}"})

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
    tokens = sum(c[2] for c in calls)
    tpots = [(c[1] - c[0]) / max(c[2] - 1, 1) for c in calls if c[2] > 1]
    return {"agents": n_agents, "turns": turns, "calls": len(calls),
            "aggregate_tok_s": tokens / wall,
            "per_stream_tok_s": tokens / wall / n_agents,
            "median_ttft_ms": 1000 * statistics.median(c[0] for c in calls),
            "median_tpot_ms": 1000 * statistics.median(tpots) if tpots else None,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "json_valid_rate": sum(c[3] for c in calls) / len(calls)}


def write_markdown(out: Path, sweep_rows, agent_row, label) -> None:
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
    lines += ["", "| agents x turns | aggregate tok/s | per stream tok/s | "
              "median TTFT ms | median TPOT ms | prefix-cache hit rate | "
              "JSON valid |", "| --- | --- | --- | --- | --- | --- | --- |",
              f"| {a['agents']} x {a['turns']} | {a['aggregate_tok_s']:.1f} | "
              f"{a['per_stream_tok_s']:.1f} | {a['median_ttft_ms']:.1f} | "
              f"{a['median_tpot_ms'] or float('nan'):.1f} | "
              f"{a['prefix_cache_hit_rate'] or 0:.2f} | "
              f"{a['json_valid_rate']:.2f} |"]
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
    parser.add_argument("--smoke", action="store_true", help="start a "
                        "CPU-mode server on the tiny model; small sizes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from vllm_gemma_qat.cpu.server import CpuServer
        from vllm_gemma_qat.testing import tiny
        model_dir = args.out / "tiny-model"
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tiny.save_servable(model_dir)
        server = CpuServer(model_dir, "--max-model-len", "1024",
                           "--structured-outputs-config",
                           '{"backend": "xgrammar", "disable_any_whitespace": true}',
                           log=args.out / "server.log", step_tokens=None)
        args.model = args.tokenizer = str(model_dir)
        args.concurrency, args.input_len, args.output_len = [1, 2], 48, 8
        args.agents, args.turns = 2, 2
        label = "CPU smoke (tiny model, CPU mode)"
    else:
        server, label = None, f"{args.model} via gemma_qat"
    with server or contextlib.nullcontext():
        base_url = server.url if server else args.base_url
        rows = sweep(base_url, args.model, args.tokenizer or args.model,
                     args.concurrency, args.input_len, args.output_len,
                     args.out)
        agent_row = agents(base_url, args.model, args.agents, args.turns,
                           max_tokens=48)
        print(f"agents: {agent_row}", flush=True)
    (args.out / "results.json").write_text(json.dumps(
        {"label": label, "sweep": rows, "agents": agent_row,
         "reference_tok_s": REFERENCE_TOK_S}, indent=1))
    write_markdown(args.out, rows, agent_row, label)
    plot(args.out, rows, label)
    print(f"wrote {args.out}/results.json, results.md, plot.png")


if __name__ == "__main__":
    main()
