"""Speculative decoding beside image requests (#30): `vllm serve
--load-format gemma_qat --speculative-config ...` in CPU mode on the tiny
multimodal E2B-like checkpoint of test_serve_images, with a random Gemma 4
assistant built for it (untrained, so nearly every draft is rejected: what
is checked here is the image prefill and the drafter sharing engine steps,
not the drafter's quality, which test_serve_spec_decode checks with trained
assistants).

An image chat and three text requests sent at once: every answer equals
transformers' greedy decoding, and vLLM's spec-decode counters equal the
text requests' draft-and-verify loop (`assistant.reference`, transformers'
target and assistant) plus what the same image chat counted alone."""
import concurrent.futures
import copy
import json

import pytest

from harness import complete
from test_serve_images import (IMAGE_ARGS, MAX_IMAGE_PIXELS, STEP_TOKENS,
                               hf_reference, image_chat)
from test_serve_spec_decode import delta, spec_metrics
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import assistant, tiny_mm

pytestmark = pytest.mark.xdist_group("serve_spec_decode_images")

K = 2
TEXTS = ["A text request drafted beside an image.",
         "Another one, a little longer than the first.",
         "Short."]
N = 16  # tokens per text answer (EOS ignored)
IMAGE_N = 8  # the image answer's (test_serve_images' length: no image token)


class _TextView:
    """transformers' multimodal Gemma 4 seen as the text model
    `assistant.reference` drives (`.model(...)` with the shared K/V states,
    `.model.embed_tokens`, `.lm_head`): the same language model, text in."""

    def __init__(self, hf):
        self.lm_head = hf.lm_head
        self.model = _ModelView(hf.model)


class _ModelView:

    def __init__(self, model):
        self._model = model
        self.embed_tokens = model.language_model.embed_tokens

    def __call__(self, **kwargs):
        return self._model(**kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import torch
    from transformers import AutoProcessor
    root = tmp_path_factory.mktemp("spec-decode-images")
    hf = tiny_mm.save_servable_mm(root / "model")
    helper = assistant.build(assistant.target_text_config(root / "model"))
    path = assistant.save(helper, root / "assistant", dtype=torch.bfloat16)
    spec = json.dumps({"model": str(path), "num_speculative_tokens": K})
    with CpuServer(root / "model", *IMAGE_ARGS, "--speculative-config", spec,
                   log=root / "server.log", step_tokens=STEP_TOKENS,
                   env={"VLLM_MAX_IMAGE_PIXELS": str(MAX_IMAGE_PIXELS)}) \
            as server:
        yield (server, hf, AutoProcessor.from_pretrained(root / "model"),
               root / "model", helper.to(torch.float64))


def _greedy(hf, prompt_ids, n):
    import torch
    with torch.no_grad():  # the requests ignore EOS
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n,
                          do_sample=False, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def test_image_and_text_requests_with_the_drafter(served):
    server, hf, processor, model, helper = served
    image_ids, image_tokens = hf_reference(hf, processor, 1, n=IMAGE_N)

    def ask_image():
        r = image_chat(server, model, tiny_mm.png_data_uri(1), n=IMAGE_N)
        assert r["prompt_token_ids"] == image_ids
        return r["choices"][0]["token_ids"]

    before = spec_metrics(server)
    assert ask_image() == image_tokens
    alone = delta(spec_metrics(server), before)
    assert alone["drafts_total"] > 0  # the drafter ran on the image chat

    before = spec_metrics(server)
    with concurrent.futures.ThreadPoolExecutor(1 + len(TEXTS)) as pool:
        image = pool.submit(ask_image)
        texts = list(pool.map(lambda t: complete(server, model, t, n=N),
                              TEXTS))
        assert image.result() == image_tokens
    together = delta(spec_metrics(server), before)

    target64 = _TextView(copy.deepcopy(hf).double())
    want = {name: alone[name] for name in
            ("drafts_total", "draft_tokens_total", "accepted_tokens_total")}
    want["per_pos"] = dict(alone["per_pos"])
    for prompt_ids, tokens in texts:
        out, steps = assistant.reference(target64, helper, prompt_ids, N, K,
                                         stop=set())
        assert tokens == out == _greedy(hf, prompt_ids, N)
        for drafted, accepted in steps:
            want["drafts_total"] += 1
            want["draft_tokens_total"] += drafted
            want["accepted_tokens_total"] += accepted
            for i in range(accepted):
                want["per_pos"][i] = want["per_pos"].get(i, 0) + 1
    print("alone", alone, "together", together, "want", want)
    assert {n: together[n] for n in want if n != "per_pos"} == \
        {n: want[n] for n in want if n != "per_pos"}
    assert {p: v for p, v in together["per_pos"].items() if v} == \
        {p: v for p, v in want["per_pos"].items() if v}
