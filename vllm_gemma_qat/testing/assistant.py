"""A tiny Gemma 4 assistant (MTP drafter) for a tiny target, and the
reference draft-and-verify loop that tpu-inference's drafter runs.

transformers' `Gemma4AssistantForCausalLM` (model_type `gemma4_assistant`):
every layer KV-shared and Q-only, reading the target's cache (the last
owner layer of each attention type); head dims, KV heads and window equal
the target's; `pre_projection` takes [target embedding of a token, target
hidden state] (2 x `backbone_hidden_size`), `post_projection` gives the next
step's hidden state.

How tpu-inference 0.32 feeds it (`spec_decode/jax/eagle3.py` with
`use_gemma4_mtp()`, `models/jax/gemma4_mtp.py`), per request after a target
step that accepted tokens up to position p and sampled the bonus token b at
p + 1:

- draft 1: token b, the target's final (normed) hidden state at p, query
  position p, the target's cache over positions 0..p;
- draft j > 1: token draft j-1, the previous draft step's `post_projection`
  output, the SAME position p and cache (constant draft positions).

`draft_and_verify` replays that with transformers' modules (greedy,
float64), and counts what vLLM's spec-decode metrics count.
"""
from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURE = "Gemma4AssistantForCausalLM"


def assistant_config(target_text: dict, hidden_size: int = 64,
                     intermediate_size: int = 128,
                     use_ordered_embeddings: bool = False,
                     num_centroids: int = 16,
                     centroid_intermediate_top_k: int = 4, **text_overrides):
    """A `Gemma4AssistantConfig` for a target with text config `target_text`
    (a dict): one sliding and one full layer, both KV-shared, the target's
    head dims, KV heads, window, vocabulary and query heads."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig
    keep = ("vocab_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "global_head_dim", "sliding_window",
            "final_logit_softcapping", "rms_norm_eps", "max_position_embeddings",
            "attention_bias", "attention_k_eq_v", "bos_token_id",
            "eos_token_id", "pad_token_id", "rope_parameters",
            "num_global_key_value_heads")
    text = {k: target_text[k] for k in keep if target_text.get(k) is not None}
    # The full-attention layers' head dim / KV heads (kept per layer by
    # transformers >= 5.15) are the target's, from its geometry.
    from vllm_gemma_qat.geometry import Geometry
    geo = Geometry.from_text_config(target_text)
    full = geo.layer_types.index("full_attention")
    text.update(global_head_dim=geo.head_dim(full),
                num_global_key_value_heads=geo.kv_heads(full))
    text.update(hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=2, num_kv_shared_layers=2,
                layer_types=["sliding_attention", "full_attention"],
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                use_double_wide_mlp=False, enable_moe_block=False,
                tie_word_embeddings=True)
    text.update(text_overrides)
    config = Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**text).to_dict(),
        backbone_hidden_size=target_text["hidden_size"],
        use_ordered_embeddings=use_ordered_embeddings,
        num_centroids=num_centroids,
        centroid_intermediate_top_k=centroid_intermediate_top_k,
        tie_word_embeddings=True)
    config.architectures = [ARCHITECTURE]
    return config


def build(target_text: dict, seed: int = 0, **kwargs):
    """A random assistant for the target (fp32, eval mode)."""
    import torch
    from transformers import Gemma4AssistantForCausalLM
    torch.manual_seed(seed)
    config = assistant_config(target_text, **kwargs)
    config._attn_implementation = "eager"
    model = Gemma4AssistantForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                p.uniform_(0.5, 1.5)
        if model.masked_embedding is not None:
            v = config.get_text_config().vocab_size
            model.masked_embedding.token_ordering.copy_(
                torch.randperm(v, generator=torch.Generator().manual_seed(seed)))
    return model.eval()


def save(model, path: str | Path, dtype=None) -> Path:
    """`model` as a checkpoint directory (transformers' own layout and
    config.json), its values as `dtype` (default: as held)."""
    path = Path(path)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def target_text_config(target_dir: str | Path) -> dict:
    config = json.loads(Path(target_dir, "config.json").read_text())
    return config.get("text_config") or config
