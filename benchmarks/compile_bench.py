"""Compile-time comparison on a machine without a TPU (deviceless AOT,
`vllm_gemma_qat.aot.compile.compile_model`): full-size Gemma 4 E2B / E4B
(their public config values, `testing/synthetic.py`, language model only)
compiled by libtpu for TPU topologies, three ways each:

- int4:  `--load-format gemma_qat` on the w4a16 export (int4 linears)
- bf16:  `--load-format gemma_qat` on the QAT bf16 export
- stock: `--load-format auto` on the regular BF16 export: stock
  tpu-inference 0.32, which builds and computes K/V projections on the
  KV-shared layers and keeps every layer's KV at full context

For each it reports the compile time on this machine, what one chip holds
(weights, KV cache, the largest temporary and generated code of the
compiled step programs) and XLA's estimated step time (the Report's
`est_seconds`: the TPU compiler's cost model, `optimal_seconds` corrected
by one second per ConcatBitcast, plus the KV bytes the step's attention
reads by arithmetic at the chip's nominal HBM bandwidth). **Every time is
the compiler's estimate, not a measurement.**

Only the step programs are compiled (the runner's `compute_logits` and
`sample` are left out to save time), for the token buckets given; with
tpu-inference's default attention request bucketing (off), every step has
`num_reqs = --max-num-seqs`. Decode at N sequences runs the step whose
token bucket is the smallest >= N; prefill of one 512-token chunk runs the
512-token step.

    ./run python benchmarks/compile_bench.py --out bench-out
    ./run python benchmarks/compile_bench.py --smoke --out /tmp/compile-bench
    ./run python benchmarks/compile_bench.py --out bench-out --render
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

# name -> compile_model keywords
VARIANTS = {
    "int4": dict(weights="int4", load_format="gemma_qat"),
    "bf16": dict(weights="bf16", load_format="gemma_qat"),
    "stock": dict(weights="bf16", load_format="auto"),
}
TOPOLOGIES = {"v6e-1": 1, "v6e-4": 4, "v5e-1": 1}  # -> TP
DECODE_SEQS = (1, 8, 64)
PREFILL_TOKENS = 512


def write_configs(root: Path, models: list[str], smoke: bool) -> dict:
    """A config-only directory per model (what `compile` reads): the public
    config as a text-only Gemma4ForCausalLM, or the tiny test geometry."""
    out = {}
    for name in models:
        path = root / (f"tiny-{name}" if smoke else name)
        path.mkdir(parents=True, exist_ok=True)
        if smoke:
            from transformers import Gemma4Config

            from vllm_gemma_qat.testing import tiny
            config = Gemma4Config(
                text_config=tiny.text_config_kwargs(name), vision_config=None,
                audio_config=None, tie_word_embeddings=True)
            config.architectures = ["Gemma4ForCausalLM"]
            config.to_json_file(path / "config.json")
        else:
            from vllm_gemma_qat.testing import synthetic
            config = synthetic.CONFIGS[name] | {
                "architectures": ["Gemma4ForCausalLM"]}
            (path / "config.json").write_text(json.dumps(config))
        out[name] = path
    return out


def rows_for(runner_buckets: list[int], decode_seqs,
             prefill_tokens: int | None) -> dict:
    """{row label: token bucket} as the runner pads (its buckets): decode
    at N sequences schedules N tokens (one each), a prefill chunk its
    tokens."""
    from tpu_inference.runner.utils import get_padded_token_len
    rows = {f"decode {n}": get_padded_token_len(runner_buckets, n)
            for n in decode_seqs if n <= runner_buckets[-1]}
    if prefill_tokens and prefill_tokens <= runner_buckets[-1]:
        rows[f"prefill {prefill_tokens}"] = get_padded_token_len(
            runner_buckets, prefill_tokens)
    return rows


def runner_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """The runner's token buckets for these flags (bf16 KV)."""
    from tpu_inference import envs
    from tpu_inference.runner import utils as runner_utils
    return runner_utils.build_token_paddings(
        min_token_size=envs.MIN_TOKEN_BUCKET,
        max_token_size=max_num_batched_tokens,
        padding_gap=envs.VLLM_TPU_BUCKET_PADDING_GAP)


def run_one(target: Path, topo: str, tp: int, variant: str, flags: dict,
            token_buckets: list[int]) -> dict:
    from vllm_gemma_qat.aot.compile import compile_model
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"  [{time.perf_counter() - started:6.0f} s] {message}",
              file=sys.stderr, flush=True)

    # The step programs only (the runner's helpers, logits and sampling
    # are the same for every variant).
    report = compile_model(str(target), topo, tp=tp, logits=False,
                           sampling=False, helpers=False, images=False,
                           token_buckets=token_buckets,
                           log=log, **VARIANTS[variant], **flags)
    return report.as_dict() | {"wall_s": time.perf_counter() - started}


