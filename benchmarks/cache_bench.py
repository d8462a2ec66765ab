"""What JAX's persistent compilation cache does for a gemma_qat weight load.

The tiny int4 (w4a16) export, loaded by tpu-inference's `get_model` under
gemma_qat (`vllm_gemma_qat.testing.runner.load`), each load in a fresh
process: with the plugin's one cache clear per load, and with tpu-inference
0.32's clear after every module put back (VLLM_GEMMA_QAT_CLEAR_CACHES_PER_
MODULE=1, stock behaviour); each without a persistent cache, with an empty
one (cold: it is filled) and with that one again (warm). The cache keeps
every compilation (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0; vLLM's
default threshold of 1 s keeps none of these small programs). Wall seconds
of the load alone (imports excluded), measured side by side in one run.

    ./run python benchmarks/cache_bench.py [--runs N] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LOAD = """
import time, sys
from vllm.plugins import load_general_plugins
from vllm_gemma_qat.testing import runner
load_general_plugins()  # the plugin, as vLLM loads it
started = time.perf_counter()
runner.load(sys.argv[1], "gemma_qat")
print("LOAD_S", time.perf_counter() - started)
"""


def load_seconds(model: Path, env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", LOAD, str(model)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"load failed:\n{out.stderr[-3000:]}")
    (line, ) = [x for x in out.stdout.splitlines() if x.startswith("LOAD_S")]
    return float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from vllm_gemma_qat.fixes.compile_once import PER_MODULE_ENV
    from vllm_gemma_qat.testing import tiny

    rows = []
    with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp:
        model = Path(tmp) / "model"
        tiny.save_servable_int4(model, "w4a16", "e2b", multimodal=False)
        for clears in ("once per load", "per module"):
            base = dict(os.environ)
            base.pop("JAX_COMPILATION_CACHE_DIR", None)
            base.pop(PER_MODULE_ENV, None)
            if clears == "per module":
                base[PER_MODULE_ENV] = "1"
            cache = Path(tmp) / f"cache-{len(rows)}"
            cached = dict(base, JAX_COMPILATION_CACHE_DIR=str(cache),
                          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            times = {"no cache": [], "cold": [], "warm": []}
            for _ in range(args.runs):
                times["no cache"].append(load_seconds(model, base))
                if cache.exists():
                    subprocess.run(["rm", "-rf", str(cache)], check=True)
                times["cold"].append(load_seconds(model, cached))
                times["warm"].append(load_seconds(model, cached))
            row = {"clears": clears,
                   **{k: statistics.median(v) for k, v in times.items()},
                   "runs": args.runs}
            rows.append(row)
            print(f"clears {clears:<14} no cache {row['no cache']:6.1f} s  "
                  f"cold {row['cold']:6.1f} s  warm {row['warm']:6.1f} s",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
