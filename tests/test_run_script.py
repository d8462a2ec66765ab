"""`./run` (the README's entry point for CPU users): a second clone sharing
the cached venv runs its own code, and the named subcommands exist."""
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(root, *args):
    # As a fresh shell would start it: ./run sets the CPU environment.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.run([root / "run", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_two_clones_share_the_venv_but_not_the_code(tmp_path):
    clone = tmp_path / "clone"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", ".pytest_cache"))
    code = ("import os, vllm_gemma_qat; print(vllm_gemma_qat.__file__); "
            "print(os.environ.get('JAX_PLATFORMS'))")
    for root in (clone, ROOT, clone):
        out = run(root, "python", "-c", code)
        assert out.returncode == 0, out.stderr[-2000:]
        # its own code, and the CPU environment its own cpu/env.py sets
        assert out.stdout.split() == [
            str(root / "vllm_gemma_qat" / "__init__.py"), "cpu"]
        # The CLI script and the plugin's entry points resolve there too.
        out = run(root, "python", "-c", "import importlib.metadata as m, "
                  "vllm_gemma_qat.cli as c; print(c.__file__); print(sorted("
                  "e.value for e in m.entry_points(group='vllm.general_"
                  "plugins') if 'gemma' in e.value))")
        assert out.stdout.splitlines()[0].startswith(str(root))
        assert "vllm_gemma_qat:register" in out.stdout


def test_named_subcommands():
    out = run(ROOT, "bench-load", "--help")
    assert out.returncode == 0 and "--layers" in out.stdout
    out = run(ROOT, "vllm-gemma-qat", "--help")
    assert out.returncode == 0 and "inspect" in out.stdout
