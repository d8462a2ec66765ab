"""Tiny multimodal Gemma 4 checkpoints that `vllm serve` answers images
with: the tiny random model of `tiny.py` plus a Gemma 4 processor
(tokenizer with Gemma 4's image / audio special tokens, image processor,
chat template placing each image). Used by the image tests and the demo;
nothing here is downloaded.

A 32x32 image becomes 64 soft tokens: the processor upscales it to 384x384
(the most that `max_soft_tokens` = 70 allows with 16-pixel patches pooled
3x3), 24x24 patches, 8x8 after pooling.
"""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from vllm_gemma_qat.testing import tiny

MAX_SOFT_TOKENS = 70  # the smallest budget Gemma4ImageProcessor accepts
# Gemma 4's multimodal special tokens, as transformers' Gemma4Processor
# reads them from the tokenizer (it refuses a tokenizer without the audio
# ones even when no audio is sent). They take the first unused ids.
MM_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>",
             "eoi_token": "<image|>", "audio_token": "<|audio|>",
             "boa_token": "<|audio>", "eoa_token": "<audio|>"}
# Gemma's chat format (as tiny.CHAT_TEMPLATE) with content parts: an image
# part becomes one image token, which both transformers' processor and
# vLLM's Gemma 4 processing expand to boi + soft tokens + eoi.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def build_model(geometry: str = "e2b", seed: int = 0):
    """`tiny.build_model` (multimodal) with the vision budget and the
    special-token ids of this processor in its config."""
    model = tiny.build_model(geometry, True, seed)
    ids = token_ids()
    config = model.config
    config.vision_config.default_output_length = MAX_SOFT_TOKENS
    config.image_token_id = ids["image_token"]
    config.boi_token_id = ids["boi_token"]
    config.eoi_token_id = ids["eoi_token"]
    config.audio_token_id = ids["audio_token"]
    config.boa_token_id = ids["boa_token"]
    config.eoa_token_id = ids["eoa_token"]
    return model


def token_ids() -> dict[str, int]:
    first = len(tiny.SPECIAL_TOKENS) + 256  # after the bytes
    return {name: first + i for i, name in enumerate(MM_TOKENS)}


def save_processor(path: str | Path) -> Path:
    """Tokenizer (tiny.py's byte-level one plus MM_TOKENS), image
    processor and chat template, as `AutoProcessor` and vLLM read them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma4 import (Gemma4AudioFeatureExtractor,
                                            Gemma4ImageProcessor,
                                            Gemma4Processor,
                                            Gemma4VideoProcessor)
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = tiny.SPECIAL_TOKENS + byte_chars + list(MM_TOKENS.values())
    tokens += [f"<unused{i}>" for i in range(tiny.VOCAB_SIZE - len(tokens))]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                   merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                     use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        extra_special_tokens=MM_TOKENS)
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(max_soft_tokens=MAX_SOFT_TOKENS),
        tokenizer=tokenizer, video_processor=Gemma4VideoProcessor(),
        chat_template=CHAT_TEMPLATE, image_seq_length=MAX_SOFT_TOKENS)
    processor.save_pretrained(path)
    # vLLM renders chat prompts with the tokenizer's own template.
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return Path(path)


def save_servable_mm(path: str | Path, geometry: str = "e2b", seed: int = 0,
                     form: str | None = None, layout: str = "qat"):
    """A multimodal model directory `vllm serve` answers images with: the
    tiny checkpoint (QAT or regular layout; `form` "w4a16" / "q4_0" for an
    int4 export, see `tiny.save_int4_checkpoint`) plus `save_processor`.
    Returns the transformers model it was written from (for int4: holding
    the exact dequantized weights)."""
    model = build_model(geometry, seed)
    if form is None:
        tiny.save_checkpoint(model, path, layout=layout)
    else:
        grid = tiny.put_on_int4_grid(model, seed)
        tiny.save_int4_checkpoint(model, path, grid, form)
    save_processor(path)
    return model


def png_image(seed: int, size: int = 32):
    """A deterministic random RGB image."""
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3))
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def png_data_uri(seed: int, size: int = 32) -> str:
    """`png_image(seed, size)` as a `data:image/png;base64,...` URI."""
    buffer = io.BytesIO()
    png_image(seed, size).save(buffer, format="PNG")
    return ("data:image/png;base64,"
            + base64.b64encode(buffer.getvalue()).decode())


def hf_image_greedy(hf_model, processor, messages, n: int):
    """transformers' greedy answer to a chat with images: (prompt token
    ids, the n generated token ids)."""
    import torch
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True,
        return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=n, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def processor_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "processor_config.json").read_text())
