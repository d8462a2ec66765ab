"""benchmarks/tpu_kernels.py, the one-command TPU measurement (#42), as far
as a machine without a TPU can take it: its bundle runs in an interpreter
that has only jax and libtpu and compiles every kind of program it times
for a v5e (libtpu, deviceless); the checks it runs on a TPU before timing
accept a right answer and refuse a wrong one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tpu_kernels  # noqa: E402

# What `pip install jax[tpu]` puts on a TPU VM, and nothing else.
BARE_TPU_VM = ("jax", "jaxlib", "numpy", "numpy.libs", "ml_dtypes", "scipy",
               "scipy.libs", "opt_einsum", "libtpu")


def _bare_site(tmp_path) -> Path:
    import jax
    site_packages = Path(jax.__file__).parents[1]
    site = tmp_path / "site"
    site.mkdir()
    for entry in site_packages.iterdir():
        name = entry.name.split("-")[0] if entry.name.endswith(
            ".dist-info") else entry.name
        if name in BARE_TPU_VM:
            (site / entry.name).symlink_to(entry)
    return site


def _bare_python(site, *args, cwd):
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"),
           "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_bundle_compiles_each_kind_of_program_with_only_jax_and_libtpu(
        tmp_path):
    bundle = tmp_path / "tpu-kernels"
    tpu_kernels.bundle(bundle)
    site = _bare_site(tmp_path)
    # The interpreter really is bare: no tpu-inference, no tokamax.
    probe = _bare_python(site, "-c", "import tpu_inference", cwd=tmp_path)
    assert "ModuleNotFoundError" in probe.stderr, probe.stderr[-2000:]
    run = _bare_python(
        site, str(bundle / "tpu_kernels.py"), "--topology", "v5e-1",
        "--models", "e2b", "--shapes", "256x1536", "--tokens", "16",
        "--rpa-cases", "16x2048x1", "--out", str(tmp_path / "out.json"),
        cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    rows = json.loads((tmp_path / "out.json").read_text())["results"]
    kinds = {(r["kind"], r["candidate"]) for r in rows}
    assert kinds == {("linear", c) for c in (
        "bf16", "gmm_v2 tokamax", "gmm_v2 served", "xla int4 grouped",
        "xla int4 dequant")} | {("rpa", "rpa v3")}, kinds
    assert {r["shape"] for r in rows if r["kind"] == "rpa"} == {
        "sliding 1x256 16x2048", "full 1x512 16x2048"}
    for row in rows:
        assert not row.get("error") and row["code_mib"] > 0, row
    shapes = json.loads((bundle / "shapes.json").read_text())
    assert sum(shapes["e2b"]["linears"].values()) == 241  # E2B's step
    assert shapes["e2b"]["linears"]["1536x24576"] == 20  # wide gate_up


def test_the_linear_checks_accept_the_exact_product_and_refuse_a_wrong_one():
    import jax
    shapes = {"tiny": {"linears": {"64x256": 1}, "attention": {}}}
    programs = tpu_kernels.linear_programs(
        shapes, False, {"bf16", "xla int4 grouped", "xla int4 dequant"},
        (16,), dtype="float32")  # XLA:CPU has no bf16 x bf16 -> f32 dot
    assert len(programs) == 3
    for p in programs:
        out = np.asarray(jax.jit(p.fn)(*p.args), np.float32)
        assert p.check(p.args, out) is None, p.candidate
        wrong = out.copy()
        wrong[3, 100] += 0.05 * (1 + abs(wrong[3, 100]))
        assert p.check(p.args, wrong) is not None, p.candidate


@pytest.mark.parametrize("kind, cases", [
    ("sliding 2x256", [(2, 300, 1), (1, 96, 96)]),
    ("full 1x512", [(3, 130, 1)]),
])
def test_the_attention_check_agrees_with_tpu_inference_reference(kind, cases):
    """tpu-inference's own `ref_ragged_paged_attention` (jnp, runs on a CPU)
    in the kernel's place: the dense float64 check accepts its output
    (window, KV heads, the step's K/V written into the cache) and refuses
    a changed one."""
    import jax
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import \
        ref_ragged_paged_attention
    shapes = {"tiny": {"linears": {}, "attention": {kind: 1}, "q_heads": 4,
                       "sliding_window": 64}}
    programs = tpu_kernels.rpa_programs(shapes, False, None, cases,
                                        attention=ref_ragged_paged_attention)
    assert len(programs) == len(cases)
    for p in programs:
        attention, cache = p.fn(*p.args)  # the reference validates eagerly
        assert p.check(p.args, (attention, cache)) is None, p.shape
        wrong = np.asarray(attention, np.float32).copy()
        wrong[-1, 0, 5] += 0.5
        assert p.check(p.args, (wrong, cache)) is not None, p.shape
