"""A tiny multimodal Gemma 4 checkpoint that `vllm serve` accepts images for.

`tiny.save_servable` writes weights and a text tokenizer; images also need
what Gemma 4's processors read: the multimodal special tokens (named on the
tokenizer, their ids in config.json), an image-processor config and a chat
template that puts an image where the chat has one. transformers'
`AutoProcessor` (a `Gemma4Processor`) and vLLM's Gemma 4 multimodal
processing (vllm/model_executor/models/gemma4_mm.py) both load the
directory, so a vLLM chat answer can be compared with transformers' greedy
decoding of the same chat. Nothing here is downloaded.

Image geometry: tiny.py's vision tower keeps Gemma 4's patch size 16 and
pooling kernel 3. Gemma 4's image processor only takes a soft-token budget
in (70, 140, 280, 560, 1120); under 70 it resizes a square image of any
size to 384x384 (24x24 patches, 8x8 after pooling), so a 32x32 PNG becomes
SOFT_TOKENS = 64 soft tokens between BOI and EOI. vLLM (placeholders, the
encoder budget) and tpu-inference (the vision output length) read the
budget from the vision config's `default_output_length`, so that is 70 too:
tiny.build_config's 16 is no budget the image processor accepts.
"""
from __future__ import annotations

import base64
import io
from pathlib import Path

from vllm_gemma_qat.testing import tiny

# Gemma 4's multimodal token strings, put on ids 262-268 of the 512-token
# vocab: the first <unusedN> slots after tiny.py's 6 specials and 256 bytes,
# so every other id keeps the token tiny.save_tokenizer gives it.
# Gemma4Processor needs all of them: it refuses a tokenizer without the
# audio ones even when no audio is sent, and adds <|video|> (past the vocab)
# if the tokenizer lacks it.
MM_TOKENS = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
    "video_token": "<|video|>",
}
FIRST_MM_ID = len(tiny.SPECIAL_TOKENS) + 256
MM_IDS = {name: FIRST_MM_ID + i for i, name in enumerate(MM_TOKENS)}

# The audio tower: Gemma 4's (chunk 12, 12 frames back, the 128-channel
# first convolution the 128 mel bins need), narrow and one layer deep.
AUDIO_CONFIG = dict(hidden_size=64, num_hidden_layers=1,
                    num_attention_heads=4, subsampling_conv_channels=[128, 8],
                    output_proj_dims=48)
AUDIO_CLIP = 4.0
SAMPLE_RATE = 16_000
# Audio soft tokens per clip at most (Gemma 4's: 750, 30 s at 40 ms a token):
# 4 s here, so that a clip fits a CPU-mode step.
AUDIO_SEQ_LENGTH = 100

MAX_SOFT_TOKENS = 70   # the smallest budget Gemma4ImageProcessor accepts
IMAGE_SIZE = 32        # png_image's default side
SOFT_TOKENS = 64       # soft tokens of a square image under MAX_SOFT_TOKENS

# tiny.CHAT_TEMPLATE, plus content given as a list of parts (how vLLM hands
# a chat to a template that loops over the content, and how transformers'
# processors take images): an image part becomes one image token, which
# both processors expand to BOI + soft tokens + EOI; a text part its trimmed
# text. String content renders exactly as tiny.CHAT_TEMPLATE does.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] | trim }}"
    "{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] in ('image', 'image_url') %}"
    "{{ '" + MM_TOKENS["image_token"] + "' }}"
    "{% elif item['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{{ '" + MM_TOKENS["audio_token"] + "' }}"
    "{% elif item['type'] == 'text' %}"
    "{{ item['text'] | trim }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def save_servable_mm(path: str | Path, geometry: str = "e2b", seed: int = 0,
                     form: str | None = None, layout: str = "qat",
                     audio: bool = False):
    """`tiny.save_servable` (`tiny.save_servable_int4` for form "w4a16" or
    "q4_0") of a multimodal model (`audio`: with an audio tower), plus the
    files its processors need. Returns the transformers
    Gemma4ForConditionalGeneration (fp32, eval) the checkpoint was written
    from (int4: the exact dequantized weights)."""
    model = build_model(geometry, seed, audio)
    if form is None:
        tiny.save_checkpoint(model, path, layout=layout)
    elif layout != "qat":
        raise ValueError("the int4 forms are QAT exports (layout 'qat')")
    else:
        grid = tiny.put_on_int4_grid(model, seed)
        tiny.save_int4_checkpoint(model, path, grid, form)
    save_processor(path)
    return model


def token_ids() -> dict[str, int]:
    """{"image_token": id, "boi_token": id, ...}: MM_IDS, by name."""
    return dict(MM_IDS)


def build_model(geometry: str = "e2b", seed: int = 0, audio: bool = False):
    """`tiny.build_model(geometry, True, seed)` with the tokenizer's
    multimodal token ids and the image budget in its config (neither
    changes a weight); `audio`: plus an audio tower (`with_audio_tower`)."""
    model = tiny.build_model(geometry, True, seed)
    if audio:
        model = with_audio_tower(model, seed)
    config = model.config
    config.boi_token_id = MM_IDS["boi_token"]
    config.eoi_token_id = MM_IDS["eoi_token"]
    config.image_token_id = MM_IDS["image_token"]
    config.boa_token_id = MM_IDS["boa_token"]
    config.eoa_token_index = MM_IDS["eoa_token"]  # transformers' name
    config.audio_token_id = MM_IDS["audio_token"]
    config.video_token_id = MM_IDS["video_token"]
    config.vision_config.default_output_length = MAX_SOFT_TOKENS
    return model


