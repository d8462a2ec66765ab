"""compressed-tensors int4 schemes, header-only: which modules a
`quantization_config` quantizes, matched as vLLM and tpu-inference match
them, and the w4a16 config that serves a q4_0 export as int4.

tpu-inference's JAX compressed-tensors config skips a layer whose name
matches an `ignore` entry, then quantizes it if a target matches its name or
is the class name "Linear". Names are module paths as in the checkpoint
(`model.language_model.layers.0.self_attn.q_proj`); tpu-inference's layer
prefixes are the same paths. Entries starting with "re:" are regexes
(`re.match`), others must be equal.
"""
from __future__ import annotations

import re

GROUP_SIZE = 32
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
# What the published recipe of Google's -qat-w4a16-ct exports keeps in bf16;
# embeddings are not Linear modules, so "Linear" never selects them.
W4A16_IGNORE = ("lm_head", "re:.*vision_tower.*", "re:.*embed_vision.*",
                "re:.*audio_tower.*", "re:.*embed_audio.*")


def matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def is_compressed_tensors(quantization_config) -> bool:
    return (isinstance(quantization_config, dict) and
            quantization_config.get("quant_method") == "compressed-tensors")


def targets(quantization_config: dict) -> list[str]:
    return [t for group in (quantization_config.get("config_groups") or {})
            .values() if isinstance(group, dict)
            for t in group.get("targets") or []]


def quantizes(quantization_config: dict, module: str) -> bool:
    """Whether `quantization_config` quantizes the linear layer `module`."""
    ignore = quantization_config.get("ignore") or []
    if any(matches(module, pattern) for pattern in ignore):
        return False
    return any(t == "Linear" or matches(module, t)
               for t in targets(quantization_config))


def w4a16_quantization_config(ignore=(), group_size: int = GROUP_SIZE) -> dict:
    """The w4a16 export's scheme (pack-quantized, symmetric int4, group 32,
    every Linear but `W4A16_IGNORE`), plus `ignore`: as --hf-overrides it
    selects tpu-inference's wNa16 linear method for a q4_0 bf16 export."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                            "strategy": "group", "group_size": group_size,
                            "dynamic": False, "actorder": None,
                            "observer": "minmax"},
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": [*W4A16_IGNORE, *ignore],
        "kv_cache_scheme": None,
    }
