import os
import shutil
import sys
import tempfile

from vllm_gemma_qat.cpu.env import (compile_cache_env, machine_compile_cache,
                                    set_defaults)

set_defaults(os.environ)  # before anything imports JAX / tpu_inference
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from vllm_gemma_qat.cpu.server import TIMINGS_ENV  # noqa: E402


def _on_tpu() -> bool:
    return os.environ.get("JAX_PLATFORMS", "") not in ("cpu", "")


def pytest_configure(config):
    # Servers forked from a process that has imported `vllm serve`
    # (cpu/zygote.py): ~33 s of imports saved per server.
    from vllm_gemma_qat.cpu import server
    server.FORK_FROM_ZYGOTE = True
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A controller stopped by a signal (a timeout, Ctrl-C) takes its
        # workers with it, and they their servers (cpu/server.py).
        from vllm_gemma_qat.cpu.lifetime import die_with_parent
        die_with_parent()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _import_tpu_inference()
        return  # the workers inherit what the main process set below
    # One compilation cache for the run and the runs after it on this
    # machine (cpu/env.py: machine_compile_cache), set by the main process
    # before the workers and servers start.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        from vllm_gemma_qat.testing import model_cache
        os.environ.update(compile_cache_env(str(
            machine_compile_cache(model_cache.root()))))
    # Where servers and trainings say how long they took (the summary).
    config._run_dir = tempfile.mkdtemp(prefix="vllm-gemma-qat-run-")
    os.environ.setdefault(TIMINGS_ENV, os.path.join(config._run_dir,
                                                    "timings.jsonl"))
    config._timings = os.environ[TIMINGS_ENV]

    if not config.getoption("numprocesses", None):
        _import_tpu_inference()  # no workers: this process runs the tests


def _import_tpu_inference():
    """tpu-inference's import prepends a flag to XLA_FLAGS, by which JAX
    keys its compilation cache: imported before any test in a process that
    runs tests, a program is cached under one key whichever test compiles
    it first (a server gets the flag once either way: cpu/zygote.py)."""
    import tpu_inference  # noqa: F401


def pytest_terminal_summary(terminalreporter, config):
    """Where the run's time went, summed over workers: server start-up
    (`vllm serve` to /health), server shutdown, training (model_cache
    builds), and the rest (requests, references, in-process tests)."""
    path = getattr(config, "_timings", None)
    if not path or not os.path.exists(path):
        return
    import json
    spent = {}
    for line in open(path):
        row = json.loads(line)
        count, seconds = spent.get(row["kind"], (0, 0.0))
        spent[row["kind"]] = (count + 1, seconds + row["seconds"])
    total = sum(r.duration for reports in terminalreporter.stats.values()
                for r in reports if getattr(r, "when", None) in (
                    "setup", "call", "teardown"))
    write = terminalreporter.write_line
    write(f"time summed over workers: {total:.0f} s")
    for kind, (count, seconds) in sorted(spent.items()):
        write(f"  {kind}: {count} x, {seconds:.0f} s")
    write(f"  the rest: {total - sum(s for _, s in spent.values()):.0f} s")


def pytest_unconfigure(config):
    if getattr(config, "_run_dir", None):
        shutil.rmtree(config._run_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if _on_tpu():
        return
    skip = pytest.mark.skip(reason="needs a real TPU")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def xdist_groups_hold(request):
    """Under `--dist loadgroup` pytest-xdist marks a grouped test by adding
    `@group` to its node id; where that no longer takes (pytest >= 9.2,
    pytest-xdist#1386) groups are spread silently and every expensive module
    fixture (a `vllm serve`) is built on each worker. Fail first instead."""
    if not getattr(request.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in request.session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        pytest.fail(f"--dist loadgroup ignores xdist_group marks under pytest "
                    f"{pytest.__version__} (pytest-xdist#1386), e.g. {lost[0]}; "
                    f"use the pytest pinned in .ci/requirements.txt")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The transformers references are tiny models; a second intra-op thread
    only spins at torch's barriers while the servers hold both cores (one
    multichip test's own CPU on 2 busy cores: 14 s with two threads, 6 s
    with one)."""
    import torch
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def plugin():
    """The plugin as vLLM loads it: through its entry point."""
    from vllm.plugins import load_general_plugins
    load_general_plugins()


class Tiny:
    """Tiny transformers models and their checkpoints, built once a session."""

    def __init__(self, root):
        self.root = root
        self.models = {}

    def model(self, geometry, multimodal):
        from vllm_gemma_qat.testing import tiny
        key = (geometry, multimodal)
        if key not in self.models:
            self.models[key] = tiny.build_model(geometry, multimodal)
        return self.models[key]

    def checkpoint(self, geometry="e2b", multimodal=True, layout="qat"):
        from vllm_gemma_qat.testing import tiny
        path = self.root / f"{geometry}-{'mm' if multimodal else 'text'}-{layout}"
        if not path.exists():
            tiny.save_checkpoint(self.model(geometry, multimodal), path, layout)
        return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    return Tiny(tmp_path_factory.mktemp("tiny"))