def with_audio_tower(model, seed: int = 0):
    """`model` with a tiny audio tower and embedder (AUDIO_CONFIG) added:
    every other weight as it was. The tower's norms are spread as tiny.py
    spreads the text model's, and its clipped linears get finite bounds
    (the real exports' are finite too) so that clipping shows."""
    import torch
    from transformers import (Gemma4AudioConfig,
                              Gemma4ForConditionalGeneration)
    config = model.config.to_dict()
    config["audio_config"] = Gemma4AudioConfig(**AUDIO_CONFIG).to_dict()
    config = type(model.config).from_dict(config)
    torch.manual_seed(seed + 1)
    out = Gemma4ForConditionalGeneration(config).eval()
    missing, unexpected = out.load_state_dict(model.state_dict(),
                                              strict=False)
    assert not unexpected and all(
        ".audio_tower." in n or ".embed_audio." in n for n in missing)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if "audio" not in name:
                continue
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("per_dim_scale"):
                p.copy_(torch.randn(p.shape, generator=gen))
        for name, b in out.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-AUDIO_CLIP)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(AUDIO_CLIP)
    return out


def build_tokenizer():
    """tiny.save_tokenizer's byte-level tokenizer with MM_TOKENS on MM_IDS,
    special (never split) and named the way transformers 5 names them
    (`model_specific_special_tokens`: `tokenizer.image_token`,
    `.image_token_id`, `.boi_token`, ...)."""
    tokenizer = tiny.byte_level_tokenizer(
        {token_id: MM_TOKENS[name] for name, token_id in MM_IDS.items()},
        extra_special_tokens=["<start_of_turn>", "<end_of_turn>",
                              *MM_TOKENS.values()],
        model_specific_special_tokens=MM_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_processor(path: str | Path) -> Path:
    """Write the tokenizer and a Gemma4Processor: its image processor with
    the MAX_SOFT_TOKENS budget (patch size and pooling as the vision
    tower's), audio and video processors at their defaults (it requires
    all four) and CHAT_TEMPLATE."""
    from transformers import (Gemma4AudioFeatureExtractor,
                              Gemma4ImageProcessor, Gemma4Processor,
                              Gemma4VideoProcessor)
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(max_soft_tokens=MAX_SOFT_TOKENS),
        tokenizer=build_tokenizer(),
        video_processor=Gemma4VideoProcessor(),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=SOFT_TOKENS,
        audio_seq_length=AUDIO_SEQ_LENGTH)
    processor.save_pretrained(path)
    # Gemma4Processor's __init__ re-adds <|video|> with a call that replaces
    # the tokenizer's list of extra special tokens (they stay special, but
    # the saved list would name only <|video|>): write the tokenizer again.
    build_tokenizer().save_pretrained(path)
    return Path(path)


# --- images -----------------------------------------------------------------

def png_image(seed_or_pixels=0, size: int = IMAGE_SIZE):
    """A deterministic RGB PIL image: size x size random pixels from an int
    seed, or the given (height, width, 3) uint8 array."""
    import numpy as np
    from PIL import Image
    if isinstance(seed_or_pixels, int):
        rng = np.random.default_rng(seed_or_pixels)
        pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    else:
        pixels = np.asarray(seed_or_pixels, dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def png_data_uri(seed_or_pixels=0, size: int = IMAGE_SIZE) -> str:
    """`png_image(seed_or_pixels, size)` as the `data:image/png;base64,...`
    URI of a chat request's `image_url` (PNG is lossless: the server
    decodes the very pixels png_image gives transformers)."""
    buffer = io.BytesIO()
    png_image(seed_or_pixels, size).save(buffer, format="PNG")
    return ("data:image/png;base64,"
            + base64.b64encode(buffer.getvalue()).decode())


def hf_image_greedy(hf_model, processor, messages, n: int):
    """transformers' greedy decoding of a chat whose content parts may be
    {"type": "image", "image": PIL image} or {"type": "audio", "audio":
    float32 samples at SAMPLE_RATE}: the processor renders the chat
    template and expands each image and clip, then `generate`. Returns (prompt token
    ids, generated token ids: n of them, fewer if it stops at EOS)."""
    import torch
    inputs = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt",
        add_generation_prompt=True)
    prompt_ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=n)
    return prompt_ids, out[0, len(prompt_ids):].tolist()


# --- audio ------------------------------------------------------------------

def speech_like(seed: int = 0, seconds: float = 2.0,
                rate: int = SAMPLE_RATE):
    """A deterministic mono float32 clip: a few gliding tones and noise."""
    import numpy as np
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    clip = sum(rng.uniform(0.1, 0.3) * np.sin(
        2 * np.pi * (rng.uniform(100, 900) + rng.uniform(-200, 200) * t) * t)
        for _ in range(3))
    clip = clip + 0.02 * rng.standard_normal(t.shape)
    return clip.astype(np.float32)


def wav_bytes(clip, rate: int = SAMPLE_RATE, subtype: str = "FLOAT") -> bytes:
    """`clip` as a WAV file (32-bit float samples by default: the server
    decodes the very samples transformers is given)."""
    import soundfile
    buffer = io.BytesIO()
    soundfile.write(buffer, clip, rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


def input_audio_part(clip, rate: int = SAMPLE_RATE) -> dict:
    return {"type": "input_audio", "input_audio": {
        "data": base64.b64encode(wav_bytes(clip, rate)).decode(),
        "format": "wav"}}

