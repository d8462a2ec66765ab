"""Audio through `vllm serve --load-format gemma_qat` (CPU mode): a tiny
multimodal QAT checkpoint with an audio tower (tiny_mm.with_audio_tower)
and Gemma 4's processor files; chat requests with a WAV clip as
`input_audio`, answers against transformers' Gemma4ForConditionalGeneration
greedy on the same processor and chat template; bad audio is a 400 and the
engine keeps serving."""
import base64
import concurrent.futures
import json
import urllib.request

import numpy as np
import pytest

from harness import complete, hf_greedy
from test_serve_images import _status
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny_mm

pytestmark = pytest.mark.xdist_group("serve_audio")

AUDIO_ARGS = ("--limit-mm-per-prompt", '{"image": 1, "audio": 1, "video": 0}',
              "--disable-chunked-mm-input")
STEP_TOKENS = 128
QUESTION = "What is said?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoProcessor
    root = tmp_path_factory.mktemp("serve-audio")
    hf = tiny_mm.save_servable_mm(root / "model", audio=True)
    processor = AutoProcessor.from_pretrained(root / "model")
    with CpuServer(root / "model", *AUDIO_ARGS, log=root / "server.log",
                   step_tokens=STEP_TOKENS) as server:
        yield server, hf, processor, root / "model"


def audio_body(model, part, n=8, **extra) -> dict:
    return {"model": str(model), "temperature": 0, "max_tokens": n,
            "ignore_eos": True, "return_token_ids": True, "messages": [{
                "role": "user", "content": [
                    part, {"type": "text", "text": QUESTION}]}], **extra}


def hf_audio_reference(hf, processor, clip, n=8):
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": clip},
        {"type": "text", "text": QUESTION}]}]
    return tiny_mm.hf_image_greedy(hf, processor, messages, n)


def test_tower_output_equals_transformers(served):
    """The JAX tower and embedder (the classes the fix builds), loaded by
    name from the model's tensors, on one clip's features from Gemma 4's
    feature extractor: equal to transformers' get_audio_features (fp32).
    The served answers below check them inside the server."""
    import jax.numpy as jnp
    import torch

    from vllm_gemma_qat.fixes.audio_tower import (AudioEmbedder,
                                                  Gemma4AudioModel,
                                                  load_audio_weights)
    _, hf, processor, _ = served
    clip = tiny_mm.speech_like(5, 1.3)
    features = processor.feature_extractor([clip], return_tensors="pt")
    with torch.no_grad():
        ref = hf.model.get_audio_features(
            features["input_features"], features["input_features_mask"])
    ref_mask = ref.attention_mask[0].numpy()
    ref = ref.pooler_output[0].numpy()[ref_mask]
    config = hf.config
    tower = Gemma4AudioModel(config.audio_config, jnp.float32)
    embedder = AudioEmbedder(config.audio_config,
                             config.text_config.hidden_size, jnp.float32)
    state = hf.state_dict()
    loaded = load_audio_weights(
        {"model.audio_tower": tower, "model.embed_audio": embedder},
        [(n, t) for n, t in state.items()
         if n.startswith(("model.audio_tower.", "model.embed_audio."))])
    assert loaded == {f"model.audio_tower.{n}" for n, _ in
                      tower.named_parameters()} | {
        f"model.embed_audio.{n}" for n, _ in embedder.named_parameters()}
    hidden, mask = tower(jnp.asarray(features["input_features"].numpy()),
                         jnp.asarray(features["input_features_mask"].numpy()))
    got = np.asarray(embedder(hidden))[0][np.asarray(mask[0])]
    assert got.shape == ref.shape == (33, config.text_config.hidden_size)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def assert_audio_answer_equals_transformers(served, clip, part=None):
    """An audio chat with `clip` (as a WAV `input_audio` part, or `part`):
    its prompt and greedy tokens equal transformers' on `clip`'s samples.
    Returns the prompt's token ids."""
    server, hf, processor, model = served
    r = server.post("/v1/chat/completions", audio_body(
        model, part or tiny_mm.input_audio_part(clip)))
    prompt_ids, tokens = hf_audio_reference(hf, processor, clip)
    assert r["prompt_token_ids"] == prompt_ids
    assert r["choices"][0]["token_ids"] == tokens
    return prompt_ids


def test_audio_answer_equals_transformers(served):
    prompt_ids = assert_audio_answer_equals_transformers(
        served, tiny_mm.speech_like(1, 2.0))
    assert prompt_ids.count(tiny_mm.MM_IDS["audio_token"]) == 50


def test_two_clips_give_different_answers(served):
    server, hf, processor, model = served
    answers = []
    for seed, seconds in ((2, 1.0), (3, 3.0)):
        clip = tiny_mm.speech_like(seed, seconds)
        r = server.post("/v1/chat/completions", audio_body(
            model, tiny_mm.input_audio_part(clip), logprobs=True,
            top_logprobs=1))
        assert r["choices"][0]["token_ids"] == hf_audio_reference(
            hf, processor, clip)[1]
        answers.append([t["logprob"] for t in
                        r["choices"][0]["logprobs"]["content"]])
    assert answers[0] != answers[1]


