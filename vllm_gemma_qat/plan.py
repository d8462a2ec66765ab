"""Memory plan: weights + KV cache for N agents x T tokens per TPU chip, on
one chip or a tensor-parallel slice (TP chips).

KV figures follow tpu-inference's cache layout: only non-shared layers hold
KV; per layer a token takes, on each chip, align(2 x kv_heads / TP, packing)
x head_dim padded as tpu-inference pads it (to 128; 64 stays) elements,
where packing is 32 bits / dtype bits (bf16: 2, fp8: 4) and kv_heads is
padded to a multiple of TP (E2B's one KV head is then held whole on every
chip).
Under TP, tpu-inference 0.32's Gemma 4 splits the attention and MLP
projections (heads, MLP width; K/V on head_dim when KV heads < TP) and both
embeddings (vocabulary) across the chips, and keeps the rest (norms, layer
scalars, the per-layer-input projections) whole on every chip; towers are
counted whole on every chip (an upper bound).
Under gemma_qat sliding layers keep only their window
(`fixes/sliding_window.py`, #3220): two sliding layers share a page of a full
layer's shape, vLLM groups those rows and the full layers into groups of one
page size, and one pool of blocks serves every group. The figures are vLLM
0.32's own: a block is `group size` pages of B tokens (tpu-inference's page
size, `tpu_page_size`); a request at context T holds cdiv(T, B) blocks per
full group and, per sliding group, what vLLM's concurrency figure counts
for it: cdiv(min(window - 1 + in-flight tokens, T), B) + 1, where the
in-flight tokens are 2 x --max-num-batched-tokens with async scheduling (an
upper bound: a request shorter than that holds cdiv(T, B)).
The Gemma 4 assistant (speculative decoding's MTP drafter) reads the
target's cache and adds no KV of its own (its k draft tokens a step add k
slots to what a decoding request holds ahead: not in the decoding figure);
tpu-inference 0.32 as it is keeps every layer at full context (the
`*_full_context` figures).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_gemma_qat.geometry import Geometry

# bf16 (vLLM's --kv-cache-dtype auto on a bf16 model) and the fp8 names of
# --kv-cache-dtype (tpu-inference: fp8 / fp8_e4m3 -> float8_e4m3fn, fp8_e5m2
# -> float8_e5m2). No int8: vLLM has no such cache dtype and tpu-inference's
# attention kernel refuses integer caches.
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# The cache's dtype: one of those, or fp32, what vLLM's kv_cache_dtype
# "auto" gives under --dtype float32 (compile for CPU mode's flags).
CACHE_DTYPE_BYTES = KV_DTYPE_BYTES | {"fp32": 4}
GIB = 1024**3
# vllm serve's --max-num-batched-tokens on a v6e (v5e: 512) and
# --max-num-seqs on a TPU.
MAX_NUM_BATCHED_TOKENS = 1024
MAX_NUM_SEQS = 256
SPLIT_UNDER_TP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                  "mlp.down_proj", "embed_tokens", "embed_tokens_per_layer")


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_head_dim(head_dim: int) -> int:
    """tpu-inference's get_padded_head_dim: 64 stays (its own kernel), the
    rest to a multiple of 128."""
    return 64 if head_dim == 64 else _align(head_dim, 128)


def tpu_page_size(max_model_len: int, max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """Tokens per KV page (vLLM's block) that tpu-inference 0.32 picks when
    --block-size is not given: PallasAttentionBackend.get_page_size (a 16th
    of --max-model-len, in [16, 256]; 16 past 8192 tokens), raised to its
    get_min_page_size (the kernel's page-index budget per sequence)."""
    def next_power_of_2(x: int) -> int:
        return 1 << (x - 1).bit_length()
    page = 16 if max_model_len > 8192 else min(
        256, max(16, next_power_of_2(max_model_len) // 16))
    pages_per_seq = 1024 * 1024 // 2 // max_num_seqs // 4
    return max(page, next_power_of_2(_cdiv(max_model_len, pages_per_seq)))


@dataclass(frozen=True)
class Layout:
    """How the KV pool is cut, per chip: blocks of `block_size` tokens and
    `block_bytes`, one pool for every group; a request holds blocks of each
    group."""
    block_size: int
    block_bytes: int
    full_groups: int
    sliding_groups: int = 0
    window: int = 0
    sliding_window: bool = False

    def blocks_per_agent(self, context: int, in_flight: int) -> int:
        """What vLLM's concurrency figure (and its admission of a new
        request) counts for a request at `context`."""
        full = self.full_groups * _cdiv(context, self.block_size)
        if not self.sliding_groups:
            return full
        held = min(self.window - 1 + in_flight, context)
        return full + self.sliding_groups * (_cdiv(held, self.block_size) + 1)

    def blocks_decoding(self, context: int, ahead: int) -> int:
        """What a request decoding at `context` holds at most, with `ahead`
        token slots allocated past its computed tokens: vLLM frees a
        sliding group's blocks wholly before its window, so a group holds
        the pages of window - 1 + ahead tokens at the worst alignment."""
        full = self.full_groups * _cdiv(context + ahead, self.block_size)
        if not self.sliding_groups:
            return full
        span = self.window - 1 + ahead
        window = min(_cdiv(context + ahead, self.block_size),
                     _cdiv(span - 1, self.block_size) + 1)
        return full + self.sliding_groups * window


def full_context_layout(geo: Geometry, kv_dtype: str, tp: int,
                        block_size: int) -> Layout:
    """tpu-inference 0.32: every KV-owning layer holds every token."""
    own = [i for i in range(geo.num_layers) if i not in geo.kv_share_map]
    return Layout(block_size, block_size * sum(kv_bytes_per_layer_token(
        geo, i, kv_dtype, tp) for i in own), full_groups=1)


def sliding_window_layout(geo: Geometry, kv_dtype: str, tp: int,
                          block_size: int) -> Layout | None:
    """gemma_qat's layout (fixes/sliding_window.py), or None where the
    sliding layers do not pack into the full layers' pages."""
    own = [i for i in range(geo.num_layers) if i not in geo.kv_share_map]
    sliding = [i for i in own if not geo.is_full(i)]
    full = [i for i in own if geo.is_full(i)]
    window = geo.text.get("sliding_window")
    if not (sliding and full and window):
        return None
    s_dim, f_dim = (padded_head_dim(geo.head_dim(i[0])) for i in (sliding, full))
    if geo.kv_heads(sliding[0]) != geo.kv_heads(full[0]) or f_dim % s_dim:
        return None
    rows = _cdiv(len(sliding), f_dim // s_dim)
    # vLLM's grouping of layers with one page size: groups of the smaller
    # count, or of the larger when it is under 1.5x the smaller.
    small, large = sorted((rows, len(full)))
    size = large if large < 1.5 * small else small
    page = block_size * kv_bytes_per_layer_token(geo, full[0], kv_dtype, tp)
    return Layout(block_size, size * page, full_groups=_cdiv(len(full), size),
                  sliding_groups=_cdiv(rows, size), window=window,
                  sliding_window=True)


def kv_bytes_per_layer_token(geo: Geometry, layer: int, kv_dtype: str,
                             tp: int = 1) -> int:
    """Bytes one token of `layer` takes on each chip."""
    nbytes = CACHE_DTYPE_BYTES[kv_dtype]
    packing = 4 // nbytes
    heads_per_chip = -(-geo.kv_heads(layer) // tp)
    return (_align(2 * heads_per_chip, packing) *
            padded_head_dim(geo.head_dim(layer)) * nbytes)


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


AUDIO_PREFIXES = (".audio_tower.", ".embed_audio.")
# Gemma4Processor's default audio_seq_length: 750 soft tokens of 40 ms
# (30 s) a clip at most.
AUDIO_SOFT_TOKENS = 750


def is_audio_tensor(name: str) -> bool:
    return any(p in name for p in AUDIO_PREFIXES)


def soft_tokens_per_clip(config: dict) -> int | None:
    """The most KV positions one audio clip takes: Gemma4Processor's
    default budget (AUDIO_SOFT_TOKENS) plus its begin / end-of-audio
    tokens. None without an audio tower."""
    if not config.get("audio_config"):
        return None
    return AUDIO_SOFT_TOKENS + 2


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
    audio_bytes: int = 0  # the part of other_bytes that is the audio tower

    def per_chip(self, geo: Geometry, form: str, tp: int,
                 dtype_bytes: int | None = None) -> tuple[int, int]:
        """(bytes in all, bytes on each chip); `form` "int4": linears as
        4-bit values + an f32 scale per 32 (as gemma_qat holds them:
        fixes/int4_scales.py); `dtype_bytes`: the other language-model
        tensors in the served dtype (None: as stored)."""
        linears = {m + ".weight" for m in geo.linear_modules("")}
        split = whole = 0
        for name, (nbytes, numel) in self.tensors.items():
            if form == "int4" and name in linears:
                nbytes = numel // 2 + 4 * (numel // 32)
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
    kv_bytes_per_token: int  # every KV-owning layer, full context
    agents: int
    context: int
    # What gemma_qat serves (sliding-window KV unless the geometry rules it
    # out): vLLM's pool of blocks and what a request at `context` holds of
    # it.
    kv_sliding_window: bool
    kv_block_size: int  # tokens per block (page)
    kv_block_bytes: int
    kv_pool_blocks: int
    kv_blocks_per_agent: int  # as vLLM's concurrency figure counts them
    # ... and what one holds while decoding (one token a step, two in
    # flight with async scheduling): after admission, up to
    # max_agents_decoding_at_context decode at once.
    kv_blocks_per_agent_decoding: int
    max_agents_decoding_at_context: int
    kv_total_bytes: int
    budget_bytes: int  # per chip; KV figures are per chip too
    # what vLLM logs as "TPU KV cache size" with --max-model-len = context
    kv_cache_tokens: int
    fits: bool
    max_agents_at_context: int
    max_context_for_agents: int
    # tpu-inference 0.32 as it is (every layer at full context)
    kv_total_bytes_full_context: int
    fits_full_context: bool
    max_agents_at_context_full_context: int
    max_context_for_agents_full_context: int
    context_limit: int | None  # the model's max_position_embeddings
    vision_tower_bytes: int  # whole on every chip
    tokens_per_image: int | None  # KV positions, boi / eoi included
    images_per_agent: int
    kv_bytes_per_image: int | None  # per chip
    assistant_bytes: int = 0  # in weight_bytes (and per chip, whole)
    audio_tower_bytes: int = 0  # whole on every chip
    tokens_per_audio_clip: int | None = None  # KV positions, boa / eoa too

    def as_dict(self) -> dict:
        return asdict(self)


def make_plan(geo: Geometry, weights: Weights, *, agents: int,
              context: int, kv_dtype: str = "bf16", hbm_gib: float = 32.0,
              utilization: float = 0.92, form: str = "bf16",
              tp: int = 1, tokens_per_image: int | None = None,
              tokens_per_audio_clip: int | None = None,
              images_per_agent: int = 0,
              dtype_bytes: int | None = None,
              max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
              max_num_seqs: int = MAX_NUM_SEQS,
              block_size: int | None = None,
              async_scheduling: bool = True,
              sliding_window: bool = True) -> Plan:
    """`utilization`: vLLM's --gpu-memory-utilization (its default 0.92);
    the budget is tpu-inference's: HBM x utilization - what the chip holds
    (the weights). `sliding_window` False: tpu-inference 0.32's own layout
    (every layer at full context), as stock serving allocates it."""
    own = [i for i in range(geo.num_layers) if i not in geo.kv_share_map]
    per_token = sum(kv_bytes_per_layer_token(geo, i, kv_dtype, tp)
                    for i in own)
    # vLLM's --max-model-len taken as `context`.
    block_size = block_size or tpu_page_size(context, max_num_seqs)
    layout = (sliding_window and sliding_window_layout(
        geo, kv_dtype, tp, block_size)) \
        or full_context_layout(geo, kv_dtype, tp, block_size)
    in_flight = (2 if async_scheduling else 1) * max_num_batched_tokens
    ahead = 2 if async_scheduling else 1  # decode slots allocated past it
    limit = geo.text.get("max_position_embeddings")

    def within_limit(tokens: int) -> int:
        return min(tokens, limit) if limit else tokens

    def blocks(t: int) -> int:
        return layout.blocks_per_agent(t, in_flight)

    in_range = not limit or context <= limit
    total, per_chip = weights.per_chip(geo, form, tp, dtype_bytes)
    budget = max(0, int(int(hbm_gib * GIB) * utilization - per_chip))
    pool = budget // layout.block_bytes
    usable = max(0, pool - 1)  # vLLM keeps block 0 as its null block
    longest = 0  # the longest context `agents` requests fit at once
    if agents and agents * blocks(1) <= usable:
        lo, hi = 1, within_limit(usable * block_size)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = ((mid, hi) if agents * blocks(mid) <= usable
                      else (lo, mid - 1))
        longest = lo
    return Plan(
        tp=tp,
        weight_bytes=total,
        weight_bytes_per_chip=per_chip,
        kv_bytes_per_token=per_token,
        agents=agents,
        context=context,
        kv_sliding_window=layout.sliding_window,
        kv_block_size=block_size,
        kv_block_bytes=layout.block_bytes,
        kv_pool_blocks=pool,
        kv_blocks_per_agent=blocks(context),
        kv_blocks_per_agent_decoding=layout.blocks_decoding(context, ahead),
        max_agents_decoding_at_context=usable // layout.blocks_decoding(
            context, ahead),
        kv_total_bytes=agents * blocks(context) * layout.block_bytes,
        budget_bytes=budget,
        kv_cache_tokens=int(pool / blocks(context) * context),
        fits=in_range and agents * blocks(context) <= usable,
        max_agents_at_context=usable // blocks(context),
        max_context_for_agents=longest,
        kv_total_bytes_full_context=agents * context * per_token,
        fits_full_context=in_range and agents * context * per_token <= budget,
        max_agents_at_context_full_context=budget // (context * per_token),
        max_context_for_agents_full_context=within_limit(
            budget // (agents * per_token)) if agents else 0,
        context_limit=limit,
        vision_tower_bytes=weights.vision_bytes,
        tokens_per_image=tokens_per_image,
        images_per_agent=images_per_agent,
        kv_bytes_per_image=tokens_per_image * per_token
        if tokens_per_image else None,
        assistant_bytes=weights.assistant_bytes,
        audio_tower_bytes=weights.audio_bytes,
        tokens_per_audio_clip=tokens_per_audio_clip,
    )
