"""Images through `vllm serve --load-format gemma_qat` (CPU mode): a tiny
multimodal QAT checkpoint with its processor files, chat requests with a
PNG as a `data:` URI, answers against transformers'
`Gemma4ForConditionalGeneration` greedy on the same processor, image and
chat template; bad image input is a 4xx and the engine keeps serving."""
import base64
import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

from harness import complete, hf_greedy, streamed_arrivals
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny_mm

pytestmark = pytest.mark.xdist_group("serve_images")

IMAGE_ARGS = ("--limit-mm-per-prompt", '{"image": 1, "video": 0}',
              "--disable-chunked-mm-input")
# An image's 70 soft-token budget must fit one step (chunked MM input off).
STEP_TOKENS = 128
# A per-image pixel limit as a server sets it (vLLM checks it on the
# image's header; its default, 179M pixels, is PIL's own bomb limit, which
# fires first and surfaces as a 500: see README, Limits).
MAX_IMAGE_PIXELS = 1024 * 1024
MM_TOKEN_IDS = set(tiny_mm.token_ids().values())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoProcessor
    root = tmp_path_factory.mktemp("serve-images")
    hf = tiny_mm.save_servable_mm(root / "model")
    processor = AutoProcessor.from_pretrained(root / "model")
    with CpuServer(root / "model", *IMAGE_ARGS, log=root / "server.log",
                   step_tokens=STEP_TOKENS,
                   env={"VLLM_MAX_IMAGE_PIXELS": str(MAX_IMAGE_PIXELS)}) \
            as server:
        yield server, hf, processor, root / "model"


def image_body(model, image_uri, text="What is in the image?", n=8,
               **extra) -> dict:
    return {"model": str(model), "temperature": 0, "max_tokens": n,
            "ignore_eos": True, "return_token_ids": True, "messages": [{
                "role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image_uri}},
                    {"type": "text", "text": text}]}], **extra}


def image_chat(server, model, image_uri, text="What is in the image?", n=8,
               **extra):
    return server.post("/v1/chat/completions",
                       image_body(model, image_uri, text, n, **extra))


def text_only(tokens):
    """The reference must not emit an image / audio token: transformers
    reads one in its input as a placeholder (pad in the per-layer lookup),
    vLLM as text; a random model may pick one, so the prompts here are
    chosen not to, and this says so if that changes."""
    assert not MM_TOKEN_IDS & set(tokens), tokens
    return tokens


def hf_reference(hf, processor, seed, text="What is in the image?", n=8):
    messages = [{"role": "user", "content": [
        {"type": "image", "image": tiny_mm.png_image(seed)},
        {"type": "text", "text": text}]}]
    prompt_ids, tokens = tiny_mm.hf_image_greedy(hf, processor, messages, n)
    return prompt_ids, text_only(tokens)


def test_image_answer_equals_transformers(served):
    server, hf, processor, model = served
    r = image_chat(server, model, tiny_mm.png_data_uri(1))
    prompt_ids, tokens = hf_reference(hf, processor, 1)
    assert r["prompt_token_ids"] == prompt_ids
    assert r["choices"][0]["token_ids"] == tokens


def test_two_images_give_different_answers(served):
    server, hf, processor, model = served
    answers = []
    for seed in (1, 2):
        r = image_chat(server, model, tiny_mm.png_data_uri(seed), n=8,
                       logprobs=True, top_logprobs=1)
        _, tokens = hf_reference(hf, processor, seed)
        assert r["choices"][0]["token_ids"] == tokens
        answers.append([t["logprob"] for t in
                        r["choices"][0]["logprobs"]["content"]])
    assert answers[0] != answers[1]


