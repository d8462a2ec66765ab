"""Tiny random Gemma 4 E-family checkpoints, written by transformers.

`save_pretrained` already writes the QAT layout: KV-shared layers get no
k_proj / v_proj / k_norm. `layout="regular"` adds the unused tensors that
Google's BF16 exports ship for those layers. Used by the demo, the tests and
the benchmarks; nothing here is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

# Two sharing geometries, scaled down. head_dim is a multiple of 128 because
# tpu-inference pads other head sizes (and then logits no longer line up);
# 8 query heads as the real models have, so tensor parallelism up to 8 splits
# them (the vision tower's heads too).
GEOMETRIES = {
    # E2B: (4 sliding + 1 full) blocks, 1 KV head, double-wide MLP on shared layers.
    "e2b": dict(num_hidden_layers=10, num_kv_shared_layers=5, block=(4, 1),
                num_attention_heads=8, num_key_value_heads=1,
                use_double_wide_mlp=True),
    # E4B: (5 sliding + 1 full) blocks, 2 KV heads, no double-wide MLP.
    "e4b": dict(num_hidden_layers=12, num_kv_shared_layers=6, block=(5, 1),
                num_attention_heads=8, num_key_value_heads=2,
                use_double_wide_mlp=False),
}
SLIDING_WINDOW = 8
VOCAB_SIZE = 512


def text_config_kwargs(geometry: str = "e2b") -> dict:
    g = dict(GEOMETRIES[geometry])
    n_sliding, n_full = g.pop("block")
    block = ["sliding_attention"] * n_sliding + ["full_attention"] * n_full
    layer_types = (block * g["num_hidden_layers"])[:g["num_hidden_layers"]]
    return dict(
        vocab_size=VOCAB_SIZE,
        vocab_size_per_layer_input=VOCAB_SIZE,
        hidden_size=64,
        hidden_size_per_layer_input=32,  # a multiple of the int4 group size
        intermediate_size=128,
        head_dim=128,
        global_head_dim=256,
        layer_types=layer_types,
        sliding_window=SLIDING_WINDOW,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_k_eq_v=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        **g,
    )


def build_config(geometry: str = "e2b", multimodal: bool = True):
    from transformers import (Gemma4Config, Gemma4TextConfig,
                              Gemma4VisionConfig)
    text = Gemma4TextConfig(**text_config_kwargs(geometry))
    if not multimodal:
        text.architectures = ["Gemma4ForCausalLM"]
        return text
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=8,
                                num_key_value_heads=8, head_dim=16,
                                position_embedding_size=10240,
                                default_output_length=16)
    config = Gemma4Config(text_config=text.to_dict(),
                          vision_config=vision.to_dict(),
                          audio_config=None,
                          tie_word_embeddings=True)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    return config


def build_model(geometry: str = "e2b", multimodal: bool = True, seed: int = 0):
    """A randomly initialised transformers model (fp32, eval mode)."""
    import torch
    from transformers import (Gemma4ForCausalLM,
                              Gemma4ForConditionalGeneration)
    torch.manual_seed(seed)
    config = build_config(geometry, multimodal)
    cls = Gemma4ForConditionalGeneration if multimodal else Gemma4ForCausalLM
    model = cls(config).eval()
    # Random init leaves norms at 0/1; spread them so a wrong norm formula
    # (w vs 1 + w) or a dropped layer_scalar shows up in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                p.uniform_(0.5, 1.5)
    return model


def save_checkpoint(model, path: str | Path, layout: str = "qat",
                    dtype=None, bare: bool = False) -> Path:
    """Write `model` as a safetensors checkpoint in the QAT or regular layout.

    A text-only model is written the way the text-only exports of Gemma 4
    are: a `gemma4` config holding the text config, tensors under
    `model.language_model.`; with `bare`, as transformers' `save_pretrained`
    writes it: a `gemma4_text` config, tensors under `model.`.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_gemma_qat.geometry import language_model_prefix, text_config_of
    if layout not in ("qat", "regular"):
        raise ValueError(f"unknown layout {layout!r}")
    path = Path(path)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    text_only = model.config.model_type == "gemma4_text"
    if bare and not text_only:
        raise ValueError("bare: a text-only (gemma4_text) model only")
    wrap = text_only and not bare
    if wrap:
        _wrap_text_config(path)
    if layout == "qat" and not wrap:
        return path
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    if wrap:
        tensors = {"model.language_model." + n[len("model."):]: t
                   for n, t in tensors.items()}
    if layout == "regular":
        # Regular exports also ship K/V for the shared layers; the values are
        # never read, so random ones of the right shape are faithful enough.
        text = text_config_of(json.loads((path / "config.json").read_text()))
        gen = torch.Generator().manual_seed(1234)
        prefix = language_model_prefix(tensors)
        for i, (kv_heads, head_dim) in _shared_layer_kv_dims(text).items():
            p = f"{prefix}layers.{i}.self_attn."
            shape = (kv_heads * head_dim, text["hidden_size"])
            dt = tensors[f"{p}q_proj.weight"].dtype
            tensors[f"{p}k_proj.weight"] = torch.randn(shape, generator=gen).to(dt)
            tensors[f"{p}v_proj.weight"] = torch.randn(shape, generator=gen).to(dt)
            tensors[f"{p}k_norm.weight"] = torch.ones(head_dim, dtype=dt)
    save_file(tensors, shard, metadata={"format": "pt"})
    return path


