"""Sliding-window-aware KV cache for Gemma 4 (tpu-inference #3220), under
--load-format gemma_qat only. Upstream patch: patches/0008-*.

tpu-inference 0.32 gives every Gemma 4 layer a full-context cache
(`KVCacheManager.get_kv_cache_spec` sets `sliding_window = None`): sliding
layers (window 512) hold every token of the context. vLLM frees a sliding
layer's blocks out of the window only for `SlidingWindowSpec` layers, and it
needs every group's page to be the same size; tpu-inference shares a cache
array only between layers of one shape. Gemma 4's sliding layers have half
the full layers' head dim (256 vs 512) and the same KV heads, so here two
sliding layers share one row of a full layer's shape: each cache row is
`[K/V of sliding layer a | K/V of sliding layer b]`.

- Specs: one `SlidingWindowSpec` per row (the full layers' page), the row's
  other layer and the KV-shared layers redirected to the row's owner. vLLM
  then groups rows and full layers at one page size and frees out-of-window
  blocks; per token the rows cost exactly what the sliding layers hold.
- Arrays: the groups' layers at one position share one array (vLLM lays out
  each group from byte 0; tpu-inference 0.32 gives a group of one layer its
  own array, which would allocate the budget once per group).
- Attention metadata: the redirected layers join their owner's group
  (`GroupedAttentionMetadata` keys), as vLLM's GPU runner adds KV-shared
  layers to their target's group.
- Attention: a sliding layer's q is zero-padded to the row and placed in its
  half, so its scores see only its half; its output is that half. The row's
  last layer writes the whole row, with the earlier layer's K/V of this step
  (kept while the model is traced), so every half ends up holding its own
  layer's K/V. Attention reads the whole row within the window (the cost:
  2x the sliding layers' bytes read per step, at most `window` tokens).

- The Gemma 4 assistant (MTP drafter): its layers read the target's last
  sliding and last full layer, which now sit in different groups, while
  tpu-inference's proposer hands it one block table (the last group's). Its
  attention metadata carries the block tables of the groups it reads,
  interleaved per request (`[group a | group b]` for each request, so the
  proposer's per-request handling of the table is unchanged), and each
  draft layer attends with its group's table, in its source's slot.

Off, as before (every layer keeps the full context, logged), with a
drafter other than the Gemma 4 assistant (EAGLE heads declare caches of
their own), under pipeline or decode-context parallelism, for
geometries whose head dims do not pack (sliding head dim not a divisor of
the full one, or different KV heads), on a tpu-inference release without
what this builds on (the tables are optional: a missing target leaves both
out), and on one that packs already (patches/0008 applied).
"""
from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import NamedTuple

from vllm.logger import init_logger

from vllm_gemma_qat import substitute
from vllm_gemma_qat.fixes.kv_share import building_for_gemma_qat
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

KV_CACHE_MODULE = "tpu_inference.runner.kv_cache_manager"
MODEL_MODULE = "tpu_inference.models.jax.gemma4"
DRAFTER_MODULE = "tpu_inference.models.jax.gemma4_mtp"
PROPOSER_MODULE = "tpu_inference.spec_decode.jax.eagle3"
LABEL = f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, sliding-window KV)"

# Under the "vllm" logger so the lines show in vLLM's own log output.
logger = init_logger(f"vllm.{__name__}")

# The RowPlace of the layer whose attention is being traced (None: not in a
# row).
_place = contextvars.ContextVar("gemma_qat_kv_row_place", default=None)
# K/V written to each row so far in the model call being traced.
_row_kv = contextvars.ContextVar("gemma_qat_kv_row_kv", default=None)
# What the drafter's layers of each kind read, set when the engine's KV cache
# is initialized (one model per engine process): "sliding" / "full" ->
# DraftRead.
_draft_reads: dict = {}
# The DraftRead of the draft layer whose attention is being traced.
_draft_read = contextvars.ContextVar("gemma_qat_draft_read", default=None)


