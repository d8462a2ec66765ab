"""Which tpu-inference releases vllm-gemma-qat supports, tested (not CI).

    ./run python tests/version_matrix.py structure [--readme]
        For every tpu-inference release from 0.21.0 on, download its wheel
        (no dependencies, ~2 MB) and run the plugin's structural guard on its
        Gemma 4 source: "patch" or "refuse: <why>". Minutes.
    ./run python tests/version_matrix.py full VLLM_TPU_VERSION... [--readme]
        One venv per vllm-tpu release (built one at a time, pip's shared
        cache, kept under ~/.cache/vllm-gemma-qat/matrix/), this package
        installed into it, then: where the guard says "patch", the model-level
        tests (tests/test_core_loader.py, tests/test_bad_input.py: both
        layouts load, shared layers own no K/V, logits equal transformers,
        bad inputs named); where it says "refuse", a gemma_qat load that
        must end in the clear refusal (Gemma4Model built for gemma_qat).
        ~10 min and ~11 GB a version.

--readme writes the results table into README.md between the
`version-table` markers. Results accumulate in matrix/results.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_gemma_qat.cpu.env import CPU_ENV

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
    "vllm-gemma-qat" / "matrix"
RESULTS = CACHE / "results.json"
RELEASES = ["0.21.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.26.0",
            "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]
GEMMA4 = "tpu_inference/models/jax/gemma4.py"
# The guard fires when Gemma4Model is built for gemma_qat, before anything
# else: built here directly, so no checkpoint (whose config.json an older
# transformers may not read) is needed.
REFUSAL = """
from types import SimpleNamespace
from vllm.plugins import load_general_plugins
load_general_plugins()
import tpu_inference.models.jax.gemma4 as gemma4
from vllm_gemma_qat.fixes.kv_share import UnsupportedTpuInference
config = SimpleNamespace(load_config=SimpleNamespace(load_format="gemma_qat"))
try:
    gemma4.Gemma4Model(config, None, None)
except UnsupportedTpuInference as e:
    print("REFUSED", e)
except Exception as e:
    print("NOT REFUSED", type(e).__name__, e)
"""


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, CPU only (JAX CPU)"


def pip(*args, python=sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", *args], capture_output=True,
                          text=True)


def guard_verdict(wheel: Path) -> str:
    from vllm_gemma_qat.fixes.kv_share import unsupported_structure_in_source
    with zipfile.ZipFile(wheel) as z:
        if GEMMA4 not in z.namelist():
            return "refuse: no Gemma 4 model"
        reason = unsupported_structure_in_source(z.read(GEMMA4).decode())
    return "patch" if reason is None else f"refuse: {reason}"


def structure(results: dict) -> None:
    wheels = CACHE / "wheels"
    for version in RELEASES:
        out = pip("download", "--no-deps", "-q", f"tpu-inference=={version}",
                  "-d", str(wheels))
        wheel = next(wheels.glob(f"tpu_inference-{version}-*.whl"), None)
        if out.returncode or wheel is None:
            verdict = f"no wheel ({out.stderr.strip().splitlines()[-1:]})"
        else:
            verdict = guard_verdict(wheel)
        print(f"tpu-inference {version}: {verdict}", flush=True)
        results.setdefault(version, {})["guard"] = verdict


def full(results: dict, vllm_tpu_versions: list[str]) -> None:
    for version in vllm_tpu_versions:
        venv = CACHE / f"venv-{version}"
        python = venv / "bin" / "python"
        if not (venv / ".complete").exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)],
                           check=True)
            out = pip("install", "-q", f"vllm-tpu=={version}", "pytest",
                      "jsonschema", "chex==0.1.92", python=python)
            if out.returncode:
                print(f"vllm-tpu {version}: install failed\n{out.stderr[-2000:]}")
                continue
            (venv / ".complete").touch()
        pip("install", "-q", "--no-deps", "-e", str(ROOT), python=python)
        tpu = subprocess.run(
            [python, "-c", "import importlib.metadata as m; "
             "print(m.version('tpu-inference'))"],
            capture_output=True, text=True).stdout.strip()
        env = dict(os.environ, **CPU_ENV)
        from vllm_gemma_qat.fixes.kv_share import unsupported_structure_in_source
        source = subprocess.run(
            [python, "-c", "import importlib.util, pathlib; print(pathlib.Path("
             "importlib.util.find_spec('tpu_inference').origin).parent / "
             f"'models/jax/gemma4.py')"], capture_output=True, text=True,
            env=env).stdout.strip()
        reason = (unsupported_structure_in_source(Path(source).read_text())
                  if Path(source).is_file() else "no Gemma 4 model")
        if reason is None:
            run = subprocess.run(
                [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "tests/test_core_loader.py", "tests/test_bad_input.py"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
            tail = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
            result = ("model-level tests pass" if run.returncode == 0
                      else f"FAILED: {tail}")
        else:
            run = subprocess.run([python, "-c", REFUSAL], env=env,
                                 capture_output=True, text=True, timeout=1800)
            refused = next((line for line in run.stdout.splitlines()
                            if line.startswith("REFUSED")), None)
            result = ("refused clearly" if refused and tpu in refused
                      else "NOT refused: " + " ".join(
                          (run.stdout + run.stderr)[-300:].split()))
        print(f"vllm-tpu {version} (tpu-inference {tpu}): {result}", flush=True)
        results.setdefault(tpu, {}).update(
            full=result, vllm_tpu=version,
            date=datetime.date.today().isoformat(), machine=machine())


# The stack .ci/requirements.txt pins (vllm-tpu 0.32.0): CI runs the whole
# suite on it, so its row says so rather than "not run".
CI_TPU_INFERENCE, CI_VLLM_TPU = "0.32.0", "0.32.0"


def table(results: dict) -> str:
    rows = ["| tpu-inference | guard (from the release's gemma4.py) | tested "
            "here (vllm-tpu, date, machine) |", "| --- | --- | --- |"]
    key = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    for version in sorted(results, key=key):
        r = results[version]
        tested = (f"{r['full']} (vllm-tpu {r['vllm_tpu']}, {r['date']}, "
                  f"{r['machine']})" if "full" in r else "not run")
        if version == CI_TPU_INFERENCE and "full" not in r:
            tested = (f"the whole suite, every CI run (`.ci/run`, vllm-tpu "
                      f"{CI_VLLM_TPU})")
        rows.append(f"| {version} | {r.get('guard', '-')} | {tested} |")
    return "\n".join(rows)


def write_readme(results: dict) -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    begin, end = "<!-- version-table -->", "<!-- /version-table -->"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    readme.write_text(f"{head}{begin}\n{table(results)}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["structure", "full"])
    parser.add_argument("versions", nargs="*", help="vllm-tpu versions (full)")
    parser.add_argument("--readme", action="store_true")
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.mode == "structure":
        structure(results)
    else:
        full(results, args.versions)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.readme:
        write_readme(results)


if __name__ == "__main__":
    main()
