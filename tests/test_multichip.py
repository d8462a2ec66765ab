"""`vllm serve --tensor-parallel-size N` in CPU mode on N host devices: vLLM's
engine and tpu-inference's runner shard the model and the KV cache as on a
v6e-N slice (tpu-inference's own sharded attention, KV heads < TP included:
E2B has 1 KV head), with only the per-device kernels substituted."""
import json
import re
import shutil
import subprocess

import pytest

from harness import (assert_concurrent_greedy_equal, hf_greedy,
                     prefix_cache_rerun)
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny

CLI = shutil.which("vllm-gemma-qat")
# "qat": the QAT export (tiny.save_servable writes its bf16-grid values in
# fp32), served in float32 (CpuServer's --dtype: greedy tokens are compared
# with transformers in fp32); "w4a16": the int4 export.
CASES = [(geometry, tp, form) for geometry in ("e2b", "e4b") for tp in (2, 4)
         for form in ("qat", "w4a16")]


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: "-".join(map(str, c)))
def served(request, tmp_path_factory):
    geometry, tp, form = request.param
    root = tmp_path_factory.mktemp(f"tp{tp}-{geometry}-{form}")
    if form == "qat":
        hf = tiny.save_servable(root / "model", geometry)
    else:
        hf = tiny.save_servable_int4(root / "model", form, geometry)
    with CpuServer(root / "model", "--tensor-parallel-size", str(tp),
                   log=root / "server.log", devices=tp) as server:
        yield server, hf, root / "model", tp, form


def test_sharded_serving_equals_transformers(served):
    server, hf, model, tp, form = served
    log = server.log.read_text()
    # Sharding is real: every split weight holds 1/TP of its bytes on a
    # device; KV-shared layers own no K/V parameters (on any device).
    split = re.search(r"gemma_qat: language-model weights on (\d+) devices: "
                      r"split (\d+) bytes, (\d+) per device; replicated "
                      r"(\d+) bytes", log)
    assert split, log[-3000:]
    devices, total, per_device, whole = map(int, split.groups())
    assert devices == tp and total > 0 and total == per_device * tp
    if form == "qat":  # `plan --tp` predicts what each chip holds
        out = subprocess.run([CLI, "plan", model, "--tp", str(tp), "--context",
                              "256", "--json"], capture_output=True, text=True,
                             check=True)
        planned = json.loads(out.stdout)
        towers = planned["weight_bytes"] - total - whole
        assert planned["weight_bytes_per_chip"] == per_device + whole + towers
    assert re.search(r"KV-shared layers \d+-\d+ own 0 K/V parameters", log)
    if form == "w4a16":
        assert re.search(r"model weights by dtype: .*int4 \d+\.\d MiB", log)

    # 8 concurrent greedy completions, each equal to transformers.
    assert_concurrent_greedy_equal(
        server, model, hf, [f"agent {i}: " + "c" * (3 + 4 * i)
                            for i in range(8)])

    # Prefix caching over the sharded cache: hits, and the same answer.
    hits, first, second = prefix_cache_rerun(
        server, model, "A shared system prompt for every agent. " * 3 + "Go.")
    assert hits >= 32 and first == second
    assert first[1] == hf_greedy(hf, first[0], 8)


def test_data_parallel_two_engines(tmp_path):
    # tpu-inference 0.32 runs `vllm serve --data-parallel-size N` as N
    # engine processes (vLLM's multi-process DP), each with its own model
    # and KV cache: the way to more agents for E2B, whose one KV head every
    # tensor-parallel chip holds whole.
    hf = tiny.save_servable(tmp_path / "model", "e2b")
    with CpuServer(tmp_path / "model", "--data-parallel-size", "2",
                   log=tmp_path / "server.log", devices=2) as server:
        assert_concurrent_greedy_equal(
            server, tmp_path / "model", hf,
            [f"replica {i}: " + "d" * (2 + 3 * i) for i in range(8)])
        # Each replica answered some of them ...
        success = per_engine(server, "vllm:request_success_total")
        assert len(success) == 2 and all(n > 0 for n in success.values()), \
            success
        # ... and each keeps its own prefix cache: one prompt sent 8 at once,
        # twice, is answered the same everywhere and hits on both.
        prompt = "A shared system prompt for every replica. " * 3 + "Go."
        assert_concurrent_greedy_equal(server, tmp_path / "model", hf,
                                       [prompt] * 8)
        assert_concurrent_greedy_equal(server, tmp_path / "model", hf,
                                       [prompt] * 8)
        hits = per_engine(server, "vllm:prefix_cache_hits_total")
        assert len(hits) == 2 and all(n >= 32 for n in hits.values()), hits
    log = server.log.read_text()
    for rank in (0, 1):
        assert re.search(rf"EngineCore_DP{rank} .*gemma_qat: loaded", log)


def per_engine(server, name) -> dict[str, float]:
    """A counter of the server's /metrics by its `engine` label (one per
    data-parallel replica)."""
    import urllib.request
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line)[1]
            out[engine] = out.get(engine, 0.0) + float(line.rpartition(" ")[2])
    return out