def install() -> None:
    substitute.apply_on_import(KV_CACHE_MODULE, cache_substitutions, LABEL,
                               optional=True)
    substitute.apply_on_import(MODEL_MODULE, model_substitutions, LABEL,
                               optional=True)
    substitute.apply_on_import(DRAFTER_MODULE, drafter_substitutions, LABEL,
                               optional=True)
    substitute.apply_on_import(PROPOSER_MODULE, proposer_substitutions,
                               LABEL, optional=True)


class RowPlace(NamedTuple):
    owner: int  # the layer whose cache row this is
    slot: int  # which head-dim slice of the row
    slots: int  # slots per row


class DraftRead(NamedTuple):
    table: int  # which of the interleaved block tables
    tables: int  # how many are interleaved
    place: RowPlace | None  # None: a full layer's cache


@dataclass(frozen=True)
class RowLayout:
    """Which cache row each KV-owning sliding layer writes, and where."""
    slots_per_row: int
    place: dict  # sliding owner layer -> (row owner layer, slot)

    def source_place(self, share_map: dict, layer: int):
        """(row owner, slot) a layer's attention uses, or None (full)."""
        return self.place.get(share_map.get(layer, layer))


def row_layout(text_config) -> RowLayout | None:
    """Sliding layers packed into rows of the full layers' padded head dim,
    in layer order; None when the geometry does not pack."""
    from tpu_inference import utils
    from tpu_inference.models.common.kv_share import compute_kv_share_map
    if not hasattr(utils, "get_layer_kv_params"):  # before 0.28
        return None
    types = list(getattr(text_config, "layer_types", None) or ())
    window = getattr(text_config, "sliding_window", None)
    if not (window and "sliding_attention" in types
            and "full_attention" in types):
        return None
    sliding_dim, sliding_heads = utils.get_layer_kv_params(
        text_config, "sliding_attention")
    full_dim, full_heads = utils.get_layer_kv_params(text_config,
                                                     "full_attention")
    if not (sliding_dim and sliding_heads):
        return None
    # None: no per-type value (E2B's num_global_key_value_heads), so the
    # model-wide one, as get_kv_cache_spec falls back to.
    full_dim, full_heads = full_dim or sliding_dim, full_heads or sliding_heads
    sliding_dim = utils.get_padded_head_dim(sliding_dim)
    full_dim = utils.get_padded_head_dim(full_dim)
    if sliding_heads != full_heads or full_dim % sliding_dim:
        return None
    slots = full_dim // sliding_dim
    shared = compute_kv_share_map(text_config)
    owners = [i for i, t in enumerate(types)
              if t == "sliding_attention" and i not in shared]
    place = {layer: (owners[n - n % slots], n % slots)
             for n, layer in enumerate(owners)}
    return RowLayout(slots, place)


# ---------------------------------------------------------------- cache side

def cache_substitutions() -> list[Substitution]:
    return [
        Substitution(
            f"{KV_CACHE_MODULE}:KVCacheManager.get_kv_cache_spec",
            _row_specs, "#3220: a SlidingWindowSpec per row of sliding "
            "layers at the full layers' page; the rest of the row and the "
            "KV-shared layers redirected to the row's owner", wraps=True),
        Substitution(
            f"{KV_CACHE_MODULE}:KVCacheManager.initialize_kv_cache",
            _shared_arrays_and_groups, "#3220: the groups' layers at one "
            "position share one array; redirected layers join their "
            "owner's group", wraps=True),
    ]


def _upstream_packs() -> bool:
    """tpu-inference packs sliding layers itself (patches/0008 applied)."""
    from tpu_inference.models.common import kv_share
    return hasattr(kv_share, "compute_sliding_window_kv_rows")


def _installed(table: list[Substitution]) -> bool:
    try:
        return all(substitute.installed(s.target) for s in table)
    except substitute.MissingTarget:
        return False


def _model_side_installed() -> bool:
    return _installed(model_substitutions())


def _drafter_side_installed() -> bool:
    return _installed(drafter_substitutions() + proposer_substitutions())