def _wrap_text_config(path: Path) -> None:
    """tpu-inference's JAX Gemma4ForCausalLM reads `hf_config.text_config`, so
    a text-only checkpoint it can build declares a `gemma4` config holding the
    text config (with no towers), as text-only exports of Gemma 4 do."""
    from transformers import Gemma4Config
    file = path / "config.json"
    text = json.loads(file.read_text())
    config = Gemma4Config(text_config=text, vision_config=None,
                          audio_config=None,
                          tie_word_embeddings=text["tie_word_embeddings"])
    config.architectures = ["Gemma4ForCausalLM"]
    config.to_json_file(file)


def _shared_layer_kv_dims(text: dict) -> dict[int, tuple[int, int]]:
    from vllm_gemma_qat.geometry import Geometry
    geo = Geometry.from_text_config(text)
    return {i: (geo.kv_heads(i), geo.head_dim(i)) for i in geo.kv_share_map}


# --- int4 forms -------------------------------------------------------------

def put_on_int4_grid(model, seed: int = 0) -> dict[str, tuple]:
    """Round every parameter to bf16 and put every language-model Linear on
    the q4_0 grid (w = d * q, q in [-8, 7], groups of 32 input columns, bf16
    d): a quarter of the groups peak below level 8, an eighth have d < 0
    with a positive peak on level -8 (as GGML's q4_0 writes them).
    Returns {checkpoint module name: (q, d)} as numpy arrays."""
    import numpy as np
    import torch

    from vllm_gemma_qat import int4, quantization
    config = quantization.w4a16_quantization_config()
    rng = np.random.default_rng(seed)
    grid = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for name, module in model.named_modules():
            ckpt_name = _checkpoint_module_name(model, name)
            if not (isinstance(module, torch.nn.Linear)
                    and quantization.quantizes(config, ckpt_name)):
                continue
            out_f, in_f = module.weight.shape
            q = rng.integers(-8, 8, size=(out_f, in_f)).astype(np.int8)
            groups = q.reshape(out_f, -1, int4.GROUP_SIZE)
            shape = groups.shape[:2]
            low = rng.random(shape) < 0.25
            cap = rng.integers(3, 8, size=shape)[..., None]
            groups[:] = np.where(low[..., None], np.clip(groups, -cap, cap),
                                 groups)
            negative = ~low & (rng.random(shape) < 0.125)
            groups[negative, 0] = -8
            # |d| = k * 2^-11 with k in [8, 15]: q * d then has at most 7
            # significant bits, so the bf16 export, the int4 dequantization
            # and the fp32 reference all hold exactly the same weights.
            d = (rng.integers(8, 16, size=shape) * 2.0**-11 *
                 np.where(negative, -1, 1)).astype(np.float32).astype(int4.BF16)
            module.weight.copy_(torch.from_numpy(
                int4.dequantize(q, d).astype(np.float32)))
            grid[ckpt_name] = (q, d)
    return grid


def _checkpoint_module_name(model, name: str) -> str:
    # transformers' text-only Gemma4ForCausalLM names modules `model.layers.*`;
    # the checkpoints here (and tpu-inference) use `model.language_model.*`.
    if model.config.model_type == "gemma4_text" and name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def _bare_name(name: str) -> str:
    return name.replace("model.language_model.", "model.", 1)


