"""`vllm-gemma-qat compile` compiles what `vllm serve` compiles: a CPU-mode
server with tpu-inference's precompile on (SKIP_JAX_PRECOMPILE=0) logs
every program its runner compiles at start-up (`Precompile NAME -->
{signature}`), and `compile` for the same flags, on a TPU topology with
the same memory per chip, must list the same programs, the same number of
times each; size the same KV cache (pages); and count the weights the
loaded server holds (int4 at half a byte a value).

Three flag sets: a text-only int4 checkpoint with two token buckets and
two request buckets; a multimodal one with an audio tower (its image
programs, and the audio tower's for every frame bucket); and a
multimodal one with the Gemma 4 assistant (speculative decoding, async
scheduling)."""
import ast
import json
import re
from collections import Counter

import pytest

from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny, tiny_mm

# CPU mode's default "HBM" (VLLM_GEMMA_QAT_CPU_MEMORY_GIB)
CPU_MEMORY_GIB = 0.1

CASES = {
    # flags beyond CpuServer's (--dtype float32 --max-model-len 256
    # --max-num-seqs 8); step_tokens: CpuServer's MIN_TOKEN_BUCKET (None:
    # tpu-inference's buckets)
    "text-int4": dict(flags=["--max-num-seqs", "16",
                             "--max-num-batched-tokens", "32"],
                      step_tokens=None, max_num_seqs=16,
                      max_num_batched_tokens=32),
    "multimodal": dict(flags=[], step_tokens=32, max_num_seqs=8,
                       max_num_batched_tokens=32),
    "assistant": dict(flags=[], step_tokens=32, max_num_seqs=8,
                      max_num_batched_tokens=32, k=2),
}


@pytest.fixture(scope="module", params=[
    pytest.param(c, marks=pytest.mark.xdist_group(f"precompile-{c}"))
    for c in CASES])
def served(request, tmp_path_factory):
    case = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = root / "model"
    flags = list(case["flags"])
    if request.param == "text-int4":
        tiny.save_servable_int4(model, "w4a16", "e4b", multimodal=False,
                                bare=True)
    elif request.param == "multimodal":
        tiny_mm.save_servable_mm(model, "e2b", audio=True)
    else:
        tiny.save_servable(model, "e2b")
    assistant = None
    if "k" in case:
        import torch

        from vllm_gemma_qat.testing import assistant as assistants
        assistant = assistants.save(assistants.build(
            assistants.target_text_config(model)), root / "assistant",
            torch.bfloat16)
        flags += ["--speculative-config", json.dumps(
            {"model": str(assistant), "num_speculative_tokens": case["k"]})]
    with CpuServer(model, *flags, log=root / "server.log",
                   step_tokens=case["step_tokens"],
                   env={"SKIP_JAX_PRECOMPILE": "0"}) as server:
        yield request.param, case, server, model, assistant


def precompiled(log: str) -> Counter:
    """(name, signature) of each `Precompile` line of the runner."""
    return Counter(
        (name, repr(sorted(ast.literal_eval(signature).items())))
        for name, signature in re.findall(
            r"\[compilation_manager\.py:\d+\] Precompile (.+?) --> "
            r"(\{.*\})$", log, re.MULTILINE))


def test_compile_lists_what_the_runner_precompiles(served, monkeypatch):
    from vllm_gemma_qat.aot.compile import compile_model
    name, case, server, model, assistant = served
    if case["step_tokens"]:  # the server's token buckets (CpuServer's)
        monkeypatch.setenv("MIN_TOKEN_BUCKET", str(case["step_tokens"]))
    report = compile_model(
        str(model), "v6e-1", weights="int4" if "int4" in name else "bf16",
        dtype="float32", max_model_len=256,
        max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        hbm_gib=CPU_MEMORY_GIB, assistant=assistant and str(assistant),
        num_speculative_tokens=case.get("k"))
    log = server.log.read_text()
    runner = precompiled(log)
    assert len(runner) > 5, log[-3000:]
    if name == "multimodal":
        from vllm_gemma_qat.fixes.audio import FRAME_BUCKETS
        assert sorted(ast.literal_eval(shape)[0][1] for program, shape in
                      runner if program == "audio_encoder") == sorted(
                          FRAME_BUCKETS)
    compiled = Counter((p.name, repr(sorted(p.shape.items())))
                       for p in report.programs)
    assert compiled == runner
    assert all(p.ok for p in report.programs)
    # per chip: plan's weights (the language model's exactly), the step's
    # arguments those parameters as laid out in HBM, plan's KV pages
    assert not report.disagreements
    assert report.lm_weight_bytes == report.plan_lm_weight_bytes > 0
    assert report.step_weight_bytes == report.lm_laid_out_bytes
    assert report.num_blocks == report.plan_num_blocks

    # The KV cache the engine sized: the same pages.
    served_pages = int(re.search(r"kv_cache_config\.num_blocks=(\d+)",
                                 log)[1])
    assert report.num_blocks == served_pages

    # The weights: what the loaded server holds (int4 at half a byte).
    held = int(re.search(r"gemma_qat: model weights by dtype: .* \((\d+) "
                         r"bytes\)", log)[1])
    assert report.weight_bytes - report.assistant_weight_bytes == held