def _full_context(why: str) -> None:
    logger.info("gemma_qat: sliding-window KV is off %s: every layer keeps "
                "the full context", why)


def _active_layout(manager) -> RowLayout | None:
    runner = manager.runner
    vllm_config = runner.vllm_config
    if not is_gemma_qat(vllm_config) or manager.use_mla:
        return None
    if vllm_config.compilation_config.static_forward_context:
        return None  # a torchax model: its Attention layers declare windows
    text = getattr(runner.model_config, "hf_text_config", None)
    if "gemma4" not in str(getattr(text, "model_type", "")):
        return None
    if _upstream_packs():
        logger.info("tpu-inference already packs sliding layers' KV "
                    "(#3220); vllm-gemma-qat leaves its KV cache as is")
        return None
    layout = row_layout(text)
    if layout is None:
        return None
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        _full_context("under pipeline parallelism")
    elif getattr(parallel, "decode_context_parallel_size", 1) > 1:
        _full_context("under decode context parallelism")
    elif not _model_side_installed():
        _full_context("(this tpu-inference's Gemma4Attention differs from "
                      "0.32's; the model side was not applied)")
    elif runner.speculative_config is None:
        return layout
    elif not runner.speculative_config.use_gemma4_mtp():
        _full_context("with a drafter other than the Gemma 4 assistant")
    elif not _drafter_side_installed():
        _full_context("with the Gemma 4 assistant (this tpu-inference's "
                      "drafter differs from 0.32's; the drafter side was "
                      "not applied)")
    else:
        return layout
    return None


def _row_specs(get_kv_cache_spec):

    @functools.wraps(get_kv_cache_spec)
    def wrapped(self):
        specs = get_kv_cache_spec(self)
        layout = _active_layout(self)
        self.gemma_qat_rows = layout
        if layout is None:
            return specs
        text = self.runner.model_config.hf_text_config
        full = next(specs[f"layer.{i}"] for i, t in enumerate(text.layer_types)
                    if t == "full_attention" and f"layer.{i}" in specs)
        window = text.sliding_window
        for layer, (owner, slot) in layout.place.items():
            name = f"layer.{layer}"
            if slot == 0:
                specs[name] = self._create_attention_spec(
                    full.block_size, full.num_kv_heads, full.head_size,
                    sliding_window=window)
            else:
                del specs[name]
                self.shared_kv_cache_layers[name] = f"layer.{owner}"
        self.gemma_qat_draft_places = {}
        for name, source in list(self.shared_kv_cache_layers.items()):
            place = layout.place.get(int(source.split(".")[1]))
            if name.startswith("draft_layer."):  # the assistant's layers
                self.gemma_qat_draft_places[name] = (
                    None if place is None
                    else RowPlace(*place, layout.slots_per_row))
            if place is not None:
                self.shared_kv_cache_layers[name] = f"layer.{place[0]}"
        rows = sum(1 for _, slot in layout.place.values() if slot == 0)
        logger.info(
            "gemma_qat: sliding-window KV (#3220): %d sliding layers in %d "
            "rows of %d, window %d; full layers keep the context",
            len(layout.place), rows, layout.slots_per_row, window)
        return specs

    return wrapped


def _shared_arrays_and_groups(initialize_kv_cache):

    @functools.wraps(initialize_kv_cache)
    def wrapped(self, kv_cache_config):
        if getattr(self, "gemma_qat_rows", None) is None \
                or len(kv_cache_config.kv_cache_groups) < 2:
            return initialize_kv_cache(self, kv_cache_config)
        from vllm.v1.kv_cache_interface import KVCacheTensor
        groups = kv_cache_config.kv_cache_groups
        pages = {g.kv_cache_spec.page_size_bytes for g in groups}
        assert len(pages) == 1, pages  # every spec was declared at one page
        page = pages.pop()
        width = max(len(g.layer_names) for g in groups)
        # One tensor per position, listing the layer of each group there,
        # aliased (layer_stride 0): a block id belongs to one group at a
        # time, so they share one array.
        kv_cache_config.kv_cache_tensors = [
            KVCacheTensor(size=page * kv_cache_config.num_blocks, layers=[
                g.layer_names[j] for g in groups if j < len(g.layer_names)],
                layer_stride=0, block_stride=page)
            for j in range(width)]
        initialize_kv_cache(self, kv_cache_config)
        # The runner builds GroupedAttentionMetadata from the groups' layer
        # names (after this call): a redirected layer needs its owner's key.
        group_of = {name: g for g in groups for name in g.layer_names}
        for name, owner in self.shared_kv_cache_layers.items():
            if name not in group_of and owner in group_of:
                group_of[owner].layer_names.append(name)
        _read_for_the_drafter(self, groups)

    return wrapped


