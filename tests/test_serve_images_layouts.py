"""Images and audio through `vllm serve --load-format gemma_qat` on the
other forms a user serves: the regular layout (unused shared-layer K/V
shipped) under tensor parallelism (the vision tower's heads split over 2
devices, the audio tower whole on each), and the w4a16 int4 export (its
audio tower stored as bf16, as the real export's). Answers equal
transformers on the same processor."""
import pytest

from test_serve_audio import assert_audio_answer_equals_transformers
from test_serve_images import (IMAGE_ARGS, STEP_TOKENS, hf_reference,
                               image_chat)
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny_mm

pytestmark = pytest.mark.xdist_group("serve_images_layouts")
CASES = [("regular", None, 2), ("qat", "w4a16", 1)]


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: f"{c[0]}-{c[1] or 'bf16'}-tp{c[2]}")
def served(request, tmp_path_factory):
    from transformers import AutoProcessor
    layout, form, tp = request.param
    root = tmp_path_factory.mktemp(f"images-{layout}-{form}-tp{tp}")
    hf = tiny_mm.save_servable_mm(root / "model", form=form, layout=layout,
                                  audio=True)
    processor = AutoProcessor.from_pretrained(root / "model")
    with CpuServer(root / "model", *IMAGE_ARGS, "--tensor-parallel-size",
                   str(tp), log=root / "server.log", devices=tp,
                   step_tokens=STEP_TOKENS) as server:
        yield server, hf, processor, root / "model"


def test_image_answers_equal_transformers(served):
    server, hf, processor, model = served
    for seed in (1, 2):
        r = image_chat(server, model, tiny_mm.png_data_uri(seed))
        prompt_ids, tokens = hf_reference(hf, processor, seed)
        assert r["prompt_token_ids"] == prompt_ids
        assert r["choices"][0]["token_ids"] == tokens


def test_audio_answers_equal_transformers(served):
    assert_audio_answer_equals_transformers(served, tiny_mm.speech_like(1, 2.0))
