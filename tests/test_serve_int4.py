"""Exact int4 through `vllm serve --load-format gemma_qat` (CPU mode: the
pure-JAX attention and int4 matmul stand in for the TPU kernels): both QAT
int4 exports, greedy tokens equal transformers on the exact dequantized
weights, with batching, prefix caching and guided decoding on top."""
import json
import re

import pytest

from harness import (assert_concurrent_greedy_equal, guided_tool_call,
                     prefix_cache_rerun)
from vllm_gemma_qat import quantization
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny


@pytest.fixture(scope="module", params=["w4a16", "q4_0"])
def served(request, tmp_path_factory):
    form = request.param
    root = tmp_path_factory.mktemp(f"serve-{form}")
    hf = tiny.save_servable_int4(root / "model", form)
    extra = []
    if form == "q4_0":
        extra = ["--hf-overrides", json.dumps({
            "quantization_config": quantization.w4a16_quantization_config()})]
    with CpuServer(root / "model", *extra, "--structured-outputs-config",
                   '{"backend": "xgrammar", "disable_any_whitespace": true}',
                   log=root / "server.log") as server:
        yield server, hf, root / "model", form


def test_int4_serves_exactly(served):
    server, hf, model, form = served
    log = server.log.read_text()
    # The load log shows the int4 bytes.
    assert re.search(r"gemma_qat: model weights by dtype: .*int4 \d+\.\d MiB",
                     log), log[-3000:]
    if form == "q4_0":
        assert "q4_0 bf16 linears recovered exactly" in log

    # 8 concurrent greedy completions, each equal to transformers.
    assert_concurrent_greedy_equal(
        server, model, hf, [f"agent {i}: " + "b" * (2 + 5 * i)
                            for i in range(8)], n=12)

    # Prefix caching: hits, and the same answer.
    hits, first, second = prefix_cache_rerun(
        server, model, "You are a careful agent. " * 4 + "Task two.")
    assert hits >= 64 and first == second

    # Guided decoding: json_schema output validates.
    assert guided_tool_call(server, model)["tool"] in ("search", "read")
