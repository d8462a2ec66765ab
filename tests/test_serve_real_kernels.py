"""`vllm serve --load-format gemma_qat` in CPU mode with the real TPU
kernels: VLLM_GEMMA_QAT_CPU_KERNELS=interpret runs tpu-inference's ragged
paged attention v3 in Pallas TPU interpret mode for every layer of every
step (the tiny E2B-like bf16 QAT checkpoint: 10 layers, 5 of them
KV-shared, with an audio tower). Greedy tokens equal transformers, for
text and for an audio chat; a rerun hits the prefix cache, the shared
layers' calls leave the cache to their source layers.

An fp32 server with an fp8_e5m2 cache: prompt logprobs within the derived
bound of transformers with K/V rounded as tpu-inference stores them.

The int4 (w4a16) server, the real gmm_v2 too, takes ~4 minutes of one
worker: opt-in with VLLM_GEMMA_QAT_FULL_KERNEL_TESTS=1."""
import os
import re
import time

import numpy as np
import pytest
from harness import (complete, fp8_flip_allowance, hf_greedy,
                     hf_token_logprobs)

from vllm_gemma_qat.cpu import CPU_KERNELS_ENV
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny

pytestmark = pytest.mark.xdist_group("serve_real_kernels")
FULL_ENV = "VLLM_GEMMA_QAT_FULL_KERNEL_TESTS"


def serve(root, hf_model_dir, *extra):
    # A small cache: the interpreted kernel copies the whole KV cache of
    # its layer in and out of its callback on every call.
    return CpuServer(hf_model_dir, "--num-gpu-blocks-override", "64", *extra,
                     log=root / "server.log",
                     env={CPU_KERNELS_ENV: "interpret"})


def interpreted_compiles(log: str) -> list[str]:
    return re.findall(r"vllm-gemma-qat interpret: compiled (\w+) (.*) in ",
                      log)


def check_serving(server, hf, model, n=8):
    """Greedy equals transformers; the same prompt again: prefix-cache
    hits, same tokens. Returns the seconds of each request."""
    prompt = "You are a careful agent. " * 2 + "Task one."  # 3 full blocks
    seconds = []
    before = server.metrics().get("vllm:prefix_cache_hits_total", 0)
    for _ in range(2):
        start = time.monotonic()
        prompt_ids, tokens = complete(server, model, prompt, n=n)
        seconds.append(time.monotonic() - start)
        assert tokens == hf_greedy(hf, prompt_ids, n)
    hits = server.metrics()["vllm:prefix_cache_hits_total"] - before
    assert hits >= 32, hits
    return seconds


def serve_and_check(tmp_path, hf, label: str, also=None) -> str:
    """Serve tmp_path/model with the real kernels, `check_serving` it (and
    `also(server)`), print the timings; the server's log."""
    start = time.monotonic()
    with serve(tmp_path, tmp_path / "model") as server:
        up = time.monotonic() - start
        seconds = check_serving(server, hf, tmp_path / "model")
        if also:
            also(server)
        log = server.log.read_text()
    print(f"{label}: up in {up:.0f} s, requests "
          f"{', '.join(f'{s:.1f}' for s in seconds)} s")
    return log


def test_bf16_qat_serves_with_the_real_attention_kernel(tmp_path):
    # With an audio tower and its processor: an audio chat's steps (the
    # tower's embeddings merged, then the real kernel) answer as
    # transformers does too. The tower itself is XLA only (no Pallas).
    from test_serve_audio import assert_audio_answer_equals_transformers
    from transformers import AutoProcessor

    from vllm_gemma_qat.testing import tiny_mm
    hf = tiny_mm.save_servable_mm(tmp_path / "model", audio=True)
    processor = AutoProcessor.from_pretrained(tmp_path / "model")

    def audio_chat(server):
        assert_audio_answer_equals_transformers(
            (server, hf, processor, tmp_path / "model"),
            tiny_mm.speech_like(1, 2.0))

    log = serve_and_check(tmp_path, hf, "bf16 QAT, real RPA", audio_chat)
    assert "VLLM_GEMMA_QAT_CPU_KERNELS=interpret" in log
    assert "run here by the Pallas TPU interpreter" in log
    compiles = interpreted_compiles(log)
    print(*(" ".join(c) for c in compiles), sep="\n")
    # Every attention call went to the real kernel, each shape compiled
    # once in the engine process: KV-shared layers (update_kv_cache=False,
    # their own call shapes) and the others.
    assert compiles and all(name == "ragged_paged_attention"
                            for name, _ in compiles), compiles
    flags = [f for _, f in compiles]
    assert len(flags) == len(set(flags)), flags
    assert any("update_kv_cache=False" in f for f in flags), flags
    assert any("update_kv_cache=True" in f for f in flags), flags


@pytest.mark.skipif(os.environ.get(FULL_ENV) != "1",
                    reason=f"~4 min: {FULL_ENV}=1")
def test_w4a16_serves_with_the_real_attention_and_int4_kernels(tmp_path):
    hf = tiny.save_servable_int4(tmp_path / "model", "w4a16")
    log = serve_and_check(tmp_path, hf, "w4a16, real RPA + gmm_v2")
    compiles = interpreted_compiles(log)
    print(*(" ".join(c) for c in compiles), sep="\n")
    names = {name for name, _ in compiles}
    assert names == {"ragged_paged_attention", "gmm_v2"}, names


def test_fp8_cache_with_the_real_attention_kernel(tmp_path):
    """The real RPA on an fp8_e5m2 cache under sliding-window KV (window 8,
    two sliding layers per 256-wide row, a 96-token prompt prefilled in
    32-token steps: each step's kernel call starts at its window's page and
    masks what lies before the window there): every prompt logprob within
    1e-4, plus what K/V elements within fp32 error of an fp8 midpoint can
    move, of transformers with K/V so rounded (test_serve_agent's bound)."""
    # Text-only: tpu-inference serves no prompt logprobs for a multimodal
    # model (a 400 under gemma_qat: fixes/request_checks.py).
    hf = tiny.save_servable(tmp_path / "model", multimodal=False)
    ids = [int(i) for i in np.random.RandomState(5).randint(6, 262, 96)]
    with serve(tmp_path, tmp_path / "model", "--kv-cache-dtype",
               "fp8_e5m2") as server:
        r = server.post("/v1/completions", {
            "model": str(tmp_path / "model"), "prompt": ids, "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 0})
        log = server.log.read_text()
    assert "regular_attn_dtype=float8_e5m2" in log
    assert "sliding-window KV (#3220)" in log
    assert interpreted_compiles(log)
    rows = r["choices"][0]["prompt_logprobs"][1:]
    served = np.array([row[str(t)]["logprob"] for row, t in zip(rows, ids[1:])])
    want = hf_token_logprobs(hf, ids, "float8_e5m2")
    allowance, flips = fp8_flip_allowance(hf, ids, "float8_e5m2")
    gap = np.abs(served - want)
    print(f"fp8_e5m2, real RPA: max |served - transformers, same rounding| "
          f"{gap.max():.3g}; bound 1e-4 + {flips} flips, at most "
          f"{np.max(allowance):.3g}")
    assert (gap <= 1e-4 + allowance).all(), gap.max()
    # Exact K/V (no fp8 rounding) would be past the bound: the check sees
    # the rounding.
    exact = np.abs(hf_token_logprobs(hf, ids) - want)
    print(f"... exact K/V: past the bound at {(exact > 1e-4 + allowance).sum()}"
          f" of {exact.size} positions")
    assert (exact > 1e-4 + allowance).any()