def test_text_decoding_beside_an_image_prefill_is_unchanged(served):
    # The bug this guards: a step carrying image embeddings computed every
    # token of the step with token id 0's per-layer inputs, so a text
    # request decoding in that step changed.
    server, hf, _, model = served
    prompt, n = "A text request decoding next to an image.", 96
    body = {"model": str(model), "prompt": prompt, "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "logprobs": 1}

    def text_run():
        choice = server.post("/v1/completions", body)["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    solo_tokens, solo_logprobs = text_run()
    assert len(solo_tokens) == len(solo_logprobs) == n
    generated = server.metrics().get("vllm:generation_tokens_total", 0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The same request streamed (its tokens' arrival times), then, once
        # it decodes, the image chat streamed (its first token arrives when
        # its prefill step is done).
        text = pool.submit(streamed_arrivals, server, "/v1/completions", body)
        deadline = time.time() + 120
        while server.metrics().get("vllm:num_requests_running", 0) < 1 \
                or server.metrics().get("vllm:generation_tokens_total",
                                        0) <= generated:
            assert time.time() < deadline
            time.sleep(0.05)
        image = pool.submit(streamed_arrivals, server, "/v1/chat/completions",
                            image_body(model, tiny_mm.png_data_uri(3)))
        (text_times, tokens, logprobs), (image_times, _, _) = (
            text.result(), image.result())
    # The text request decoded before and after the image's prefill step: it
    # was running then, so that step carried its decode token too (the
    # scheduler runs every running request each step; the image's 70 soft
    # tokens fit one 128-token step with chunked MM input off).
    prefill_done = image_times[0]
    assert min(text_times) < prefill_done < max(text_times), (
        text_times, prefill_done)
    assert tokens == solo_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, solo_logprobs)) < 1e-3


def test_text_after_images_is_unchanged(served):
    server, hf, _, model = served
    prompt_ids, tokens = complete(server, model, "Text after the images.",
                                  n=12)
    assert tokens == text_only(hf_greedy(hf, prompt_ids, 12))


def _status(server, body):
    try:
        server.post("/v1/chat/completions", body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    return 200, {}


def _chat_body(model, *parts):
    return {"model": str(model), "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [
                *parts, {"type": "text", "text": "Describe it."}]}]}


def _image_part(uri):
    return {"type": "image_url", "image_url": {"url": uri}}


def _png_declaring(width, height):
    """A PNG whose header declares width x height (its pixel data never
    decoded): what vLLM's per-image pixel limit is checked on."""
    import struct
    import zlib

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(data).decode()


BAD_INPUT = ["audio", "truncated_png", "bad_base64", "too_many_images",
             "image_too_large"]


def test_bad_image_input_is_a_4xx_and_the_engine_stays_up(served):
    server, hf, processor, model = served
    png = base64.b64decode(tiny_mm.png_data_uri(1).split(",", 1)[1])
    parts = {
        # A clip that decodes: refused because this checkpoint has no
        # audio tower (test_serve_audio serves one that has).
        "audio": [tiny_mm.input_audio_part(tiny_mm.speech_like(1, 1.0))],
        "truncated_png": [_image_part(
            "data:image/png;base64,"
            + base64.b64encode(png[:len(png) // 2]).decode())],
        "bad_base64": [_image_part("data:image/png;base64,@@not-base64@@")],
        "too_many_images": [_image_part(tiny_mm.png_data_uri(1)),
                            _image_part(tiny_mm.png_data_uri(2))],
        "image_too_large": [_image_part(_png_declaring(2048, 1024))],
    }
    expect = {"audio": "does not have an audio tower",
              "truncated_png": "image",
              "bad_base64": "base64", "too_many_images": "at most 1",
              "image_too_large": "exceed the maximum"}
    for case in BAD_INPUT:
        code, body = _status(server, _chat_body(model, *parts[case]))
        assert 400 <= code < 500, (case, code, body)
        assert expect[case] in json.dumps(body).lower(), (case, body)
        # The engine is still up after each.
        urllib.request.urlopen(server.url + "/health", timeout=10)
    # ... and answers as before.
    r = image_chat(server, model, tiny_mm.png_data_uri(1))
    assert r["choices"][0]["token_ids"] == hf_reference(hf, processor, 1)[1]