def _read_for_the_drafter(manager, groups) -> None:
    """Which block tables the assistant's layers read (the groups of its
    sources), and where: `manager.gemma_qat_draft_groups` for the proposer,
    `_draft_reads` for the draft layers' attention."""
    _draft_reads.clear()
    places = getattr(manager, "gemma_qat_draft_places", {})
    gid = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    used = sorted({gid[name] for name in places})
    manager.gemma_qat_draft_groups = used
    for name, place in places.items():
        kind = "full" if place is None else "sliding"
        read = DraftRead(used.index(gid[name]), len(used), place)
        # Every draft layer of a kind reads the target's last layer of that
        # kind (kv_share.compute_mtp_kv_share_map).
        assert _draft_reads.setdefault(kind, read) == read, (kind, read)


# ---------------------------------------------------------------- model side

def model_substitutions() -> list[Substitution]:
    return [
        Substitution(f"{MODEL_MODULE}:Gemma4Attention.__init__",
                     _knowing_its_row, "#3220: a sliding layer knows its "
                     "row and slot in a packed cache", wraps=True),
        Substitution(f"{MODEL_MODULE}:Gemma4Attention.__call__",
                     _in_its_place, "#3220: the layer's place is known "
                     "while its attention is traced", wraps=True),
        Substitution(f"{MODEL_MODULE}:Gemma4Model.__call__",
                     _with_row_kv, "#3220: each model call keeps the K/V "
                     "it writes to a row until the row's last layer",
                     wraps=True),
        Substitution(f"{MODEL_MODULE}:attention", _row_attention,
                     "#3220: a sliding layer attends in its slot of a "
                     "packed row", wraps=True),
    ]


def _knowing_its_row(init):

    @functools.wraps(init)
    def __init__(self, config, layer_idx, *args, **kwargs):
        init(self, config, layer_idx, *args, **kwargs)
        from tpu_inference.models.common.kv_share import compute_kv_share_map
        layout = (row_layout(config) if self.is_sliding
                  and building_for_gemma_qat() and not _upstream_packs()
                  else None)
        place = layout and layout.source_place(compute_kv_share_map(config),
                                               layer_idx)
        self.gemma_qat_row_place = (
            None if place is None else RowPlace(*place, layout.slots_per_row))

    return __init__


def _holding(var: contextvars.ContextVar, value_of):
    """A wrapper for a method: `var` holds `value_of(self)` while it runs."""

    def wrap(call):

        @functools.wraps(call)
        def __call__(self, *args, **kwargs):
            token = var.set(value_of(self))
            try:
                return call(self, *args, **kwargs)
            finally:
                var.reset(token)

        return __call__

    return wrap


_in_its_place = _holding(
    _place, lambda layer: getattr(layer, "gemma_qat_row_place", None))
_with_row_kv = _holding(_row_kv, lambda model: {})


