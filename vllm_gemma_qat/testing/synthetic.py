"""Full-size Gemma 4 E2B / E4B configs (public config.json values) and
header-only checkpoints for them: a real safetensors header followed by a
sparse data section, so a ~10 GB checkpoint costs a few KiB of disk. Used by
the preflight tests and the inspect benchmark."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from vllm_gemma_qat import quantization
from vllm_gemma_qat.checkpoint import DTYPE_BYTES, numel
from vllm_gemma_qat.geometry import Geometry


def _text_config(hidden, intermediate, layers, shared, kv_heads, block,
                 double_wide):
    n_sliding, n_full = block
    pattern = ["sliding_attention"] * n_sliding + ["full_attention"] * n_full
    return {
        "model_type": "gemma4_text", "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144, "hidden_size": hidden,
        "hidden_size_per_layer_input": 256, "intermediate_size": intermediate,
        "use_double_wide_mlp": double_wide, "num_hidden_layers": layers,
        "num_kv_shared_layers": shared, "num_attention_heads": 8,
        "num_key_value_heads": kv_heads, "head_dim": 256,
        "global_head_dim": 512, "attention_k_eq_v": False,
        "attention_bias": False, "sliding_window": 512,
        "layer_types": (pattern * layers)[:layers],
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    }


# The multimodal architecture builds its vision tower from vision_config:
# the fields the header checks and plan read (the tower's width, the soft
# tokens per image).
_VISION_CONFIG = {"model_type": "gemma4_vision", "hidden_size": 768,
                  "default_output_length": 280}

CONFIGS = {
    "e2b": {"architectures": ["Gemma4ForConditionalGeneration"],
            "model_type": "gemma4", "tie_word_embeddings": True,
            "text_config": _text_config(1536, 6144, 35, 20, 1, (4, 1), True),
            "vision_config": _VISION_CONFIG},
    "e4b": {"architectures": ["Gemma4ForConditionalGeneration"],
            "model_type": "gemma4", "tie_word_embeddings": True,
            "text_config": _text_config(2560, 10240, 42, 18, 2, (5, 1), False),
            "vision_config": _VISION_CONFIG},
}

# A few tower tensors, with their own k_proj: shared-layer filters must not
# touch them.
_TOWER_TENSORS = {
    "model.vision_tower.encoder.layers.0.self_attn.k_proj.linear.weight": (768, 768),
    "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight": (768, 768),
    "model.audio_tower.layers.0.self_attn.k_proj.linear.weight": (1024, 1024),
    "model.embed_vision.embedding_projection.weight": (1536, 768),
}


def checkpoint_tensors(name: str, layout: str) -> dict[str, tuple[str, tuple]]:
    """{tensor name: (dtype, shape)} of a `layout` export of E2B / E4B:
    "regular" (BF16, shared-layer K/V included), "qat" (bf16, without them),
    "w4a16" (compressed-tensors pack-quantized linears, without them)."""
    config = CONFIGS[name]
    geo = Geometry.from_text_config(config["text_config"])
    prefix = "model.language_model."
    shapes = dict(geo.expected(prefix))
    if layout == "regular":
        shapes.update(geo.skippable(prefix))
    shapes.update({k: v for k, v in _TOWER_TENSORS.items()
                   if "embed_vision" not in k or config["text_config"][
                       "hidden_size"] == v[0]})
    linears = set(geo.linear_modules(prefix)) if layout == "w4a16" else set()
    out = {}
    for tensor, shape in shapes.items():
        base = tensor.removesuffix(".weight")
        if base in linears:
            out[base + ".weight_packed"] = ("I32", (shape[0], shape[1] // 8))
            out[base + ".weight_scale"] = ("BF16", (shape[0], shape[1] // 32))
            out[base + ".weight_shape"] = ("I64", (2, ))
        else:
            out[tensor] = ("BF16", shape)
    return out


def write_header_only(path: str | Path, name: str = "e2b", layout: str = "qat",
                      shards: int = 2, exclude=(), extra=None) -> Path:
    """A checkpoint directory whose shards hold real headers and sparse data
    (`exclude`: tensor names to leave out; `extra`: {name: (dtype, shape)}
    to add)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(CONFIGS[name]))
    if layout == "w4a16":
        config["quantization_config"] = \
            quantization.w4a16_quantization_config()
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tensors = checkpoint_tensors(name, layout) | (extra or {})
    tensors = sorted((k, v) for k, v in tensors.items() if k not in exclude)
    per_shard = -(-len(tensors) // shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = tensors[s * per_shard:(s + 1) * per_shard]
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for tensor, (dtype, shape) in chunk:
            size = DTYPE_BYTES[dtype] * numel(shape)
            header[tensor] = {"dtype": dtype, "shape": list(shape),
                              "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[tensor] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)  # sparse: no data written
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
