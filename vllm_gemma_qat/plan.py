"""Memory plan: weights + KV cache for N agents x T tokens on one TPU.

KV figures follow tpu-inference's cache layout: only non-shared layers hold
KV; per layer a token takes align(2 x kv_heads, packing) x align(head_dim,
128) elements, where packing is 32 bits / dtype bits (bf16: 2, fp8/int8: 4).
tpu-inference sizes sliding-window layers like full ones; the SWA-aware
figure caps them at the window, which is what sliding-window-aware caching
would buy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_gemma_qat.geometry import Geometry

KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1, "int8": 1}
GIB = 1024**3


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def kv_bytes_per_layer_token(geo: Geometry, layer: int, kv_dtype: str) -> int:
    nbytes = KV_DTYPE_BYTES[kv_dtype]
    packing = 4 // nbytes
    return (_align(2 * geo.kv_heads(layer), packing) *
            _align(geo.head_dim(layer), 128) * nbytes)


def linear_params(geo: Geometry) -> int:
    """Parameters of the language model's Linear layers (what the w4a16
    export quantizes)."""
    shapes = geo.expected("")
    return sum(shapes[m + ".weight"][0] * shapes[m + ".weight"][1]
               for m in geo.linear_modules(""))


def weight_bytes(geo: Geometry, bf16_bytes: int, weights: str) -> int:
    """`bf16_bytes` as loaded; with int4, linears become 4-bit + a bf16
    scale per 32 weights."""
    if weights == "bf16":
        return bf16_bytes
    n = linear_params(geo)
    return bf16_bytes - 2 * n + n // 2 + 2 * (n // 32)


@dataclass
class Plan:
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_token_swa_full_layers: int
    kv_bytes_per_agent_swa: int
    agents: int
    context: int
    kv_total_bytes: int
    kv_total_bytes_swa: int
    budget_bytes: int
    fits: bool
    fits_swa: bool
    max_agents_at_context: int
    max_agents_at_context_swa: int
    max_context_for_agents: int
    max_context_for_agents_swa: int
    context_limit: int | None  # the model's max_position_embeddings

    def as_dict(self) -> dict:
        return asdict(self)


def make_plan(geo: Geometry, bf16_weight_bytes: int, *, agents: int,
              context: int, kv_dtype: str = "bf16", hbm_gib: float = 32.0,
              utilization: float = 0.9, weights: str = "bf16") -> Plan:
    own = [i for i in range(geo.num_layers) if i not in geo.kv_share_map]
    per_layer = {i: kv_bytes_per_layer_token(geo, i, kv_dtype) for i in own}
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
    w = weight_bytes(geo, bf16_weight_bytes, weights)
    budget = max(0, int(hbm_gib * GIB * utilization) - w)
    max_ctx_swa = 0
    if agents:
        cap = budget // agents
        if cap < swa_agent(window):  # below the window every layer grows
            max_ctx_swa = cap // per_token
        else:
            max_ctx_swa = (cap - window * sliding_per_token) // full_per_token
    return Plan(
        weight_bytes=w,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_swa_full_layers=full_per_token,
        kv_bytes_per_agent_swa=swa_agent(context),
        agents=agents,
        context=context,
        kv_total_bytes=agents * context * per_token,
        kv_total_bytes_swa=agents * swa_agent(context),
        budget_bytes=budget,
        fits=in_range and agents * context * per_token <= budget,
        fits_swa=in_range and agents * swa_agent(context) <= budget,
        max_agents_at_context=budget // (context * per_token) if context else 0,
        max_agents_at_context_swa=budget // swa_agent(context) if context else 0,
        max_context_for_agents=within_limit(budget // (agents * per_token))
        if agents else 0,
        max_context_for_agents_swa=within_limit(max_ctx_swa),
        context_limit=limit,
    )