def test_audio_image_and_text_together(served):
    """An audio chat, an image chat and two text requests sent at once
    (batched into the same steps) each answer as transformers does."""
    server, hf, processor, model = served
    clip = tiny_mm.speech_like(4, 1.5)
    image_body = {"model": str(model), "temperature": 0, "max_tokens": 8,
                  "ignore_eos": True, "return_token_ids": True,
                  "messages": [{"role": "user", "content": [
                      {"type": "image_url",
                       "image_url": {"url": tiny_mm.png_data_uri(1)}},
                      {"type": "text", "text": "What is in the image?"}]}]}
    texts = ["Two requests of text", "beside the audio and the image"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        audio = pool.submit(server.post, "/v1/chat/completions",
                            audio_body(model, tiny_mm.input_audio_part(clip)))
        image = pool.submit(server.post, "/v1/chat/completions", image_body)
        text = [pool.submit(complete, server, model, t, 8) for t in texts]
        audio, image = audio.result(), image.result()
        text = [t.result() for t in text]
    assert audio["choices"][0]["token_ids"] == hf_audio_reference(
        hf, processor, clip)[1]
    _, image_tokens = tiny_mm.hf_image_greedy(hf, processor, [{
        "role": "user", "content": [
            {"type": "image", "image": tiny_mm.png_image(1)},
            {"type": "text", "text": "What is in the image?"}]}], 8)
    assert image["choices"][0]["token_ids"] == image_tokens
    for prompt_ids, tokens in text:
        assert tokens == hf_greedy(hf, prompt_ids, 8)


def _raw_part(data: bytes, fmt="wav"):
    return {"type": "input_audio", "input_audio": {
        "data": base64.b64encode(data).decode(), "format": fmt}}


BAD_AUDIO = {
    "undecodable": (lambda: _raw_part(b"RIFF" + bytes(64)), "audio"),
    "unsupported_format": (lambda: _raw_part(b"%PDF-1.4 not audio", "pdf"),
                           "audio"),
    "too_long": (lambda: tiny_mm.input_audio_part(
        tiny_mm.speech_like(6, 5.0)), "at most 4.00 s"),
    "empty": (lambda: tiny_mm.input_audio_part(
        np.zeros(0, np.float32)), "empty"),
    "too_short": (lambda: tiny_mm.input_audio_part(
        tiny_mm.speech_like(6, 0.005)), "too short (5.0 ms)"),
}


@pytest.mark.parametrize("case", sorted(BAD_AUDIO))
def test_bad_audio_is_a_400_and_the_engine_serves_on(served, case):
    server, _, _, model = served
    part, expect = BAD_AUDIO[case]
    code, body = _status(server, audio_body(model, part(), n=4))
    assert code == 400, (case, code, body)
    assert expect in json.dumps(body), (case, body)
    urllib.request.urlopen(server.url + "/health", timeout=10)
    assert_audio_answer_equals_transformers(served, tiny_mm.speech_like(1, 2.0))


def test_more_clips_than_allowed_is_a_400(served):
    server, _, _, model = served
    clip = tiny_mm.input_audio_part(tiny_mm.speech_like(1, 1.0))
    body = audio_body(model, clip, n=4)
    body["messages"][0]["content"].insert(0, clip)
    code, error = _status(server, body)
    assert code == 400 and "at most 1" in json.dumps(error).lower(), (
        code, error)


def test_a_clip_at_another_rate_is_resampled(served):
    """A 44.1 kHz WAV: resampled to the feature extractor's 16 kHz with
    soxr (vLLM's own `soxr` method; vLLM's default, torchaudio, is not in
    vllm-tpu's [audio] extra) and answered as transformers answers those
    samples."""
    import soxr
    clip = tiny_mm.speech_like(7, 1.5, rate=44_100)
    assert_audio_answer_equals_transformers(
        served, soxr.resample(clip, 44_100, tiny_mm.SAMPLE_RATE),
        tiny_mm.input_audio_part(clip, rate=44_100))


@pytest.mark.parametrize("limit,tower", [(None, True), ({"audio": 0}, False),
                                         ({"image": 0, "audio": 2}, True)])
def test_an_audio_limit_of_zero_leaves_the_tower_out(served, limit, tower):
    """As vLLM's own models skip a tower whose modality is limited to 0
    (on a v5e-1 its ~0.6 GB of weights and six programs are HBM a text or
    image server can use)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_gemma_qat.fixes import audio
    model = served[3]
    extra = {} if limit is None else {"limit_mm_per_prompt": limit}
    config = EngineArgs(model=str(model), max_model_len=256,
                        **extra).create_engine_config()
    assert audio.wants_tower(config) is tower


@pytest.mark.parametrize("form", ["audio_url", "mp3"])
def test_audio_url_and_mp3_parts(served, form):
    """An `audio_url` part (a data: URI) and an MP3 `input_audio` part:
    answered as transformers answers the samples the file decodes to
    (soundfile decodes both sides: the server's first decoder there, as
    torchcodec is not installed)."""
    import io

    import soundfile
    clip = tiny_mm.speech_like(8, 1.2)
    if form == "mp3":
        buffer = io.BytesIO()
        soundfile.write(buffer, clip, tiny_mm.SAMPLE_RATE, format="MP3")
        data = buffer.getvalue()
        part = _raw_part(data, "mp3")
    else:
        data = tiny_mm.wav_bytes(clip)
        part = {"type": "audio_url", "audio_url": {
            "url": "data:audio/wav;base64," + base64.b64encode(data).decode()}}
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert rate == tiny_mm.SAMPLE_RATE
    assert_audio_answer_equals_transformers(served, samples, part)


def test_bf16_features_reach_the_tower_as_float32():
    """A bf16 server gets its features from vLLM in bf16 (numpy has no
    bf16: `np.asarray` on such a tensor raises, which stopped the engine
    on the first clip). By hand on 2026-12-07, the tiny checkpoint served
    with --dtype bfloat16 answered a 2 s clip (50 audio tokens)."""
    import torch

    from vllm_gemma_qat.fixes.audio import _host_f32
    features = torch.linspace(-2, 2, 12, dtype=torch.bfloat16).reshape(3, 4)
    host = _host_f32(features)
    assert host.dtype == np.float32
    assert (host == features.float().numpy()).all()