def _kept(programs) -> str:
    """Programs answered from an earlier compile (aot/analyses.py: where
    JAX_COMPILATION_CACHE_DIR is set) took no compile this run."""
    kept = sum(bool(p.get("kept")) for p in programs)
    return f" ({kept} of {len(programs)} kept)" if kept else ""


def _gb(n) -> str:
    return f"{n / 1e9:.3f}"


def _mib(n) -> str:
    return f"{n / 2**20:.1f}"


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def xla_seconds(prog: dict) -> float | None:
    """The XLA part of est_seconds (weights and compute, no KV term)."""
    if not prog["ok"]:
        return None
    return prog["optimal_seconds"] + prog["concat_bitcasts"]


def markdown(results: dict) -> str:
    rows = results["rows"]
    # Rows the runner pads to the same step share one column (one program).
    columns: dict[int, list[str]] = {}
    for label, bucket in rows.items():
        columns.setdefault(bucket, []).append(label)
    lines = [
        "# Compiled for a TPU without one: gemma_qat int4 / bf16 vs stock",
        "",
        f"{results['machine']}, {results['date']}; {results['stack']}.",
        "**Every step time is the TPU compiler's estimate (XLA cost model), "
        "not a measurement**; compile times are this machine's.",
        "",
        f"Flags: --max-model-len {results['flags']['max_model_len']} "
        f"--max-num-seqs {results['flags']['max_num_seqs']} "
        f"--max-num-batched-tokens "
        f"{results['flags']['max_num_batched_tokens']}, bf16 KV, "
        f"--gpu-memory-utilization {results['flags']['utilization']}; "
        f"token buckets compiled: {results['token_buckets']} (step programs "
        "only). Rows: " + ", ".join(
            f"{k} -> step(num_tokens={v})" for k, v in rows.items()) + ".",
        "",
        "est. ms = XLA `optimal_seconds` + 1 s per ConcatBitcast + the KV "
        "bytes the step's attention reads at nominal HBM bandwidth (worst "
        "case of the bucket: every one of its requests at --max-model-len, "
        "capped by the cache); in brackets the XLA part alone (weights and "
        "compute, no KV term). KV tokens: what vLLM logs as 'TPU KV cache "
        "size' for these flags (plan's figure; the compiled cache's bytes "
        "equal plan's unless listed below).",
        "",
        "| model | topology | variant | compile s | weights GB | KV GB | "
        "KV tokens | largest temp MiB | code MiB | fits | "
        + " | ".join(f"{' / '.join(labels)} (T={bucket}) est. ms (XLA part)"
                     for bucket, labels in columns.items()) + " |",
        "| --- " * (10 + len(columns)) + "|",
    ]
    for c in results["configs"]:
        head = f"| {c['model']} | {c['topology']} (TP={c['tp']}) | " \
            f"{c['variant']} |"
        if c.get("error") or c.get("skipped"):
            why = c.get("error") or c.get("skipped")
            lines.append(head + f" {why} |" + " |" * (6 + len(columns)))
            continue
        r = c["report"]
        progs = {p["shape"]["num_tokens"]: p for p in r["programs"]
                 if p["name"].endswith(" backbone")}  # the runner's step
        cells = []
        for bucket in columns:
            p = progs.get(bucket)
            if p is None or not p["ok"]:
                cells.append("FAILED" if p else "not compiled")
            else:
                cells.append(f"{_ms(p['est_seconds'])} "
                             f"({_ms(xla_seconds(p))})")
        lines.append(
            head + f" {r['wall_s']:.0f}{_kept(r['programs'])} | "
            f"{_gb(r['weight_bytes'])} | "
            f"{_gb(r['kv_bytes'])} | {r['plan_kv_cache_tokens']:,} | "
            f"{_mib(r['max_temp_bytes'])} | "
            f"{_mib(r['max_code_bytes'])} | "
            f"{'yes' if r['fits'] else 'NO'} | " + " | ".join(cells) + " |")
    lines += ["", "Per program:", "",
              "| model | topology | variant | program | compile s | temp MiB "
              "| code MiB | optimal_seconds | ConcatBitcast | KV read GB "
              "(arithmetic) | est. ms |", "| --- " * 11 + "|"]
    for c in results["configs"]:
        if "report" not in c:
            continue
        for p in c["report"]["programs"]:
            label = p["name"] + "(" + ", ".join(
                f"{k}={int(v)}" for k, v in p["shape"].items()) + ")"
            lines.append(
                f"| {c['model']} | {c['topology']} | {c['variant']} | "
                f"{label} | {p['compile_s']:.0f}"
                f"{' (kept)' if p.get('kept') else ''} | "
                f"{_mib(p['temp_bytes'])} | "
                f"{_mib(p['code_bytes'])} | {p['optimal_seconds']:.6g} | "
                f"{p['concat_bitcasts']} | {_gb(p['kv_read_bytes'])} | "
                f"{_ms(p['est_seconds'])} |"
                if p["ok"] else
                f"| {c['model']} | {c['topology']} | {c['variant']} | "
                f"{label} | {p['compile_s']:.0f} | FAILED: "
                f"{(p['error'] or '').splitlines()[0][:200]} | | | | | |")
    notes = [c for c in results["configs"] if "report" in c and (
        c["report"]["disagreements"] or c["report"]["why_not"])]
    if notes:
        lines += ["", "Disagreements with `plan` / why not:", ""]
        for c in notes:
            for line in c["report"]["why_not"] + c["report"]["disagreements"]:
                lines.append(f"- {c['model']} {c['topology']} "
                             f"{c['variant']}: {line}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="e2b,e4b")
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--token-buckets", default="16,64,512",
                        help="the runner's token buckets to compile")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--utilization", type=float, default=0.92)
    parser.add_argument("--stop-by", default=None, metavar="HH:MM",
                        help="UTC: start no configuration after this time "
                        "(left out, and listed as such)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny E2B-like config, v6e-1, int4, one token "
                        "bucket (seconds)")
    parser.add_argument("--render", action="store_true",
                        help="write results.md again from --out's "
                        "results.json (no compile)")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads((args.out / "results.json").read_text())
        (args.out / "results.md").write_text(markdown(results))
        print(markdown(results))
        return 0
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.smoke:
        models, topologies, variants = ["e2b"], ["v6e-1"], ["int4"]
        token_buckets = [16]
        flags = dict(max_model_len=256, max_num_seqs=8,
                     max_num_batched_tokens=16, utilization=args.utilization)
    else:
        models = args.models.split(",")
        topologies = args.topologies.split(",")
        variants = args.variants.split(",")
        token_buckets = [int(t) for t in args.token_buckets.split(",")]
        flags = dict(max_model_len=args.max_model_len,
                     max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     utilization=args.utilization)
    for name in topologies:
        if name not in TOPOLOGIES:
            parser.error(f"--topologies: one of {', '.join(TOPOLOGIES)}")
    for name in variants:
        if name not in VARIANTS:
            parser.error(f"--variants: one of {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    targets = write_configs(args.out / "configs", models, args.smoke)
    import importlib.metadata as md
    buckets = runner_token_buckets(flags["max_num_batched_tokens"])
    missing = [t for t in token_buckets if t not in buckets]
    if missing:
        parser.error(f"--token-buckets {missing}: not among the runner's "
                     f"buckets for these flags, {buckets}")
    results = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores "
                   "(no TPU: deviceless AOT)",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "stack": ", ".join(f"{p} {md.version(p)}" for p in (
            "vllm-tpu", "tpu-inference", "jax", "libtpu")
            if _installed(md, p)),
        "smoke": args.smoke,
        "flags": flags,
        "token_buckets": token_buckets,
        "runner_token_buckets": buckets,
        "rows": rows_for(buckets, (1, ) if args.smoke else DECODE_SEQS,
                         None if args.smoke else PREFILL_TOKENS),
        "configs": [],
    }
    started = time.perf_counter()
    for model in models:
        for topo in topologies:
            for variant in variants:
                entry = {"model": model, "topology": topo,
                         "tp": TOPOLOGIES[topo], "variant": variant}
                if args.stop_by and time.strftime(
                        "%H:%M", time.gmtime()) >= args.stop_by:
                    entry["skipped"] = \
                        f"not run (past --stop-by {args.stop_by})"
                else:
                    print(f"{model} {topo} {variant}", file=sys.stderr,
                          flush=True)
                    try:
                        entry["report"] = run_one(
                            targets[model], topo, TOPOLOGIES[topo], variant,
                            flags, token_buckets)
                    except Exception as e:  # reported, the next one runs
                        entry["error"] = f"{type(e).__name__}: {e}"[:2000]
                results["configs"].append(entry)
                results["wall_s"] = time.perf_counter() - started
                (args.out / "results.json").write_text(
                    json.dumps(results, indent=1))
                (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))
    ok = all("report" in c and c["report"]["all_compiled"]
             for c in results["configs"] if "skipped" not in c)
    return 0 if ok else 1


def _installed(md, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