def save_int4_checkpoint(model, path: str | Path, grid: dict, form: str,
                         dtype=None, ignore=(), bare: bool = False) -> Path:
    """An int4 QAT export of `model` (after `put_on_int4_grid`):

    - "q4_0": the `-qat-q4_0-unquantized` form, grid linears as bf16 values;
    - "w4a16": the `-qat-w4a16-ct` form: written by compressed-tensors' own
      compressor and config, targets ["Linear"], the published recipe's
      ignore list plus `ignore`; the linears that config quantizes are
      pack-quantized, the others stay bf16.

    Other tensors are saved in `dtype` (the real exports: bf16; None keeps
    fp32, which lets tests compare logits tightly). `bare`: a text-only
    model as transformers saves it (see `save_checkpoint`).
    """
    import torch
    from compressed_tensors.compressors.pack_quantized.base import \
        PackedQuantizationCompressor
    from compressed_tensors.quantization import (QuantizationArgs,
                                                 QuantizationConfig,
                                                 QuantizationScheme)
    from safetensors.torch import load_file, save_file

    from vllm_gemma_qat import quantization
    if form not in ("q4_0", "w4a16"):
        raise ValueError(f"unknown int4 form {form!r}")
    path = save_checkpoint(model, path, layout="qat", dtype=dtype, bare=bare)
    if bare:
        grid = {_bare_name(module): qd for module, qd in grid.items()}
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True,
                               strategy="group",
                               group_size=quantization.GROUP_SIZE)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    quantized = quantization.w4a16_quantization_config(ignore)
    ignore = quantized["ignore"]
    for module, (q, d) in grid.items():
        weight = tensors.pop(module + ".weight").to(torch.bfloat16)
        if form == "q4_0" or not quantization.quantizes(quantized, module):
            tensors[module + ".weight"] = weight
            continue
        scale = torch.from_numpy(d.astype("float32")).to(torch.bfloat16)
        packed = PackedQuantizationCompressor.compress(
            {"weight": weight, "weight_scale": scale}, scheme)
        for key, value in packed.items():
            tensors[f"{module}.{key}"] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    if form == "w4a16":
        config = QuantizationConfig(config_groups={"group_0": scheme},
                                    format="pack-quantized",
                                    quantization_status="compressed",
                                    ignore=ignore)
        file = path / "config.json"
        data = json.loads(file.read_text())
        data["quantization_config"] = config.model_dump(mode="json")
        file.write_text(json.dumps(data, indent=2))
    return path


# --- tokenizer --------------------------------------------------------------

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                  "<end_of_turn>"]
# Gemma's chat format: BOS, then "<start_of_turn>role\n...<end_of_turn>\n"
# per message (assistant is "model"), then the open model turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def save_tokenizer(path: str | Path) -> Path:
    """A byte-level tokenizer (6 specials, 256 bytes, unused ids up to
    VOCAB_SIZE) with
    Gemma's special tokens and chat template; like Gemma's, it does not add
    BOS itself (the chat template does)."""
    tokenizer = byte_level_tokenizer(
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return Path(path)


def byte_level_tokenizer(tokens_at: dict[int, str] | None = None, **special):
    """The byte-level vocabulary of `save_tokenizer` (`tokens_at` puts
    other tokens on some of its unused ids) with Gemma's named special
    tokens; `special`: further PreTrainedTokenizerFast special-token
    arguments."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = SPECIAL_TOKENS + byte_chars
    # Like Gemma's <unusedN>: every model id decodes to something.
    tokens += [f"<unused{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    for token_id, token in (tokens_at or {}).items():
        tokens[token_id] = token
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                     use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", unk_token="<unk>", **special)


def save_servable(path: str | Path, geometry: str = "e2b",
                  multimodal: bool = True, seed: int = 0, bare: bool = False):
    """A model directory `vllm serve` accepts: tiny QAT checkpoint plus
    tokenizer (`bare`: see `save_checkpoint`). Returns the transformers
    model it was written from."""
    model = build_model(geometry, multimodal, seed)
    save_checkpoint(model, path, layout="qat", bare=bare)
    save_tokenizer(path)
    return model


def save_servable_int4(path: str | Path, form: str, geometry: str = "e2b",
                       multimodal: bool = True, seed: int = 0,
                       bare: bool = False):
    """`save_servable` for an int4 QAT export ("w4a16" or "q4_0", see
    `save_int4_checkpoint`). Returns the transformers model holding the
    exact dequantized weights."""
    model = build_model(geometry, multimodal, seed)
    grid = put_on_int4_grid(model, seed)
    save_int4_checkpoint(model, path, grid, form, bare=bare)
    save_tokenizer(path)
    return model
