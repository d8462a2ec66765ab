"""`vllm-gemma-qat inspect` and `vllm-gemma-qat plan`: will it load, and will
my agents fit. Reads config.json and safetensors headers only; imports
neither vLLM nor JAX, so it answers in well under a second on any machine.
`vllm-gemma-qat compile` (vllm_gemma_qat.aot, imported only by it) compiles
for a TPU topology through libtpu, without a TPU.

Exit codes: 0 loads with gemma_qat (inspect) / fits (plan, compile); 1 will
not load / does not fit / a program did not compile; 2 unreadable input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections import Counter

from vllm_gemma_qat import geometry, plan, quantization, targets
from vllm_gemma_qat.checkpoint import CheckpointError


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _auto_reason(report: geometry.CheckpointReport) -> str:
    if not report.loads_with_gemma_qat:
        return "the checkpoint itself is incomplete or inconsistent"
    if report.loads_with_auto:
        return "all layers ship K/V"
    n = report.geometry.num_kv_shared_layers
    return (f"tpu-inference 0.32 allocates k_proj/v_proj/k_norm on the {n} "
            f"KV-shared layers, which this export omits (tpu-inference #3225)")


def inspect_summary(ckpt, report: geometry.CheckpointReport) -> dict:
    geo = report.geometry
    by_dtype = Counter()
    for info in ckpt.tensors.values():
        by_dtype[info.dtype] += info.nbytes
    sources = {}
    for shared, src in geo.kv_share_map.items():
        sources.setdefault(geo.layer_types[shared], src)
    return {
        "path": str(ckpt.path),
        "architecture": report.architecture,
        "export_kind": report.export_kind,
        "num_layers": geo.num_layers,
        "layer_types": Counter(geo.layer_types),
        "kv_shared_layers": sorted(geo.kv_share_map),
        "kv_share_sources": sources,
        "head_dim": {t: geo.head_dim(geo.layer_types.index(t))
                     for t in set(geo.layer_types)},
        "kv_heads": {t: geo.kv_heads(geo.layer_types.index(t))
                     for t in set(geo.layer_types)},
        "double_wide_mlp": bool(geo.text.get("use_double_wide_mlp")),
        "language_model_tensors": report.lm_tensors,
        "expected_tensors": len(report.expected),
        "skipped_shared_kv_tensors": len(report.skipped),
        "missing": report.missing,
        "unexpected": report.unexpected,
        "wrong_shape": [{"tensor": n, "shape": list(g), "expected": list(w)}
                        for n, g, w in report.wrong_shape],
        "errors": report.errors(),
        "weight_bytes_by_dtype": dict(by_dtype),
        "quantized_modules": report.quantized,
        "loads_with_gemma_qat": report.loads_with_gemma_qat,
        "loads_with_auto": report.loads_with_auto,
        "auto_reason": _auto_reason(report),
        "vision_tower_bytes": sum(i.nbytes for n, i in ckpt.tensors.items()
                                  if plan.is_vision_tensor(n)),
        "tokens_per_image": plan.soft_tokens_per_image(ckpt.config),
        "audio_tower_bytes": sum(i.nbytes for n, i in ckpt.tensors.items()
                                 if plan.is_audio_tensor(n)),
        "tokens_per_audio_clip": plan.soft_tokens_per_clip(ckpt.config),
    }


def _print_inspect(s: dict) -> None:
    types = ", ".join(f"{n} {t.replace('_attention', '')}"
                      for t, n in s["layer_types"].items())
    shared = s["kv_shared_layers"]
    print(f"checkpoint    {s['path']}")
    print(f"architecture  {s['architecture']}  export: {s['export_kind']}")
    print(f"layers        {s['num_layers']} ({types})")
    if shared:
        src = ", ".join(f"{t.replace('_attention', '')} -> {i}"
                        for t, i in s["kv_share_sources"].items())
        print(f"KV-shared     {len(shared)} layers ({shared[0]}-{shared[-1]}); "
              f"K/V from {src}")
    print("head_dim      " + ", ".join(
        f"{t.replace('_attention', '')} {d}" for t, d in s["head_dim"].items()))
    print("KV heads      " + ", ".join(
        f"{t.replace('_attention', '')} {d}" for t, d in s["kv_heads"].items()))
    print(f"double-wide   {'yes' if s['double_wide_mlp'] else 'no'}")
    print(f"LM tensors    {s['language_model_tensors']} in checkpoint, "
          f"{s['expected_tensors']} needed by gemma_qat, "
          f"{s['skipped_shared_kv_tensors']} unused shared-layer K/V (skipped)")
    for key in ("missing", "unexpected"):
        print(f"{key:<14}{len(s[key])}" + "".join(f"\n  {n}" for n in s[key][:20]))
    print(f"wrong shape   {len(s['wrong_shape'])}" + "".join(
        f"\n  {w['tensor']}: {w['shape']}, expected {w['expected']}"
        for w in s["wrong_shape"][:20]))
    print(f"int4 modules  {len(s['quantized_modules'])}"
          + (f" ({_module_summary(s['quantized_modules'])})"
             if s["quantized_modules"] else ""))
    if "grid" in s:
        off = s["grid"]["off_grid"]
        print(f"q4_0 grid     {s['grid']['on_grid']} of "
              f"{s['grid']['on_grid'] + len(off)} bf16 linears on the int4 "
              f"grid" + "".join(f"\n  off grid: {m}" for m in off))
    print("weights       " + ", ".join(
        f"{d} {_gb(n)}" for d, n in sorted(s["weight_bytes_by_dtype"].items())))
    if s["tokens_per_image"]:
        print(f"images        vision tower {_gb(s['vision_tower_bytes'])}; up "
              f"to {s['tokens_per_image']} tokens of context per image (soft "
              "tokens + boi/eoi; `plan --images N` for their KV)")
    if s["tokens_per_audio_clip"]:
        print(f"audio         audio tower {_gb(s['audio_tower_bytes'])} (served "
              f"by gemma_qat); up to {s['tokens_per_audio_clip']} tokens of "
              "context per clip (30 s: soft tokens + boa/eoa)")
    yes = {True: "yes", False: "no"}
    print(f"verdict       loads with --load-format gemma_qat: "
          f"{yes[s['loads_with_gemma_qat']]}; with stock auto: "
          f"{yes[s['loads_with_auto']]} ({s['auto_reason']})")
    for e in s["errors"][:5]:
        print(f"  error: {e}")


def _module_summary(modules: list[str]) -> str:
    """`layers.*.mlp.down_proj x35, per_layer_model_projection`: per-layer
    modules counted under one pattern."""
    counts = Counter(re.sub(r"^.*?layers\.\d+\.", "layers.*.", m)
                     if re.search(r"layers\.\d+\.", m) else
                     m.rsplit(".", 1)[-1] for m in modules)
    return ", ".join(f"{m} x{n}" if n > 1 else m
                     for m, n in sorted(counts.items()))


def _bf16_linears(report: geometry.CheckpointReport) -> list[str]:
    quantized = set(report.quantized)
    return [m for m in report.geometry.linear_modules(report.prefix)
            if m not in quantized]


def _off_grid(ckpt, report: geometry.CheckpointReport) -> dict[str, str]:
    """{bf16 linear off the q4_0 grid: why}."""
    from vllm_gemma_qat import int4
    return int4.off_grid_modules(ckpt, _bf16_linears(report))


def cmd_inspect(args) -> int:
    ckpt, report = targets.open_headers(args.checkpoint,
                                        remote_ok=not args.grid)
    summary = inspect_summary(ckpt, report)
    if args.grid and report.loads_with_gemma_qat:
        off = _off_grid(ckpt, report)
        summary["grid"] = {"on_grid": len(_bf16_linears(report)) - len(off),
                           "off_grid": sorted(off)}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_inspect(summary)
    return 0 if report.loads_with_gemma_qat else 1


def cmd_plan(args) -> int:
    geo, weights, dtypes, source, config = targets.plan_inputs(
        args.target, int4_export_ok=args.weights == "int4")
    if args.assistant:
        helper_bytes, helper_tensors, helper_dtypes = targets.assistant_bytes(
            args.target, config, args.assistant, args.dtype)
        weights = dataclasses.replace(weights, assistant_bytes=helper_bytes)
    p = plan.make_plan(geo, weights, agents=args.agents,
                       context=args.context, kv_dtype=args.kv_dtype,
                       hbm_gib=args.hbm_gib, utilization=args.utilization,
                       form=args.weights, tp=args.tp,
                       tokens_per_image=plan.soft_tokens_per_image(config),
                       tokens_per_audio_clip=plan.soft_tokens_per_clip(config),
                       images_per_agent=args.images,
                       dtype_bytes=targets.SERVED_DTYPE_BYTES[args.dtype],
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs,
                       block_size=args.block_size)
    rest = "as stored" if args.dtype == "auto" else args.dtype
    dtypes = (f"int4 linears, the rest {rest}" if args.weights == "int4"
              else dtypes if args.dtype == "auto" else args.dtype)
    indivisible = _int4_tp_indivisible(geo, args.tp) \
        if args.weights == "int4" else []
    ok = p.fits and not indivisible
    if args.json:
        print(json.dumps(p.as_dict() | {"weights_from": source,
                                        "weight_dtypes": dtypes,
                                        "int4_tp_indivisible": indivisible},
                         indent=1))
        return 0 if ok else 1
    for line in indivisible:
        print(f"tp            does NOT load at int4: {line}")
    kib = p.kv_bytes_per_token / 1024
    chips = f" per chip (TP={p.tp}; {_gb(p.weight_bytes)} in all)" \
        if p.tp > 1 else ""
    print(f"weights       {_gb(p.weight_bytes_per_chip)}{chips} ({dtypes}; "
          f"from {source})")
    if args.assistant:
        print(f"  assistant   {_gb(p.assistant_bytes)} of it, whole on every "
              f"chip ({args.assistant}: {helper_tensors} tensors, "
              f"{helper_dtypes}; no KV of its own: its layers read the "
              "target's cache)")
    if p.context_limit and args.context > p.context_limit:
        print(f"context       {args.context} tokens exceeds the model's "
              f"max_position_embeddings {p.context_limit}: does NOT fit")
    print(f"KV per token  {p.kv_bytes_per_token} bytes{' per chip' if p.tp > 1 else ''} "
          f"({kib:g} KiB, {args.kv_dtype}; "
          f"{geo.num_layers - geo.num_kv_shared_layers} of "
          f"{geo.num_layers} layers hold KV)")
    layout = (f"sliding layers keep their {geo.text.get('sliding_window')}"
              "-token window (#3220)" if p.kv_sliding_window else
              "every layer keeps the full context")
    print(f"budget        {_gb(p.budget_bytes)} for KV per chip "
          f"({args.hbm_gib:g} GiB x {args.utilization:g} - weights): "
          f"{p.kv_pool_blocks} blocks of {p.kv_block_size} tokens, "
          f"{p.kv_block_bytes / 1024:g} KiB; "
          f"{layout}")
    print(f"              vLLM logs 'TPU KV cache size: {p.kv_cache_tokens} "
          f"tokens' with --max-model-len {args.context}")
    print(f"{args.agents} agents x {args.context} tokens:")
    print(f"  as gemma_qat serves   {_gb(p.kv_total_bytes)}"
          f"  {'fits' if p.fits else 'does NOT fit'}; max "
          f"{p.max_agents_at_context} agents at this context, max "
          f"{p.max_context_for_agents} tokens for {args.agents} agents "
          f"({p.kv_blocks_per_agent} blocks each, as vLLM counts them)")
    if p.kv_sliding_window:
        print(f"                        decoding, each holds "
              f"{p.kv_blocks_per_agent_decoding} blocks: up to "
              f"{p.max_agents_decoding_at_context} decode at once (vLLM "
              "admits a new request only with its window's reserve free)")
    print(f"  every layer at full context (tpu-inference 0.32)   "
          f"{_gb(p.kv_total_bytes_full_context)}  "
          f"{'fits' if p.fits_full_context else 'does NOT fit'}; max "
          f"{p.max_agents_at_context_full_context} agents, max "
          f"{p.max_context_for_agents_full_context} tokens")
    if p.tokens_per_image:
        tower = (f"; vision tower {_gb(p.vision_tower_bytes)}, whole on "
                 "every chip" if p.vision_tower_bytes else "")
        print(f"images        up to {p.tokens_per_image} tokens each (soft "
              f"tokens + boi/eoi): {p.kv_bytes_per_image / 1024:g} KiB of KV"
              f"{tower}")
        if p.images_per_agent:
            n = p.images_per_agent * p.tokens_per_image
            print(f"  {p.images_per_agent} images per agent take {n} of its "
                  f"{args.context} context tokens "
                  f"({_gb(p.images_per_agent * p.kv_bytes_per_image)} of KV "
                  "per agent)")
    if p.tokens_per_audio_clip:
        print(f"audio         up to {p.tokens_per_audio_clip} tokens a clip "
              f"(30 s): {p.tokens_per_audio_clip * p.kv_bytes_per_token / 2**20:.1f}"
              f" MiB of KV; audio tower {_gb(p.audio_tower_bytes)}, whole on "
              "every chip")
    return 0 if ok else 1


def _int4_tp_indivisible(geo, tp: int) -> list[str]:
    """Under the w4a16 export's scheme, the int4 modules `tp` chips cannot
    split (their scale groups along a row-parallel input)."""
    prefix = "model.language_model."
    scheme = quantization.w4a16_quantization_config()
    int4 = {m for m in geo.linear_modules(prefix)
            if quantization.quantizes(scheme, m)}
    return geometry.int4_groups_indivisible(geo, prefix, int4, tp)


def cmd_int4_overrides(args) -> int:
    ignore = []
    if args.checkpoint:
        ckpt, report = targets.open_headers(args.checkpoint)
        report.raise_if_invalid(ckpt.path)
        if report.quantized:
            raise CheckpointError(
                f"{ckpt.path}: already pack-quantized ({report.export_kind}); "
                "serve it without --hf-overrides")
        linears = _bf16_linears(report)
        off = _off_grid(ckpt, report)
        ignore = sorted(off)
        for module, why in sorted(off.items()):
            print(f"stays bf16: {why}", file=sys.stderr)
        # tpu-inference fuses gate_proj and up_proj: an off-grid half keeps
        # its partner bf16 too.
        for module in sorted(off):
            partner = geometry.fused_partner(module)
            if partner and partner not in off:
                ignore.append(partner)
                print(f"stays bf16: {partner} (fused with its off-grid "
                      "gate_proj / up_proj)", file=sys.stderr)
        print(f"{len(linears) - len(ignore)} of {len(linears)} bf16 linears "
              f"become int4", file=sys.stderr)
    print(json.dumps({"quantization_config":
                      quantization.w4a16_quantization_config(ignore)}))
    return 0


def cmd_compile(args) -> int:
    """Lazy: JAX, vLLM and tpu-inference are imported here only."""
    from vllm_gemma_qat.aot import AotError, compile as aot
    from vllm_gemma_qat.substitute import MissingTarget

    def log(message: str) -> None:  # progress, on stderr in both modes
        print(message, file=sys.stderr, flush=True)

    # vLLM, tpu-inference and libtpu log to stdout: stdout carries the
    # table or the JSON alone (their lines go to stderr; vLLM's at WARNING).
    # The environment is the caller's again afterwards (compile sets libtpu's
    # and vLLM's variables; a process that serves next must not inherit them).
    environ = dict(os.environ)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        r = aot.compile_model(
            args.target, args.topology, tp=args.tp, weights=args.weights,
            kv_dtype=args.kv_dtype, dtype=args.dtype,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            utilization=args.utilization, logits=not args.no_logits,
            sampling=not args.no_sampling,
            token_buckets=args.token_buckets, assistant=args.assistant,
            num_speculative_tokens=args.num_speculative_tokens,
            images=not args.no_images, helpers=not args.no_helpers,
            log=log, hbm_gib=args.hbm_gib,
            additional_config=args.additional_config)
    except (AotError, MissingTarget) as e:
        if not args.json:
            print(f"error: {e}", file=sys.stderr)
            return 2
        r = None
        error = str(e)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.environ.clear()
        os.environ.update(environ)
    if r is None:
        print(json.dumps({"error": error}))
        return 2
    if args.json:
        print(json.dumps(r.as_dict(), indent=1))
    else:
        _print_compile(r)
    return 0 if r.fits else 1


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _size(n: int) -> str:
    return _gb(n) if abs(n) >= 1e9 else f"{n / 1e6:.2f} MB"


def _print_compile(r) -> None:
    hosts = f" across {r.hosts} hosts" if r.hosts > 1 else ""
    print(f"{r.model} on {r.topology} (TP={r.tp}{hosts}), {r.weights} weights, "
          f"{r.kv_dtype} KV, --max-model-len {r.max_model_len} "
          f"--max-num-seqs {r.max_num_seqs} --max-num-batched-tokens "
          f"{r.max_num_batched_tokens}; page {r.block_size} tokens, "
          f"{r.num_blocks} pages")
    print(f"{'program':<48} {'result':<9} {'compile s':>9} {'temp':>12} "
          f"{'code':>10} {'est. ms':>9}")
    for p in r.programs:
        est = f"{p.est_seconds * 1e3:.3f}" if p.est_seconds is not None \
            else "-"
        print(f"{p.label:<48} {'compiled' if p.ok else 'FAILED':<9} "
              f"{p.compile_s:>9.1f} {_mib(p.temp_bytes):>12} "
              f"{_mib(p.code_bytes):>10} {est:>9}")
        if not p.ok:
            print(f"  the TPU compiler on {p.label}: "
                  + p.error.splitlines()[0][:400])
    kept = sum(p.kept for p in r.programs)
    if kept:
        print(f"  ({kept} of {len(r.programs)} as compiled before, the same "
              "way: their analyses are kept beside JAX's compilation cache; "
              "compile s is that compile's)")
    print(f"per chip ({r.hbm_bytes / 2**30:g} GiB HBM):")
    print(f"  weights          {_size(r.weight_bytes)}, language model "
          f"{_size(r.lm_weight_bytes)} (plan --tp {r.tp}: "
          f"{_size(r.plan_weight_bytes)}, language model "
          f"{_size(r.plan_lm_weight_bytes)}); the step's arguments as laid "
          f"out in HBM (memory_analysis): {_size(r.step_weight_bytes)}")
    if r.assistant:
        plan_helper = "config only, not counted" \
            if r.plan_assistant_weight_bytes is None \
            else _size(r.plan_assistant_weight_bytes)
        print(f"  assistant        {_size(r.assistant_weight_bytes)} of the "
              f"weights ({r.assistant}, {r.num_speculative_tokens} "
              f"speculative tokens; plan, whole: {plan_helper})")
    print(f"  KV cache         {_size(r.kv_bytes)} (plan: "
          f"{_size(r.plan_kv_bytes)}, {r.plan_kv_cache_tokens} tokens)")
    print(f"  largest temp     {_size(r.max_temp_bytes)}")
    print(f"  generated code   {_size(r.max_code_bytes)}")
    print(f"  total            {_size(r.total_bytes)} of "
          f"{_size(r.hbm_bytes)}")
    for d in r.disagreements:
        print(f"  DISAGREES with plan: {d}")
    verdict = "fits" if r.fits else "does NOT compile" if any(
        not p.ok for p in r.programs) else "does NOT fit"
    print(f"verdict          {verdict}" + "".join(
        f"\n  {w}" for w in r.why_not))
    for c in r.caveats:
        print(f"note: {c}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-gemma-qat",
        description="Preflight for Gemma 4 checkpoints under "
        "--load-format gemma_qat (headers only, no downloads).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="will this checkpoint load?")
    p.add_argument("checkpoint", help="local directory or hub repo id (from "
                   "the HF cache, else its headers from the hub)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--grid", action="store_true",
                   help="also read the bf16 linears and report which lie on "
                   "the q4_0 int4 grid (reads their data, not headers only)")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser(
        "plan", help="weights + KV cache for N agents x T tokens",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="exit codes: 0 fits, 1 does not fit, 2 bad input; with "
        "--json the plan (or the error) is one JSON object on stdout")
    p.add_argument("target", help="checkpoint directory, repo id, or config.json")
    p.add_argument("--agents", type=_positive(int), default=8,
                   help="concurrent sequences")
    p.add_argument("--context", type=_positive(int), default=8192,
                   help="tokens per sequence (at most the model's "
                   "max_position_embeddings)")
    p.add_argument("--kv-dtype", choices=sorted(plan.KV_DTYPE_BYTES),
                   default="bf16", help="KV cache dtype")
    p.add_argument("--hbm-gib", type=_positive(float), default=32.0,
                   help="accelerator memory per chip (v6e: 32)")
    p.add_argument("--utilization", type=_fraction, default=0.92,
                   help="vLLM --gpu-memory-utilization, in (0, 1] (vLLM's "
                   "default: 0.92)")
    p.add_argument("--dtype", choices=sorted(targets.SERVED_DTYPE_BYTES),
                   default="auto", help="vLLM --dtype: the weights other "
                   "than int4 linears in this dtype (auto: as stored; the "
                   "exports store bf16)")
    p.add_argument("--weights", choices=["bf16", "int4"], default="bf16",
                   help="int4: the linears as the w4a16 export holds them")
    p.add_argument("--images", type=_non_negative, default=0,
                   help="images per agent: the context tokens and KV they "
                   "take (multimodal exports)")
    p.add_argument("--tp", type=_positive(int), default=1,
                   help="chips in the slice, as vLLM --tensor-parallel-size "
                   "(v6e-4: 4, v6e-8: 8); the figures are per chip")
    p.add_argument("--assistant", metavar="DIR_OR_REPO",
                   help="a Gemma 4 assistant served with it "
                   "(--speculative-config): checked against the target, its "
                   "weights counted with the target's; the KV cache then "
                   "keeps the full context on every layer")
    p.add_argument("--max-num-batched-tokens", type=_positive(int),
                   default=plan.MAX_NUM_BATCHED_TOKENS,
                   help="vLLM --max-num-batched-tokens (vllm serve's default "
                   "on a v6e: 1024; v5e: 512): what vLLM reserves for a "
                   "sliding layer's window")
    p.add_argument("--max-num-seqs", type=_positive(int),
                   default=plan.MAX_NUM_SEQS,
                   help="vLLM --max-num-seqs (default 256): with --context "
                   "it sets tpu-inference's page size")
    p.add_argument("--block-size", type=_positive(int),
                   help="vLLM --block-size (default: the page size "
                   "tpu-inference picks for --context as --max-model-len)")
    p.add_argument("--json", action="store_true",
                   help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser(
        "int4-overrides",
        help="--hf-overrides JSON that serves a -qat-q4_0-unquantized export "
        "as exact int4 (compressed-tensors w4a16, tpu-inference's wNa16)")
    p.add_argument("checkpoint", nargs="?",
                   help="read this checkpoint's linears and quantize only "
                   "those on the q4_0 grid (off-grid ones named on stderr)")
    p.set_defaults(func=cmd_int4_overrides)
    p = sub.add_parser(
        "compile", help="compile the start-up programs of `vllm serve "
        "MODEL --load-format gemma_qat` for a TPU topology, without a TPU",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="exit codes: 0 every program compiled and it fits, 1 a "
        "program failed or it does not fit, 2 bad input")
    p.add_argument("target", help="checkpoint directory, repo id, or "
                   "config.json (no weights are read)")
    p.add_argument("--topology", required=True,
                   help="v6e-1, v6e-4, v6e-8, v5e-1, v5e-4, v5e-8")
    p.add_argument("--tp", type=_positive(int), default=None,
                   help="vLLM --tensor-parallel-size (default: every chip "
                   "of the topology)")
    p.add_argument("--weights", choices=["bf16", "int4"], default="bf16",
                   help="int4: the w4a16 scheme (int4-overrides / a w4a16 "
                   "export)")
    p.add_argument("--kv-dtype", choices=sorted(plan.KV_DTYPE_BYTES),
                   default="bf16")
    p.add_argument("--dtype", choices=sorted(targets.SERVED_DTYPE_BYTES),
                   default="auto", help="vLLM --dtype")
    p.add_argument("--max-model-len", type=_positive(int), default=None,
                   help="vLLM --max-model-len (default, as vLLM's: the "
                   "model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=_positive(int), default=8)
    p.add_argument("--max-num-batched-tokens", type=_positive(int),
                   default=None, help="vLLM's default when not given")
    p.add_argument("--utilization", type=_fraction, default=0.92,
                   help="vLLM --gpu-memory-utilization")
    p.add_argument("--hbm-gib", type=_positive(float), default=None,
                   help="memory per chip (default: the topology's, v5e 16, "
                   "v6e 32)")
    p.add_argument("--additional-config", type=json.loads, default=None,
                   metavar="JSON", help="vLLM --additional-config, as "
                   "`vllm serve` would get it (tpu-inference's options; "
                   "'{\"vision_warmup_config\": {\"image_shapes\": [[H, "
                   "W]]}}' precompiles the vision encoder for those images)")
    p.add_argument("--token-buckets", type=lambda t: [int(x) for x in
                                                      t.split(",")],
                   default=None, help="compile only these of the runner's "
                   "token buckets (comma-separated; default: all)")
    p.add_argument("--assistant", metavar="DIR",
                   help="a Gemma 4 assistant served with it, as "
                   "--speculative-config '{\"model\": DIR, ...}': its "
                   "drafter programs compiled too, its weights counted "
                   "(a directory; config.json alone is enough)")
    p.add_argument("--num-speculative-tokens", type=_positive(int),
                   default=None, help="--speculative-config's "
                   "num_speculative_tokens; required with --assistant "
                   "(vLLM 0.32 derives none from a Gemma 4 assistant)")
    p.add_argument("--no-logits", action="store_true",
                   help="skip compute_logits")
    p.add_argument("--no-sampling", action="store_true",
                   help="skip sample")
    p.add_argument("--no-images", action="store_true",
                   help="skip a multimodal model's image and audio programs "
                   "(vision encoder, audio encoder, embedding merge, step "
                   "with input embeddings), "
                   "which the runner compiles for a multimodal model")
    p.add_argument("--no-helpers", action="store_true",
                   help="skip the runner's small helper programs "
                   "(placeholder substitution, array selection, logprob "
                   "gathering, structured decoding; with --assistant also "
                   "the rejection sampler and speculative decoding's token "
                   "and logits bookkeeping)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compile)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CheckpointError as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e)}))
        else:
            print(f"error: {e}", file=sys.stderr)
        return 2


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
