"""Exact int4 through `vllm serve --load-format gemma_qat` (CPU mode: the
pure-JAX attention and int4 matmul stand in for the TPU kernels): both QAT
int4 exports, greedy tokens equal transformers on the exact dequantized
weights, with batching, prefix caching and guided decoding on top."""
import concurrent.futures
import json
import re

import pytest

from harness import complete, guided_tool_call, hf_greedy
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
    prompts = [f"agent {i}: " + "b" * (2 + 5 * i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: complete(server, model, p, n=12),
                                prompts))
    for prompt_ids, tokens in results:
        assert tokens == hf_greedy(hf, prompt_ids, 12)

    # Prefix caching: hits, and the same answer.
    prefix = "You are a careful agent. " * 4
    before = server.metrics().get("vllm:prefix_cache_hits_total", 0)
    first = complete(server, model, prefix + "Task two.")
    second = complete(server, model, prefix + "Task two.")
    assert server.metrics()["vllm:prefix_cache_hits_total"] - before >= 64
    assert first == second

    # Guided decoding: json_schema output validates.
    assert guided_tool_call(server, model)["tool"] in ("search", "read")
