"""Load cost of gemma_qat vs stock tpu-inference, on the JAX CPU backend.

Builds once (cached outside the repo) synthetic checkpoints with the real
Gemma 4 E2B text-decoder shapes (~9 GB bf16 at --scale 1): the QAT layout and
the regular layout (same values; linears on the int4 grid), then loads each
in a new process, forked from one that has imported what a load imports
(the imports are no part of a load's time: ~20 s each on 2 cores):
  stock  `auto`      on the regular export (the only one stock can load)
  plugin `gemma_qat` on the QAT export
  int4   `gemma_qat` on the QAT export with the w4a16 overrides (exact int4)
and reports wall time (min / median / max of --runs loads each, 3 at full
size), peak RSS, final parameter bytes and the XLA programs compiled (from
JAX's compile log), with ratios. --before adds one load each of gemma_qat
bf16 and int4 with tpu-inference's clear of JAX's caches after every module
(VLLM_GEMMA_QAT_CLEAR_CACHES_PER_MODULE=1: how it loaded before
fixes/compile_once.py).

    ./run python benchmarks/load_bench.py [--scale 1.0] [--runs N] [--before]
                                          [--cache DIR] [--skip-int4]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PER_MODULE_ENV = "VLLM_GEMMA_QAT_CLEAR_CACHES_PER_MODULE"


def scaled_config(scale: float, layers: int | None = None) -> dict:
    from vllm_gemma_qat.testing import synthetic
    config = json.loads(json.dumps(synthetic.CONFIGS["e2b"]))
    text = config["text_config"]
    if layers:  # smoke runs: the same pattern, fewer layers, half shared
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
        text["num_kv_shared_layers"] = layers // 2
    if scale < 1:
        # Keep the layer pattern and sharing; shrink widths (multiples of 256).
        for key in ("hidden_size", "intermediate_size"):
            text[key] = max(256, int(text[key] * scale) // 256 * 256)
        for key in ("vocab_size", "vocab_size_per_layer_input"):
            text[key] = max(1024, int(text[key] * scale))
    config["architectures"] = ["Gemma4ForCausalLM"]
    config.pop("vision_config", None)
    config["vision_config"] = None
    config["audio_config"] = None
    return config


def build(path: Path, config: dict, layout: str) -> Path:
    """Random checkpoint, linears on the q4_0 grid (bf16 d = k * 2^-11)."""
    import torch
    from safetensors.torch import save_file

    from vllm_gemma_qat.geometry import Geometry
    if (path / "done").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    geo = Geometry.from_text_config(config["text_config"])
    shapes = geo.expected("model.language_model.")
    linears = set(geo.linear_modules("model.language_model."))
    if layout == "regular":
        shapes.update(geo.skippable("model.language_model."))
    rng = np.random.default_rng(0)
    shard, size, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, path / name, metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, shape in sorted(shapes.items()):
        on_grid = name.removesuffix(".weight") in linears
        tensor = torch.empty(shape, dtype=torch.bfloat16)
        rows = max(1, 2**24 // int(np.prod(shape[1:], dtype=np.int64)))
        for r in range(0, shape[0], rows):  # chunks: bounded fp32 memory
            n_rows = min(rows, shape[0] - r)
            if on_grid:
                q = rng.integers(-8, 8, size=(n_rows, shape[1]), dtype=np.int8)
                d = (rng.integers(8, 16, size=(n_rows, shape[1] // 32)) *
                     2.0**-11).astype(np.float32)
                w = (q.reshape(n_rows, -1, 32) * d[..., None]).reshape(
                    n_rows, shape[1])
            else:
                w = rng.standard_normal((n_rows, *shape[1:]),
                                        dtype=np.float32) * 0.02
            tensor[r:r + n_rows] = torch.from_numpy(w).to(torch.bfloat16)
        shard[name] = tensor
        size += tensor.numel() * 2
        if size > 2 * 2**30:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "done").write_text("ok")
    return path


class MemorySampler(threading.Thread):
    """Peak anonymous and file-backed RSS of this process, sampled from
    /proc/self/status. Peak RSS alone misleads: safetensors shards are
    mmapped, and their pages count in RSS until the kernel reclaims them
    (on a 24 GiB machine it does so at about the same total every run)."""

    def __init__(self, interval: float = 0.05):
        super().__init__(daemon=True)
        self.interval, self.peak = interval, {"RssAnon": 0, "RssFile": 0,
                                              "VmRSS": 0}
        self.done = threading.Event()

    def sample(self) -> None:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in self.peak:
                self.peak[key] = max(self.peak[key],
                                     int(value.split()[0]) * 1024)

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.sample()


def preload() -> None:
    """What a load imports, once, in the order `vllm serve` imports it (the
    plugins before tpu-inference's model modules, cpu/zygote.py): each load
    runs in a child forked from here. Nothing here starts JAX's backend."""
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import tpu_inference.models.common.model_loader  # noqa: F401
    import vllm.config  # noqa: F401

    from vllm_gemma_qat.fixes import compile_once  # noqa: F401
    from vllm_gemma_qat.testing import runner  # noqa: F401


def forked(log: Path, env: dict[str, str | None], function, *args) -> None:
    """function(*args) in a child forked from this process, with `env`
    applied (None: unset) and its output to `log`."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            function(*args)
            code = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the load failed (exit status "
                         f"{os.waitstatus_to_exitcode(status)}); see {log}")


def child(path: str, load_format: str, int4_flag: str, out: str) -> None:
    """One load in this (new) process; writes a JSON result."""
    from vllm.plugins import load_general_plugins

    from vllm_gemma_qat import quantization, weights
    from vllm_gemma_qat.fixes.compile_once import CompileLog
    from vllm_gemma_qat.testing import runner
    load_general_plugins()
    overrides = ({"quantization_config":
                  quantization.w4a16_quantization_config()}
                 if int4_flag == "int4" else None)
    sampler = MemorySampler()
    sampler.start()
    start = time.perf_counter()
    with CompileLog() as compiled:
        model, _, _ = runner.load(path, load_format, dtype="bfloat16",
                                  hf_overrides=overrides)
    wall = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    sampler.sample()
    by_dtype = weights.param_bytes_by_dtype(model.model)
    Path(out).write_text(json.dumps({
        "wall_s": wall,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_anon_bytes": sampler.peak["RssAnon"],
        "peak_file_bytes": sampler.peak["RssFile"],
        "compiles": compiled.total, "distinct_compiles": compiled.distinct,
        "param_bytes": sum(by_dtype.values()), "param_bytes_by_dtype": by_dtype}))


def overrides_cost(path: Path) -> dict:
    """`vllm-gemma-qat int4-overrides CHECKPOINT` against the time to read
    the linears' bytes (warm page cache for both: each read twice)."""
    from vllm_gemma_qat import checkpoint, geometry
    ckpt = checkpoint.open_checkpoint(path)
    report = geometry.check(ckpt)
    linears = report.geometry.linear_modules(report.prefix)
    for _ in range(2):
        start = time.perf_counter()
        nbytes = sum(checkpoint.read_bf16(ckpt, m + ".weight").nbytes
                     for m in linears)
        read_s = time.perf_counter() - start
    cli = [str(Path(sys.executable).with_name("vllm-gemma-qat")),
           "int4-overrides", str(path)]
    start = time.perf_counter()
    subprocess.run(cli, check=True, capture_output=True)
    overrides_s = time.perf_counter() - start
    print(f"[overrides] linears {nbytes / 1e9:.2f} GB: read {read_s:.1f} s, "
          f"int4-overrides CHECKPOINT {overrides_s:.1f} s", flush=True)
    return {"linear_bytes": nbytes, "read_s": read_s,
            "overrides_s": overrides_s}


def run(label, path, load_format, int4_flag, cache, runs=1,
        per_module=False) -> dict:
    """`runs` loads, each in a new process: the median run's figures, with
    every run's under "runs" and the wall-time min / median / max."""
    results = []
    for i in range(runs):
        out = cache / f"result-{label}-{i}.json"
        print(f"[{label}] loading {path.name} with --load-format {load_format}"
              f"{' + int4 overrides' if int4_flag == 'int4' else ''}"
              f"{' (clears per module)' if per_module else ''}, run {i + 1} of "
              f"{runs} ...", flush=True)
        forked(cache / f"load-{label}-{i}.log",
               {PER_MODULE_ENV: "1" if per_module else None}, child,
               str(path), load_format, int4_flag, str(out))
        result = json.loads(out.read_text())
        print(f"[{label}] {result['wall_s']:.1f} s, {result['compiles']} "
              f"compiles ({result['distinct_compiles']} distinct), peak RSS "
              f"{result['peak_rss_bytes'] / 2**30:.2f} GiB (anon "
              f"{result['peak_anon_bytes'] / 2**30:.2f}, file-backed "
              f"{result['peak_file_bytes'] / 2**30:.2f}), params "
              f"{result['param_bytes'] / 2**30:.2f} GiB", flush=True)
        results.append(result)
    walls = sorted(r["wall_s"] for r in results)
    median = sorted(results, key=lambda r: r["wall_s"])[(runs - 1) // 2]
    return dict(median, runs=results, wall_s_min=walls[0],
                wall_s_median=median["wall_s"], wall_s_max=walls[-1])


def spread(r: dict) -> str:
    return (f"{r['wall_s_min']:.1f} / {r['wall_s_median']:.1f} / "
            f"{r['wall_s_max']:.1f} s")


def ratios(a: dict, b: dict) -> str:
    """a / b wall time: min / median / max over the runs (min over min ...)."""
    return " / ".join(f"{a[k] / b[k]:.3f}" for k in
                      ("wall_s_min", "wall_s_median", "wall_s_max"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="width scale (1.0 = real E2B text decoder)")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-gemma-qat" / "bench")
    parser.add_argument("--layers", type=int,
                        help="fewer layers than E2B's 35 (smoke runs only)")
    parser.add_argument("--skip-int4", action="store_true")
    parser.add_argument("--runs", type=int,
                        help="loads per configuration (default: 3 at "
                        "--scale 1, else 1)")
    parser.add_argument("--before", action="store_true",
                        help="also one gemma_qat bf16 and int4 load each "
                        "with tpu-inference's per-module cache clears")
    args = parser.parse_args()
    runs = args.runs or (3 if args.scale >= 1 else 1)
    cache = args.cache / (f"e2b-scale{args.scale:g}" +
                          (f"-layers{args.layers}" if args.layers else ""))
    cache.mkdir(parents=True, exist_ok=True)
    config = scaled_config(args.scale, args.layers)
    print(f"building (once) synthetic E2B text decoder, scale {args.scale:g}, "
          f"in {cache} ...", flush=True)
    # Built in children too: a fork after torch ran its thread pool here
    # can hang in the child (OpenMP's pool is not fork-safe).
    for layout in ("qat", "regular"):
        forked(cache / f"build-{layout}.log", {}, build, cache / layout,
               config, layout)
    qat, regular = cache / "qat", cache / "regular"
    size = sum(f.stat().st_size for f in qat.glob("*.safetensors"))
    print(f"QAT checkpoint: {size / 1e9:.2f} GB", flush=True)
    os.environ["JAX_PLATFORMS"] = "cpu"
    preload()
    results = {
        "stock_regular": run("stock", regular, "auto", "bf16", cache, runs),
        "plugin_qat": run("plugin", qat, "gemma_qat", "bf16", cache, runs)}
    if not args.skip_int4:
        results["plugin_int4"] = run("int4", qat, "gemma_qat", "int4", cache,
                                     runs)
    if args.before:
        results["plugin_qat_before"] = run("plugin-before", qat, "gemma_qat",
                                           "bf16", cache, per_module=True)
        if not args.skip_int4:
            results["plugin_int4_before"] = run("int4-before", qat,
                                                "gemma_qat", "int4", cache,
                                                per_module=True)
    if not args.skip_int4:
        results["overrides"] = overrides_cost(qat)
    s, p = results["stock_regular"], results["plugin_qat"]
    print()
    print(f"load wall time, min / median / max of {runs} (compiles, distinct):")
    for key, r in results.items():
        if "wall_s_min" in r:
            print(f"  {key:<20} {spread(r)} ({r['compiles']}, "
                  f"{r['distinct_compiles']})")
    print(f"plugin / stock load time:         {ratios(p, s)} "
          "(min / median / max; goal <= 1.05)")
    for label, r in (("plugin", p), ("stock ", s)):
        print(f"{label} peak anon RSS / param bytes: "
              f"{r['peak_anon_bytes'] / r['param_bytes']:.3f} (goal <= 1.25; "
              f"peak RSS incl. mmapped shards "
              f"{r['peak_rss_bytes'] / r['param_bytes']:.3f})")
    if "plugin_int4" in results:
        i = results["plugin_int4"]
        print(f"int4 / plugin bf16 param bytes:   "
              f"{i['param_bytes'] / p['param_bytes']:.3f}")
        print(f"int4 / plugin bf16 load time:     {ratios(i, p)}"
              " (min / median / max; goal <= 1.3)")
        print(f"int4 peak anon RSS / param bytes: "
              f"{i['peak_anon_bytes'] / i['param_bytes']:.3f}")
        o = results["overrides"]
        print(f"int4-overrides / read linears:    "
              f"{o['overrides_s'] / o['read_s']:.2f} (goal <= 2)")
    for key in ("plugin_qat", "plugin_int4"):
        if key + "_before" in results:
            b, a = results[key + "_before"], results[key]
            print(f"{key} before -> after: {b['wall_s']:.1f} -> "
                  f"{a['wall_s_median']:.1f} s (median), {b['compiles']} -> "
                  f"{a['compiles']} compiles, peak anon "
                  f"{b['peak_anon_bytes'] / 2**30:.2f} -> "
                  f"{max(r['peak_anon_bytes'] for r in a['runs']) / 2**30:.2f}"
                  " GiB (highest run)")
    (cache / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