def _row_attention(attention):

    @functools.wraps(attention)
    def wrapped(kv_cache, q, k, v, *args, update_kv_cache=True, **kwargs):
        place = _place.get()
        if place is None or kv_cache is None \
                or kv_cache.shape[-1] == q.shape[-1]:
            return attention(kv_cache, q, k, v, *args,
                             update_kv_cache=update_kv_cache, **kwargs)
        import jax.numpy as jnp
        owner, slot, slots = place
        dim = q.shape[-1]
        assert kv_cache.shape[-1] == slots * dim, (kv_cache.shape, q.shape)

        def in_slot(x, before=()):
            after = jnp.zeros((*x.shape[:-1], (slots - slot - 1) * dim),
                              x.dtype)
            if not before:
                before = [jnp.zeros((*x.shape[:-1], slot * dim), x.dtype)]
            return jnp.concatenate([*before, x, after], axis=-1)

        if update_kv_cache:
            # This layer's K/V after the earlier layers' of the row: the
            # row's last layer writes every slot.
            written = _row_kv.get().setdefault(owner, [])
            assert len(written) == slot, (owner, slot, len(written))
            k_row = in_slot(k, [kk for kk, _ in written])
            v_row = in_slot(v, [vv for _, vv in written])
            written.append((k, v))
        else:  # KV-shared: the kernel reads the cache only
            k_row, v_row = in_slot(k), in_slot(v)
        new_cache, out = attention(kv_cache, in_slot(q), k_row, v_row, *args,
                                   update_kv_cache=update_kv_cache, **kwargs)
        return new_cache, out[..., slot * dim:(slot + 1) * dim]

    return wrapped


# -------------------------------------------------------------- drafter side

def drafter_substitutions() -> list[Substitution]:
    return [
        Substitution(f"{DRAFTER_MODULE}:Gemma4MTPAttention.__call__",
                     _reading_its_source, "#3220: a draft layer reads the "
                     "block table and slot of the target layer it shares",
                     wraps=True),
        Substitution(f"{DRAFTER_MODULE}:attention", _draft_attention,
                     "#3220: a draft layer attends with its group's block "
                     "table, in its source's slot of a packed row",
                     wraps=True),
    ]


def proposer_substitutions() -> list[Substitution]:
    return [Substitution(
        f"{PROPOSER_MODULE}:Eagle3Proposer.propose", _with_drafter_tables,
        "#3220: the drafter gets the block tables of every group it reads "
        "(interleaved per request), not only the last group's", wraps=True)]


_reading_its_source = _holding(
    _draft_read,
    lambda layer: _draft_reads.get("sliding" if layer.is_sliding else "full"))


def _draft_attention(attention):
    in_row = _row_attention(attention)

    @functools.wraps(attention)
    def wrapped(kv_cache, q, k, v, md, *args, **kwargs):
        read = _draft_read.get()
        if read is None:
            return attention(kv_cache, q, k, v, md, *args, **kwargs)
        from dataclasses import replace
        num_reqs = md.seq_lens.shape[0]
        tables = md.block_tables.reshape(num_reqs, read.tables, -1)
        md = replace(md, block_tables=tables[:, read.table].reshape(-1))
        token = _place.set(read.place)
        try:
            return in_row(kv_cache, q, k, v, md, *args, **kwargs)
        finally:
            _place.reset(token)

    return wrapped


def _with_drafter_tables(propose):
    import inspect
    signature = inspect.signature(propose)

    @functools.wraps(propose)
    def wrapped(self, *args, **kwargs):
        groups = getattr(self.runner.kv_cache_manager,
                         "gemma_qat_draft_groups", None)
        if not groups:
            return propose(self, *args, **kwargs)
        import numpy as np
        from dataclasses import replace
        from jax.sharding import PartitionSpec
        from tpu_inference.layers.common.sharding import ShardingAxisName
        from tpu_inference.utils import device_array
        bound = signature.bind(self, *args, **kwargs)
        block_table = self.runner.input_batch.block_table
        tables = np.stack([block_table[g].get_cpu_tensor() for g in groups],
                          axis=1).reshape(-1)
        bound.arguments["attn_metadata"] = replace(
            bound.arguments["attn_metadata"], block_tables=device_array(
                self.mesh, tables,
                sharding=PartitionSpec(ShardingAxisName.ATTN_DATA)))
        return propose(*bound.args, **bound.kwargs)

    return wrapped
