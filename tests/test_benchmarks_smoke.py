"""The benchmarks run end to end in their smallest mode and write their
outputs (timings are not asserted: these machines are noisy). The serving
and compile benchmarks run in this process, as `python benchmarks/X.py`
would run them (runpy): the serving benchmark's server forks from the
suite's server zygote (conftest.py), and neither imports vLLM again."""
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(name: str, *args, monkeypatch) -> None:
    """`python benchmarks/NAME ARGS` in this process; fails on a non-zero
    exit."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / name),
                                      *map(str, args)])
    environ = dict(os.environ)  # what a benchmark sets stays with it
    try:
        runpy.run_path(str(ROOT / "benchmarks" / name), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), f"{name} exited with {e.code}"
    finally:
        os.environ.clear()
        os.environ.update(environ)


def test_load_bench_smallest_scale(tmp_path):
    out = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "load_bench.py", "--scale",
         "0.02", "--layers", "10", "--cache", tmp_path], capture_output=True,
        text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "plugin / stock load time:" in out.stdout
    results = json.loads((tmp_path / "e2b-scale0.02-layers10" /
                          "results.json").read_text())
    assert set(results) == {"stock_regular", "plugin_qat", "plugin_int4",
                            "overrides"}
    assert results["plugin_qat"]["peak_anon_bytes"] > 0
    # Exact int4 holds fewer parameter bytes than the bf16 load.
    assert (results["plugin_int4"]["param_bytes_by_dtype"].get("int4", 0) > 0)
    assert results["plugin_int4"]["param_bytes"] < results["plugin_qat"]["param_bytes"]


def test_serve_bench_smoke(tmp_path, monkeypatch):
    run_benchmark("serve_bench.py", "--smoke", "--kv-cache-dtype", "fp8",
                  "--out", tmp_path, monkeypatch=monkeypatch)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["kv_cache_dtype"] == "fp8"  # as the server reports it
    assert [r["concurrency"] for r in results["sweep"]] == [1, 2]
    agents = results["agents"]
    assert agents["calls"] == 4
    # Each agent's first task is one the tiny agent model was trained to
    # answer with a tool call; the parser must have assembled it. What it
    # says after the result of add (a turn it was not trained on) is the
    # model's own: it may be a call with invalid arguments.
    valid = round(agents["tool_calls"] * agents["tool_call_valid_rate"])
    assert agents["tool_calls"] >= 2 and valid >= 2, agents
    assert 0 < agents["prefix_cache_hit_rate"] <= 1
    assert (tmp_path / "results.md").read_text().startswith("# Serving")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compile_bench_smoke(tmp_path, monkeypatch):
    # Deviceless AOT for a TPU (libtpu), on the tiny E2B-like config.
    run_benchmark("compile_bench.py", "--smoke", "--out", tmp_path,
                  monkeypatch=monkeypatch)
    results = json.loads((tmp_path / "results.json").read_text())
    [config] = results["configs"]
    assert (config["model"], config["topology"], config["variant"]) == (
        "e2b", "v6e-1", "int4")
    report = config["report"]
    assert report["all_compiled"], report["programs"]
    assert [(p["name"], p["shape"]) for p in report["programs"]] == [
        ("worker0 backbone", {"num_tokens": 16, "num_reqs": 8})]
    assert report["programs"][0]["est_seconds"] > 0
    assert report["weight_bytes"] > 0 and report["kv_bytes"] > 0
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# Compiled for a TPU without one")
    assert "| e2b | v6e-1 (TP=1) | int4 |" in md
    # The process's own compiles use JAX's persistent cache again (AOT mode
    # turns it off; JAX decides once per process, at its first compile: a
    # later test here compiled everything again, 14 -> 56 s).
    import secrets

    import jax
    import jax.numpy as jnp
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    before = set(cache.iterdir())
    constant = secrets.randbelow(10**9)  # a program no run compiled before
    jax.jit(lambda x: x * constant)(jnp.ones(3))
    assert set(cache.iterdir()) - before
