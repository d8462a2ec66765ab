"""Memory plan: weights + KV cache for N agents x T tokens per TPU chip, on
one chip or a tensor-parallel slice (TP chips).

KV figures follow tpu-inference's cache layout: only non-shared layers hold
KV; per layer a token takes, on each chip, align(2 x kv_heads / TP, packing)
x align(head_dim, 128) elements, where packing is 32 bits / dtype bits (bf16:
2, fp8: 4) and kv_heads is padded to a multiple of TP (E2B's one KV
head is then held whole on every chip).
Under TP, tpu-inference 0.32's Gemma 4 splits the attention and MLP
projections (heads, MLP width; K/V on head_dim when KV heads < TP) and both
embeddings (vocabulary) across the chips, and keeps the rest (norms, layer
scalars, the per-layer-input projections) whole on every chip; towers are
counted whole on every chip (an upper bound).
tpu-inference sizes sliding-window layers like full ones; the SWA-aware
figure caps them at the window, which is what sliding-window-aware caching
would buy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_gemma_qat.geometry import Geometry

# bf16 (vLLM's --kv-cache-dtype auto on a bf16 model) and the fp8 names of
# --kv-cache-dtype (tpu-inference: fp8 / fp8_e4m3 -> float8_e4m3fn, fp8_e5m2
# -> float8_e5m2). No int8: vLLM has no such cache dtype and tpu-inference's
# attention kernel refuses integer caches.
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
GIB = 1024**3
SPLIT_UNDER_TP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                  "mlp.down_proj", "embed_tokens", "embed_tokens_per_layer")


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def kv_bytes_per_layer_token(geo: Geometry, layer: int, kv_dtype: str,
                             tp: int = 1) -> int:
    """Bytes one token of `layer` takes on each chip."""
    nbytes = KV_DTYPE_BYTES[kv_dtype]
    packing = 4 // nbytes
    heads_per_chip = -(-geo.kv_heads(layer) // tp)
    return (_align(2 * heads_per_chip, packing) *
            _align(geo.head_dim(layer), 128) * nbytes)


def split_under_tp(name: str) -> bool:
    """Whether tensor parallelism splits this language-model weight."""
    return name.removesuffix(".weight").endswith(SPLIT_UNDER_TP)


VISION_PREFIXES = (".vision_tower.", ".embed_vision.")


def is_vision_tensor(name: str) -> bool:
    return any(p in name for p in VISION_PREFIXES)


def soft_tokens_per_image(config: dict) -> int | None:
    """The most KV positions one image takes: the vision tower's
    `default_output_length` soft tokens (vLLM's Gemma 4 budgets each image
    at that), plus its begin / end-of-image tokens. None without a vision
    tower."""
    vision = config.get("vision_config")
    if not vision:
        return None
    return vision.get("default_output_length", 280) + 2


@dataclass(frozen=True)
class Weights:
    """What the chips hold: language-model tensors (name relative to the
    language model -> (bytes as loaded, elements)) and other bytes (towers)."""
    tensors: dict[str, tuple[int, int]]
    other_bytes: int = 0
    vision_bytes: int = 0  # the part of other_bytes that is the vision tower
    other_numel: int = 0  # elements of other_bytes (0: unknown)
    # A speculative-decoding assistant (MTP drafter), in the served dtype,
    # counted whole on every chip (an upper bound under TP). It holds no KV
    # of its own: its layers read the target's cache.
    assistant_bytes: int = 0

    def per_chip(self, geo: Geometry, form: str, tp: int,
                 dtype_bytes: int | None = None) -> tuple[int, int]:
        """(bytes in all, bytes on each chip); `form` "int4": linears as
        4-bit values + a bf16 scale per 32; `dtype_bytes`: the other
        language-model tensors in the served dtype (None: as stored)."""
        linears = {m + ".weight" for m in geo.linear_modules("")}
        split = whole = 0
        for name, (nbytes, numel) in self.tensors.items():
            if form == "int4" and name in linears:
                nbytes = numel // 2 + 2 * (numel // 32)
            elif dtype_bytes:
                nbytes = numel * dtype_bytes
            if split_under_tp(name):
                split += nbytes
            else:
                whole += nbytes
        # The towers are served in --dtype too (fixes/weight_dtype.py).
        whole += self.other_numel * dtype_bytes \
            if dtype_bytes and self.other_numel else self.other_bytes
        whole += self.assistant_bytes
        return split + whole, -(-split // tp) + whole


@dataclass
class Plan:
    tp: int
    weight_bytes: int  # in all
    weight_bytes_per_chip: int
    kv_bytes_per_token: int
    kv_bytes_per_token_swa_full_layers: int
    kv_bytes_per_agent_swa: int
    agents: int
    context: int
    kv_total_bytes: int
    kv_total_bytes_swa: int
    budget_bytes: int  # per chip; KV figures are per chip too
    kv_cache_tokens: int  # what vLLM logs as "TPU KV cache size" (to a page)
    fits: bool
    fits_swa: bool
    max_agents_at_context: int
    max_agents_at_context_swa: int
    max_context_for_agents: int
    max_context_for_agents_swa: int
    context_limit: int | None  # the model's max_position_embeddings
    vision_tower_bytes: int  # whole on every chip
    tokens_per_image: int | None  # KV positions, boi / eoi included
    images_per_agent: int
    kv_bytes_per_image: int | None  # per chip
    assistant_bytes: int = 0  # in weight_bytes (and per chip, whole)

    def as_dict(self) -> dict:
        return asdict(self)


def make_plan(geo: Geometry, weights: Weights, *, agents: int,
              context: int, kv_dtype: str = "bf16", hbm_gib: float = 32.0,
              utilization: float = 0.92, form: str = "bf16",
              tp: int = 1, tokens_per_image: int | None = None,
              images_per_agent: int = 0,
              dtype_bytes: int | None = None) -> Plan:
    """`utilization`: vLLM's --gpu-memory-utilization (its default 0.92);
    the budget is tpu-inference's: HBM x utilization - what the chip holds
    (the weights)."""
    own = [i for i in range(geo.num_layers) if i not in geo.kv_share_map]
    per_layer = {i: kv_bytes_per_layer_token(geo, i, kv_dtype, tp)
                 for i in own}
    per_token = sum(per_layer.values())
    window = geo.text.get("sliding_window") or 0
    sliding = [i for i in own if geo.layer_types[i] == "sliding_attention"]
    full_per_token = per_token - sum(per_layer[i] for i in sliding)
    sliding_per_token = per_token - full_per_token

    def swa_agent(t: int) -> int:
        return t * full_per_token + min(t, window) * sliding_per_token

    limit = geo.text.get("max_position_embeddings")

    def within_limit(tokens: int) -> int:
        return min(tokens, limit) if limit else tokens

    in_range = not limit or context <= limit
    total, per_chip = weights.per_chip(geo, form, tp, dtype_bytes)
    budget = max(0, int(int(hbm_gib * GIB) * utilization - per_chip))
    max_ctx_swa = 0
    if agents:
        cap = budget // agents
        if cap < swa_agent(window):  # below the window every layer grows
            max_ctx_swa = cap // per_token
        else:
            max_ctx_swa = (cap - window * sliding_per_token) // full_per_token
    return Plan(
        tp=tp,
        weight_bytes=total,
        weight_bytes_per_chip=per_chip,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_swa_full_layers=full_per_token,
        kv_bytes_per_agent_swa=swa_agent(context),
        agents=agents,
        context=context,
        kv_total_bytes=agents * context * per_token,
        kv_total_bytes_swa=agents * swa_agent(context),
        budget_bytes=budget,
        kv_cache_tokens=budget // per_token,
        fits=in_range and agents * context * per_token <= budget,
        fits_swa=in_range and agents * swa_agent(context) <= budget,
        max_agents_at_context=budget // (context * per_token) if context else 0,
        max_agents_at_context_swa=budget // swa_agent(context) if context else 0,
        max_context_for_agents=within_limit(budget // (agents * per_token))
        if agents else 0,
        max_context_for_agents_swa=within_limit(max_ctx_swa),
        context_limit=limit,
        vision_tower_bytes=weights.vision_bytes,
        tokens_per_image=tokens_per_image,
        images_per_agent=images_per_agent,
        kv_bytes_per_image=tokens_per_image * per_token
        if tokens_per_image else None,
        assistant_bytes=weights.assistant_bytes,
    )
