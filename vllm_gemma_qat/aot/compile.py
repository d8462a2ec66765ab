"""`vllm-gemma-qat compile`: tpu-inference's Gemma 4, built as `vllm serve
MODEL --load-format gemma_qat` would build it for the given flags, compiled
by libtpu for a TPU topology on a machine without one.

What it runs is tpu-inference's own code: the `VllmConfig` from vLLM's
`EngineArgs` (as `vllm serve` parses the flags), the mesh from
`utils.make_optimized_mesh` over the topology's devices, the model from
`model_loader.get_model` (its construction and sharding; no weights: see
the substitutions in `__init__.py`), the KV cache from
`kv_cache.create_kv_caches` with the pages tpu-inference would allocate,
token and request buckets from the runner's own helpers, and the step jit
that `get_flax_model` builds (with its compiler options). Each start-up
program the runner compiles for text serving is lowered and compiled for
the target: the step per (token bucket, request bucket), as
`_precompile_backbone_text_only`; `compute_logits` and `sample` (with and
without sampling parameters and logprobs) per request bucket, as
`_precompile_compute_logits` / `_precompile_sampling`. With `--assistant
DIR` (`--speculative-config '{"model": DIR, "num_speculative_tokens":
k}'`): the Gemma 4 assistant as tpu-inference's `Eagle3Proposer.load_model`
builds it (the target's embedding shared), and per (token bucket, request
bucket) its `_propose` (k draft steps over the target's KV cache) and
`_prepare_inputs`, as `_precompile_mtp_helpers`; compute_logits then at the
runner's logits buckets (k + 1 positions per request). A multimodal model
(unless `--no-images`): the vision encoder (`get_single_image_embedding`,
whose attention is tpu-inference's Pallas flash attention, lowered through
Mosaic for the target) at the patches Gemma 4's image processor pads an
image to, the embedding merge with and without image embeddings, and the
step with input embeddings per token bucket, as the runner runs them
(`_precompile_input_embeddings_merger`,
`_precompile_backbone_with_inputs_embeds`; the runner itself precompiles
the vision encoder only for `additional_config`'s `vision_warmup_config`,
else it compiles at the first image). The runner's small helpers (unless
`--no-helpers`): `_substitute_placeholder_token` (async scheduling),
`_select_from_array_fn` (with speculative decoding also the bonus and
target logits), the logprob gathers (`compute_and_gather_logprobs`,
`compute_and_gather_prompt_logprobs` up to 1024 tokens) and structured
decoding's grammar bitmask (`structured_decode_fn` per request bucket, as
`_precompile_structured_decoding`); with `--assistant` also speculative
decoding's programs of the target's runner, as
`_precompile_speculative_decoding` compiles them: the rejection sampler
(greedy and random, per logits bucket x request bucket),
`extract_last_sampled_tokens`, `_extract_draft_token_ids`,
`process_and_extend_logits`, `extend_logits_simple`, the spec-decode
`_select_from_array_fn` (bonus and target logits split over the attention
data axis), and with async scheduling `_subtract_num_rejected_tokens_fn`
and `concat_last_sampled_tokens_and_draft_tokens`; all at the shapes
compilation_manager gives them. Not compiled here (neither is on by
default): continue_decode (`_precompile_continue_decode`, only with
`additional_config`'s `enable_continue_decode`) and the disaggregated-
serving KV slice / insert programs (`_precompile_disagg_utils`, only when
tpu-inference's `is_disagg_enabled()`); nor audio.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_gemma_qat.aot import AotError, Topology, substitutions, topology

# HBM bandwidth per chip, public Cloud TPU specifications (bytes / s): used
# only to turn the KV bytes a step reads into time, which RPA v3 does not
# declare to XLA's cost model.
HBM_BYTES_PER_S = {5: 819e9, 6: 1640e9}

KV_DTYPES = {"bf16": "auto", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3",
             "fp8_e5m2": "fp8_e5m2"}


@dataclass
class Program:
    name: str  # "step" / "compute_logits"
    shape: dict  # num_tokens, num_reqs
    ok: bool = False
    error: str | None = None
    compile_s: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    optimal_seconds: float = 0.0
    concat_bitcasts: int = 0
    mosaic_calls: int = 0  # Pallas kernels in the compiled program
    kv_read_bytes: int = 0  # by arithmetic (RPA declares none)
    est_seconds: float | None = None  # corrected, KV traffic added

    @property
    def label(self) -> str:
        return self.name + "(" + ", ".join(
            f"{k}={int(v) if isinstance(v, bool) else v}"
            for k, v in self.shape.items()) + ")"


@dataclass
class Report:
    model: str
    topology: str
    tp: int
    weights: str
    kv_dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    hbm_bytes: int  # per chip
    utilization: float
    programs: list = field(default_factory=list)
    hosts: int = 1  # hosts the TP chips span
    # per chip
    weight_bytes: int = 0  # every parameter's shard (what HBM holds)
    lm_weight_bytes: int = 0  # the language model's part of it
    step_weight_bytes: int = 0  # memory_analysis: step args - KV - inputs
    # memory_analysis of a program taking every language-model parameter:
    # their bytes as laid out in HBM (TPU tiling pads small dimensions)
    lm_laid_out_bytes: int = 0
    # speculative decoding (--assistant): the drafter's parameters per chip
    # that are not the target's (in weight_bytes), and plan's figure
    assistant: str | None = None
    num_speculative_tokens: int = 0
    assistant_weight_bytes: int = 0
    plan_assistant_weight_bytes: int | None = None
    kv_bytes: int = 0  # the KV cache's shards
    max_temp_bytes: int = 0
    max_code_bytes: int = 0
    plan_weight_bytes: int = 0
    plan_lm_weight_bytes: int = 0  # the language model's (what a step takes)
    plan_kv_bytes: int = 0
    plan_kv_cache_tokens: int = 0
    fits: bool = False
    why_not: list = field(default_factory=list)
    disagreements: list = field(default_factory=list)
    caveats: list = field(default_factory=list)
    build_s: float = 0.0

    @property
    def all_compiled(self) -> bool:
        return bool(self.programs) and all(p.ok for p in self.programs)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["all_compiled"] = self.all_compiled
        d["total_bytes"] = self.total_bytes
        return d

    @property
    def total_bytes(self) -> int:
        return (self.weight_bytes + self.kv_bytes + self.max_temp_bytes
                + self.max_code_bytes)


def compile_model(target: str, topology_name: str, *, tp: int | None = None,
                  weights: str = "bf16", kv_dtype: str = "bf16",
                  dtype: str = "auto", max_model_len: int | None = None,
                  max_num_seqs: int = 8,
                  max_num_batched_tokens: int | None = None,
                  utilization: float = 0.92, logits: bool = True,
                  sampling: bool = True,
                  token_buckets: list[int] | None = None,
                  assistant: str | None = None,
                  num_speculative_tokens: int | None = None,
                  images: bool = True, helpers: bool = True,
                  log=None, load_format: str = "gemma_qat") -> Report:
    """Build and compile; `token_buckets`: compile only these of the
    runner's token buckets (None: all of them); `assistant`: a Gemma 4
    assistant directory served with it (`--speculative-config '{"model":
    assistant, "num_speculative_tokens": k}'`; k required with it);
    `images`: a multimodal model's image programs too (as the runner
    compiles them for a multimodal model); `helpers`: the runner's small
    helper programs too; `load_format` "auto": stock tpu-inference (no
    gemma_qat fix; every layer's KV at full context, as 0.32 allocates
    it)."""
    topo = topology(topology_name)
    tp = tp or topo.chips
    if tp > topo.chips:
        raise AotError(f"--tp {tp} needs {tp} chips; {topo.name} has "
                       f"{topo.chips}")
    if kv_dtype not in KV_DTYPES:
        raise AotError(f"--kv-dtype {kv_dtype!r}: one of "
                       f"{', '.join(KV_DTYPES)}")
    if assistant and not num_speculative_tokens:
        # vLLM 0.32 derives num_speculative_tokens from the draft config's
        # n_predict, which a Gemma 4 assistant lacks (its SpeculativeConfig
        # then fails comparing None > 1).
        raise AotError("--assistant needs --num-speculative-tokens (vLLM "
                       "derives none from a Gemma 4 assistant's config)")
    log = log or (lambda msg: None)
    environ = dict(os.environ)
    try:
        _environment(topo)
        report = _compile_with_plugin(
            target, topo, tp, weights, kv_dtype, dtype, max_model_len,
            max_num_seqs, max_num_batched_tokens, utilization, logits,
            sampling, token_buckets, log,
            (assistant, num_speculative_tokens) if assistant else None,
            images, helpers, load_format)
        if assistant:
            report.assistant = assistant
        return report
    finally:  # the caller's environment back (a server started next)
        os.environ.clear()
        os.environ.update(environ)


def _compile_with_plugin(target, topo, tp, weights, kv_dtype, dtype,
                         max_model_len, max_num_seqs, max_num_batched_tokens,
                         utilization, logits, sampling, token_buckets, log,
                         speculative, images, helpers, load_format):
    started = time.perf_counter()

    from vllm_gemma_qat import checkpoint, plan as planlib, targets
    geo, plan_weights, _, _, config = targets.plan_inputs(
        target, int4_export_ok=weights == "int4")
    if speculative:  # its config (a local directory), checked as plan does
        helper = checkpoint.resolve(speculative[0], allow_download=False)
        helper_config = checkpoint.read_config(helper)
        plan_helper = None  # a config-only directory: no bytes to count
        from vllm_gemma_qat import assistant as assistantlib
        if not assistantlib.is_assistant(helper_config):
            raise assistantlib.not_an_assistant(speculative[0], helper_config)
        if not targets.config_only(helper):
            plan_helper, _, _ = targets.assistant_bytes(
                target, config, str(helper), dtype)
            import dataclasses
            plan_weights = dataclasses.replace(plan_weights,
                                               assistant_bytes=plan_helper)
        speculative = (helper_config, speculative[1], plan_helper)

    import jax

    from vllm.plugins import load_general_plugins
    load_general_plugins()  # the plugin, as `vllm serve` loads it
    table = substitutions(topo, _int4_layout)
    from jax.experimental.compilation_cache import compilation_cache
    # Deviceless executables cannot be loaded here: keep them out of JAX's
    # persistent cache (a later read fails with a warning). JAX decides
    # once per process whether it uses the cache, at its first compile:
    # reset, so that the decision is taken again here and after.
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    # JAX's in-memory caches hold traces made for an earlier compile's
    # topology (a nested jit's out_shardings resolved against its mesh:
    # "Received incompatible devices" for the second topology in one
    # process): every compile starts from empty caches, and leaves them so.
    jax.clear_caches()
    try:
        return _compile_model(target, topo, tp, weights, kv_dtype, dtype,
                              max_model_len, max_num_seqs,
                              max_num_batched_tokens, utilization, logits,
                              sampling, token_buckets, log, table, started,
                              geo,
                              plan_weights, config, planlib, speculative,
                              images, helpers, load_format)
    finally:  # (the knob, not a substitution: JAX's public config)
        jax.config.update("jax_enable_compilation_cache", cache_was)
        compilation_cache.reset_cache()
        jax.clear_caches()


def _compile_model(target, topo, tp, weights, kv_dtype, dtype, max_model_len,
                   max_num_seqs, max_num_batched_tokens, utilization, logits,
                   sampling, token_buckets, log, table, started, geo,
                   plan_weights,
                   config, planlib, speculative, images,
                   helpers, load_format="gemma_qat") -> Report:
    from jax.experimental import topologies

    from vllm_gemma_qat import substitute
    try:
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=topo.libtpu_name,
            chip_config_name="default", chips_per_host_bounds=topo.bounds,
            num_slices=1)
    except Exception as e:  # libtpu missing, or an unknown name
        raise AotError(f"libtpu cannot describe {topo.name} "
                       f"({topo.libtpu_name}): {e}") from None
    described = (len(desc.devices),
                 len({d.process_index for d in desc.devices}))
    if described != (topo.chips, topo.hosts):
        raise AotError(f"libtpu describes {topo.name} ({topo.libtpu_name}) "
                       f"as {described[0]} chips on {described[1]} hosts, "
                       f"not {topo.chips} on {topo.hosts}")

    # The plugin's header check, as `vllm serve` runs it (a local
    # checkpoint; a hub repo is checked from its headers by targets.plan_inputs).
    from vllm_gemma_qat import preflight, quantization, targets
    bare = Path(target).is_file() or (Path(target).is_dir()
                                      and targets.config_only(Path(target)))
    if not bare:
        preflight.check_local_checkpoint(
            target, tp=tp, hf_overrides={
                "quantization_config":
                quantization.w4a16_quantization_config()}
            if weights == "int4" and not config.get("quantization_config")
            else None)
    if load_format != "gemma_qat":  # stock builds the KV-shared layers' K/V
        from dataclasses import replace
        from vllm_gemma_qat.checkpoint import numel
        plan_weights = replace(plan_weights, tensors={
            n: (2 * numel(shape), numel(shape))
            for n, shape in geo.skippable("").items()} | plan_weights.tensors)
    with tempfile.TemporaryDirectory(prefix="gemma-qat-aot-") as tmp:
        model_dir = _config_dir(Path(tmp), config, weights)
        spec = None
        if speculative:
            helper_dir = Path(tmp, "assistant")
            helper_dir.mkdir()
            (helper_dir / "config.json").write_text(
                json.dumps(speculative[0]))
            spec = {"model": str(helper_dir)}
            if speculative[1] is not None:
                spec["num_speculative_tokens"] = speculative[1]
        with substitute.applied(table, "vllm-gemma-qat AOT mode"):
            try:
                vllm_config = _vllm_config(
                    model_dir, tp, weights, kv_dtype, dtype, max_model_len,
                    max_num_seqs, max_num_batched_tokens, utilization, spec,
                    load_format)
            except ValueError as e:  # pydantic's ValidationError too
                raise AotError(f"vLLM refuses these flags for {target}: "
                               f"{_first_error(e)}") from None
            # None: vLLM's default, the model's max_position_embeddings.
            max_model_len = vllm_config.model_config.max_model_len
            # `plan --tp` for the same flags, weights in the dtype vLLM
            # resolved (--dtype auto: bf16 for a float32 config on TPU).
            served = vllm_config.model_config.dtype
            p = planlib.make_plan(
                geo, plan_weights, agents=max_num_seqs,
                context=max_model_len, kv_dtype=kv_dtype,
                hbm_gib=topo.hbm_gib, utilization=utilization, form=weights,
                tp=tp, dtype_bytes=served.itemsize,
                max_num_batched_tokens=vllm_config.scheduler_config.
                max_num_batched_tokens,
                block_size=vllm_config.cache_config.block_size,
                async_scheduling=bool(
                    vllm_config.scheduler_config.async_scheduling),
                sliding_window=load_format == "gemma_qat")
            p_lm = planlib.make_plan(
                geo, planlib.Weights(plan_weights.tensors),
                agents=max_num_seqs, context=max_model_len,
                kv_dtype=kv_dtype, hbm_gib=topo.hbm_gib,
                utilization=utilization, form=weights, tp=tp,
                dtype_bytes=served.itemsize,
                sliding_window=load_format == "gemma_qat")
            report = _build_and_compile(vllm_config, desc, topo, tp, p, p_lm,
                                        geo,
                                        target, weights, kv_dtype,
                                        utilization, logits, sampling,
                                        token_buckets, log,
                                        speculative[2] if speculative
                                        else None, images, helpers)
    report.build_s = time.perf_counter() - started
    return report


def _environment(topo: Topology) -> None:
    """JAX on the host CPU (this is deviceless compilation: the TPU is
    libtpu's topology), and the TPU_* values that stop libtpu's and
    tpu-inference's cloud-metadata lookups off Google Cloud (the values CPU
    mode sets too, without its offline hub: a repo id's headers come from
    the hub)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # No chip is used: another process holding libtpu's lockfile (a
    # `vllm serve` on a TPU VM, a second compile) must not stop this one.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    for key, value in (("JAX_PLATFORMS", "cpu"), ("TPU_NAME", "aot"),
                       ("TPU_WORKER_ID", "0"),
                       ("TPU_ACCELERATOR_TYPE", topo.name)):
        os.environ.setdefault(key, value)
    if os.environ["JAX_PLATFORMS"] != "cpu":
        raise AotError("compile runs with JAX_PLATFORMS=cpu (it compiles for "
                       f"a TPU without one); JAX_PLATFORMS is "
                       f"{os.environ['JAX_PLATFORMS']!r}")


def _config_dir(tmp: Path, config: dict, weights: str) -> Path:
    from vllm_gemma_qat import quantization
    config = json.loads(json.dumps(config))
    if weights == "int4" and not config.get("quantization_config"):
        # as `--hf-overrides "$(vllm-gemma-qat int4-overrides)"` would
        config["quantization_config"] = \
            quantization.w4a16_quantization_config()
    elif weights != "int4" and config.get("quantization_config"):
        raise AotError("the checkpoint's config declares quantization_config "
                       "(a w4a16 export): pass --weights int4")
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def _first_error(e: Exception) -> str:
    """The message of vLLM's config error, without pydantic's framing."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        return "; ".join(str(x.get("msg", x)) for x in errors())
    return str(e)


def _vllm_config(model_dir, tp, weights, kv_dtype, dtype, max_model_len,
                 max_num_seqs, max_num_batched_tokens, utilization,
                 speculative_config=None, load_format="gemma_qat"):
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=str(model_dir), load_format=load_format,
                      skip_tokenizer_init=True, tensor_parallel_size=tp,
                      dtype=dtype, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens,
                      kv_cache_dtype=KV_DTYPES[kv_dtype],
                      gpu_memory_utilization=utilization,
                      speculative_config=speculative_config)
    return args.create_engine_config()


def _int4_layout(model, mesh) -> None:
    """wNa16 linears: the layout `WNA16LinearMethod.
    process_weights_after_loading` leaves (int4 [in, out]; the scale
    [in / group, 1, out] for gmm_v2, else [in / group, out]; shardings as
    `shard_linear_weights` gives them), in place of the checkpoint's packed
    parameters."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tpu_inference.layers.jax.quantization.wna16 import WNA16LinearMethod
    for _, module in model.iter_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, WNA16LinearMethod) or \
                not hasattr(module, "weight_packed"):
            continue
        spec = method.linear_config.weight_sharding
        weight = jax.ShapeDtypeStruct(
            (method.in_features, method.out_features), jnp.int4,
            sharding=NamedSharding(mesh, spec))
        in_axis = spec[0] if method.num_groups > 1 else None
        if method.use_kernel:
            scale_shape = (method.num_groups, 1, method.out_features)
            scale_spec = P(in_axis, None, spec[1])
        else:
            scale_shape = (method.num_groups, method.out_features)
            scale_spec = spec
        scale = jax.ShapeDtypeStruct(scale_shape, jnp.bfloat16,
                                     sharding=NamedSharding(mesh, scale_spec))
        for name in ("weight_packed", "weight_scale", "weight_shape"):
            delattr(module, name)
        module.weight = nnx.Param(weight)
        module.weight_scale = nnx.Param(scale)


def _kv_cache_groups(vllm_config, text, share, tp, sliding_window):
    """vLLM's KV cache groups (layer names) for the specs gemma_qat
    declares, by vLLM's own grouping, and the layers that read another
    layer's cache (the rest of a row, the KV-shared layers) -> that layer."""
    import torch
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from tpu_inference.utils import (get_layer_kv_params, get_padded_head_dim,
                                     get_padded_num_heads)

    from vllm_gemma_qat.fixes.sliding_window import row_layout
    rows = row_layout(text) if sliding_window else None
    if rows is None:  # one group of every KV-owning layer
        own = [f"layer.{i}" for i in range(text.num_hidden_layers)
               if i not in share]
        return [own], {f"layer.{i}": f"layer.{s}" for i, s in share.items()}
    full_head = get_padded_head_dim(
        get_layer_kv_params(text, "full_attention")[0])
    owner_of = {i: rows.place.get(i, (i, 0))[0]
                for i in range(text.num_hidden_layers)}
    redirects = {f"layer.{i}": f"layer.{owner_of[share.get(i, i)]}"
                 for i in range(text.num_hidden_layers)
                 if owner_of[share.get(i, i)] != i}
    specs = {}
    for i, layer_type in enumerate(text.layer_types):
        if f"layer.{i}" in redirects:
            continue
        head_dim, kv_heads = get_layer_kv_params(text, layer_type)
        # The grouping reads page sizes only: the dtype is the same for all.
        spec = dict(block_size=vllm_config.cache_config.block_size,
                    num_kv_heads=get_padded_num_heads(kv_heads, tp),
                    head_size=get_padded_head_dim(head_dim),
                    dtype=torch.bfloat16)
        specs[f"layer.{i}"] = FullAttentionSpec(**spec) if i not in \
            rows.place else SlidingWindowSpec(
                **spec | {"head_size": full_head},
                sliding_window=text.sliding_window)
    # The layout the engine core resolves from the workers' backends.
    from vllm.distributed.kv_transfer.kv_connector.utils import \
        get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts, resolve_kv_cache_layout)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(
        get_current_attn_backends(vllm_config))]
    resolve_kv_cache_layout(vllm_config, [supported], list(specs.values()))
    groups = get_kv_cache_groups(vllm_config, specs)
    return [list(g.layer_names) for g in groups], redirects


def _nbytes_per_chip(x) -> int:
    import numpy as np
    shape = x.sharding.shard_shape(x.shape) if x.sharding else x.shape
    return int(np.prod(shape)) * x.dtype.itemsize if x.dtype.name != "int4" \
        else int(np.prod(shape)) // 2


def _build_and_compile(vllm_config, desc, topo: Topology, tp, p, p_lm, geo,
                       target,
                       weights, kv_dtype, utilization, logits, sampling,
                       token_buckets, log, plan_assistant_bytes,
                       images, helpers) -> Report:
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.utils import next_power_of_2  # as tpu_runner
    from jax.sharding import NamedSharding, PartitionSpec as P
    from vllm.config import set_current_vllm_config

    from vllm_gemma_qat import substitute
    from tpu_inference import envs
    from tpu_inference.distributed import jax_parallel_state
    from tpu_inference.layers.common.attention_metadata import (
        AttentionMetadata, GroupedAttentionMetadata)
    from tpu_inference.layers.common.sharding import (MESH_AXIS_NAMES_2D,
                                                      ShardingAxisName)
    from tpu_inference.models.common import model_loader
    from tpu_inference.models.common.kv_share import compute_kv_share_map
    from tpu_inference.runner import kv_cache as kv_cache_lib
    from tpu_inference.runner import utils as runner_utils
    from tpu_inference.utils import (get_dtype_packing, get_layer_kv_params,
                                     get_padded_head_dim,
                                     get_padded_num_heads, make_optimized_mesh,
                                     to_jax_dtype)

    jax_parallel_state.init_pp_distributed_environment(
        "127.0.0.1", 0, 1, None, need_pp=False)
    devices = list(desc.devices)[:tp]
    mesh = make_optimized_mesh((1, tp), MESH_AXIS_NAMES_2D, devices=devices)
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    scheduler_config = vllm_config.scheduler_config
    block_size = cache_config.block_size
    max_model_len = model_config.max_model_len
    max_num_seqs = scheduler_config.max_num_seqs
    report = Report(
        model=target, topology=topo.name, tp=tp, weights=weights,
        kv_dtype=kv_dtype, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        block_size=block_size, num_blocks=0,
        hosts=len({d.process_index for d in devices}),
        hbm_bytes=int(topo.hbm_gib * 2**30), utilization=utilization,
        plan_weight_bytes=p.weight_bytes_per_chip,
        plan_lm_weight_bytes=p_lm.weight_bytes_per_chip,
        plan_kv_cache_tokens=p.kv_cache_tokens)

    with set_current_vllm_config(vllm_config), \
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        log(f"building {target} for {topo.name} (TP={tp}, {weights})")
        try:
            model = model_loader.get_model(vllm_config,
                                           jax.random.PRNGKey(0), mesh)
        except (AotError, substitute.MissingTarget):
            raise
        except Exception as e:
            raise AotError(f"tpu-inference did not build {target} for these "
                           f"flags: {type(e).__name__}: {e}") from e

        # The KV cache tpu-inference allocates: every block of the budget
        # (vLLM gives the KV cache all that is left), in the layout
        # gemma_qat declares (fixes/sliding_window.py).
        text = model_config.hf_text_config
        share = compute_kv_share_map(text)
        cache_dtype = cache_config.cache_dtype
        cache_dtype = to_jax_dtype(model_config.dtype if cache_dtype == "auto"
                                   else cache_dtype)
        need = p.kv_blocks_per_agent  # one request at --max-model-len
        report.num_blocks = num_blocks = p.kv_pool_blocks
        if num_blocks < need:
            report.why_not.append(
                f"KV cache: {num_blocks} blocks per chip after the weights "
                f"({p.budget_bytes / 1e9:.2f} GB budget), fewer than one "
                f"request's --max-model-len {max_model_len} needs ({need}; "
                "vLLM refuses to start)")
            num_blocks = need  # compile anyway, with one request's pages
        groups, redirects = _kv_cache_groups(vllm_config, text, share, tp,
                                             p.kv_sliding_window)
        kv_caches, index, made = [], {}, {}
        for group in groups:
            for j, layer in enumerate(group):
                # Several groups: their j-th layers share array j (a block
                # belongs to one group at a time); one group: an array per
                # layer.
                key = j if len(groups) > 1 else layer
                if key not in made:
                    i = int(layer.split(".")[1])
                    head_dim, kv_heads = get_layer_kv_params(
                        text, text.layer_types[i])
                    if len(groups) > 1:  # every page at the full layers'
                        head_dim, _ = get_layer_kv_params(text,
                                                          "full_attention")
                    made[key] = len(kv_caches)
                    kv_caches += kv_cache_lib.create_kv_caches(
                        num_blocks, block_size,
                        get_padded_num_heads(kv_heads, tp),
                        get_padded_head_dim(head_dim), mesh, [layer],
                        cache_dtype)
                index[layer] = made[key]
        for layer, owner in redirects.items():
            index[layer] = index[owner]
        layer_to_cache = tuple((f"layer.{i}", index[f"layer.{i}"])
                               for i in range(text.num_hidden_layers))
        group_names = tuple(
            tuple(g) + tuple(n for n, o in redirects.items() if o in g)
            for g in groups)
        # Speculative decoding: the assistant's layers read the target's
        # caches (kv_share.compute_mtp_kv_share_map), in the runner's
        # layer -> cache index the target's step takes too.
        spec_config = vllm_config.speculative_config
        draft_sources = {}
        if spec_config is not None:
            if not spec_config.use_gemma4_mtp():
                raise AotError("--assistant takes a Gemma 4 assistant "
                               "(Gemma4AssistantForCausalLM); vLLM made "
                               f"method {spec_config.method!r} of it")
            from tpu_inference.models.common.kv_share import \
                compute_mtp_kv_share_map
            draft_sources = compute_mtp_kv_share_map(
                spec_config.draft_model_config.hf_config, text)
            layer_to_cache += tuple((d, index[t])
                                    for d, t in draft_sources.items())
        report.weight_bytes = sum(_nbytes_per_chip(x)
                                  for x in model.state_leaves)
        lm = [x for path, x in jax.tree_util.tree_flatten_with_path(
                  model.state)[0]
              if not any(t in jax.tree_util.keystr(path)
                         for t in ("vision", "audio"))]
        report.lm_weight_bytes = sum(_nbytes_per_chip(x) for x in lm)
        holder = jax.jit(lambda *xs: None, keep_unused=True)
        with jax.set_mesh(mesh):
            report.lm_laid_out_bytes = holder.lower(*lm).compile() \
                .memory_analysis().argument_size_in_bytes
        report.kv_bytes = sum(_nbytes_per_chip(c) for c in kv_caches)
        report.plan_kv_bytes = report.num_blocks * p.kv_block_bytes

        # The runner's buckets (tpu_runner._init_inputs).
        packing = get_dtype_packing(cache_dtype)
        paddings = runner_utils.build_token_paddings(
            min_token_size=max(envs.MIN_TOKEN_BUCKET,
                               next_power_of_2(packing)),
            max_token_size=scheduler_config.max_num_batched_tokens,
            padding_gap=envs.VLLM_TPU_BUCKET_PADDING_GAP)
        all_paddings = paddings
        if token_buckets:
            paddings = [t for t in paddings if t in token_buckets]
        max_num_reqs = max(max_num_seqs, runner_utils.MIN_NUM_SEQS)
        attn_reqs = [r for r in runner_utils.get_attn_req_paddings(
            runner_utils.MIN_NUM_SEQS, max_num_seqs)]
        req_paddings = runner_utils.get_req_paddings(
            runner_utils.MIN_NUM_SEQS, max_num_reqs)

        batch = NamedSharding(mesh, P(ShardingAxisName.BATCH))
        data = NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA))

        sds = _sds

        cells = dict(zip(model.model_fn.__code__.co_freevars,
                         (c.cell_contents for c in model.model_fn.__closure__)))
        if "_resolve_step_fn" not in cells:
            raise substitute.MissingTarget(
                "tpu_inference.models.common.model_loader:get_flax_model's "
                "model_fn no longer resolves its jit through _resolve_step_fn")
        step = cells["_resolve_step_fn"](kv_caches, True)
        max_blocks = -(-max_model_len // block_size)
        bw = HBM_BYTES_PER_S.get(topo.tpu_version)
        # Bytes of KV one token of context costs each layer's attention
        # (shared layers read their source's cache; a sliding layer reads
        # its whole row, at most window + a page of tokens), per chip.
        window = getattr(text, "sliding_window", None) \
            if p.kv_sliding_window else None
        read_per_token = {True: 0, False: 0}  # by: reads the window only
        for name, n in layer_to_cache:
            i = int(name.split(".")[1])
            read_per_token[bool(window) and text.layer_types[i] ==
                           "sliding_attention"] += _nbytes_per_chip(
                kv_caches[n]) // (num_blocks * block_size)

        def step_inputs(num_tokens, num_reqs):
            """(ids, positions, metadata) as the runner passes them."""
            ids = sds((num_tokens, ), jnp.int32, batch)
            positions = sds((num_tokens, ), jnp.int32, data)
            per_group = [AttentionMetadata(
                input_positions=positions,
                block_tables=sds((max_num_reqs * max_blocks, ), jnp.int32,
                                 batch),
                seq_lens=sds((max_num_reqs, ), jnp.int32, batch),
                query_start_loc=sds((max_num_reqs + 1, ), jnp.int32, batch),
                request_distribution=sds((3, ), jnp.int32, batch),
                mamba_state_indices=None, padded_num_reqs=num_reqs,
                pcp=None) for _ in groups]
            # As the runner passes them: one metadata, or one per group.
            md = per_group[0] if len(groups) == 1 else \
                GroupedAttentionMetadata(per_group, group_names)
            return ids, positions, md

        for num_tokens in paddings:
            for num_reqs in attn_reqs:
                ids, positions, md = step_inputs(num_tokens, num_reqs)
                inputs = [ids, *jax.tree_util.tree_leaves(md)]
                prog = Program("step", {"num_tokens": num_tokens,
                                        "num_reqs": num_reqs})
                _compile(prog, lambda: step.lower(
                    model.state_leaves, kv_caches, ids, md, None, positions,
                    layer_to_cache, None, None, True, True), mesh, log)
                if prog.ok:
                    # The step's other arguments as laid out in HBM.
                    with jax.set_mesh(mesh):
                        others = holder.lower(*kv_caches, *inputs).compile() \
                            .memory_analysis().argument_size_in_bytes
                    report.step_weight_bytes = prog.argument_bytes - others
                    # Context every request of the bucket could hold.
                    ctx = min(num_reqs * max_model_len,
                              num_blocks * block_size)
                    in_window = num_reqs * min(max_model_len,
                                               (window or 0) + block_size)
                    prog.kv_read_bytes = (ctx * read_per_token[False]
                                          + in_window * read_per_token[True])
                    if bw:
                        prog.est_seconds = (prog.optimal_seconds
                                            + prog.concat_bitcasts
                                            + prog.kv_read_bytes / bw)
                report.programs.append(prog)
        # The runner's is_multimodal_model: a multimodal model (vLLM's
        # ModelConfig) with an embed_multimodal function.
        if images and model_config.is_multimodal_model and \
                model.multimodal_fns.embed_multimodal_fn is not None:
            _compile_images(report, model, mesh, kv_caches, layer_to_cache,
                            step, step_inputs, paddings, attn_reqs,
                            model_config, log)

        if spec_config is not None:
            # compute_logits takes every position a request may verify
            # (tpu_runner's num_logits_paddings).
            req_paddings_logits = runner_utils.get_token_paddings(
                min_token_size=runner_utils.MIN_NUM_SEQS,
                max_token_size=max_num_reqs * (
                    spec_config.num_speculative_tokens + 1),
                padding_gap=0)
        else:
            req_paddings_logits = req_paddings
        if logits:
            hidden = model_config.get_hidden_size()
            for num_reqs in req_paddings_logits:
                h = sds((num_reqs, hidden), jnp.bfloat16,
                        NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA,
                                              None)))
                prog = Program("compute_logits", {"num_reqs": num_reqs})
                _compile(prog, lambda: model.compute_logits_fn.lower(
                    model.state_leaves, h, None), mesh, log)
                if prog.ok:
                    prog.est_seconds = prog.optimal_seconds + \
                        prog.concat_bitcasts
                report.programs.append(prog)

        if sampling:
            _compile_sampling(report, model_config, mesh, req_paddings,
                              tp, log)

        if helpers:
            _compile_helpers(report, vllm_config, mesh, paddings,
                             req_paddings, req_paddings_logits
                             if spec_config is not None else None, tp, log)

        if helpers and spec_config is not None:
            _compile_spec_helpers(report, vllm_config, mesh, paddings,
                                  req_paddings, req_paddings_logits, tp, log)

        if spec_config is not None:
            _compile_drafter(report, vllm_config, model, mesh, kv_caches,
                             layer_to_cache, groups, group_names,
                             draft_sources, text, p, all_paddings[-1],
                             paddings, attn_reqs, max_num_reqs, max_blocks,
                             plan_assistant_bytes, log)

    _judge(report, p)
    return report


def _compile_helpers(report, vllm_config, mesh, token_paddings,
                     req_paddings, logits_paddings, tp, log) -> None:
    """The runner's small helper programs, as compilation_manager
    precompiles them: `_substitute_placeholder_token` (async scheduling:
    the previous step's sampled tokens put into the next step's ids),
    `_select_from_array_fn` (the rows compute_logits takes; with
    speculative decoding also the bonus and target logits), and the
    logprob gathers (`compute_and_gather_logprobs` per request bucket,
    `compute_and_gather_prompt_logprobs` per token bucket up to 1024).
    `logits_paddings`: the runner's num_logits_paddings (speculative
    decoding), else None."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.layers.jax.sample.sampling import (
        compute_and_gather_logprobs, compute_and_gather_prompt_logprobs,
        logprobs_use_processed_logits)
    from tpu_inference.runner import tpu_runner
    from tpu_inference.utils import align_to

    model_config = vllm_config.model_config
    spec = vllm_config.speculative_config

    def sharded(*spec_):
        return NamedSharding(mesh, P(*spec_))

    sds = _sds

    def add(name, shape, lower):
        _add_program(report, mesh, log, name, shape, lower)

    data = sharded(ShardingAxisName.ATTN_DATA)
    whole = sharded(None)
    if vllm_config.scheduler_config.async_scheduling:
        substitute_fn = tpu_runner._substitute_placeholder_token
        shapes = []  # (ids, their sharding, next tokens, their sharding)
        sizes = sorted(set(token_paddings + req_paddings))
        if spec is not None:
            spec_next = max(req_paddings) * (spec.num_speculative_tokens + 1)
            shapes += [(n, data, spec_next, data) for n in sizes]
            shapes += [(n, whole, spec_next, data) for n in logits_paddings]
        else:
            for n in sizes:
                shapes.append((n, data, n, data))
                shapes += [(n, data, r, whole) for r in req_paddings]
        seen = set()
        for n, ids_sharding, m, next_sharding in shapes:
            key = (n, m, ids_sharding.spec, next_sharding.spec)
            if key in seen:
                continue
            seen.add(key)
            indices = sds((n, ), jnp.int32, whole)
            add("substitute_placeholder_token",
                {"num_tokens": n, "next_tokens": m,
                 "ids_split": ids_sharding is data,
                 "next_split": next_sharding is data},
                lambda: substitute_fn.lower(
                    sds((n, ), jnp.int32, ids_sharding), indices, indices,
                    sds((m, ), jnp.int32, next_sharding),
                    sds((1, ), jnp.int32, whole)))

    select = tpu_runner.TPUModelRunner._select_from_array_fn
    pcp = vllm_config.sharding_config.prefill_cp_size
    hidden = model_config.get_hidden_size()
    vocab = align_to(model_config.get_vocab_size(), tp)
    logits_sharding = sharded(ShardingAxisName.MLP_DATA,
                              ShardingAxisName.MLP_TENSOR)
    selections = [("hidden", token_paddings, logits_paddings or req_paddings,
                   hidden, sharded(ShardingAxisName.ATTN_DATA, None), data,
                   False)]
    if spec is not None:
        selections += [
            ("bonus logits", logits_paddings, req_paddings, vocab,
             logits_sharding, None, False),
            ("target logits", logits_paddings, logits_paddings, vocab,
             logits_sharding, None, True)]
    for what, sources, indices, width, source_sharding, index_sharding, \
            equal in selections:
        for rows in sources:
            for count in indices:
                if (count != rows) if equal else (count > rows):
                    continue  # as _should_skip_padding_combination
                add("select_from_array", {"of": what, "rows": rows,
                                          "indices": count},
                    lambda: select.lower(
                        jax.ShapeDtypeStruct((rows, width), jnp.bfloat16,
                                             sharding=source_sharding),
                        jax.ShapeDtypeStruct((count, ), jnp.int32,
                                             sharding=index_sharding),
                        mesh, pcp))

    max_logprobs = model_config.max_logprobs
    processed = logprobs_use_processed_logits(model_config.logprobs_mode)
    row_sharding = sharded(ShardingAxisName.ATTN_DATA, None) if processed \
        else logits_sharding
    for num_reqs in req_paddings:
        add("gather_logprobs", {"num_reqs": num_reqs},
            lambda: compute_and_gather_logprobs.lower(
                sds((num_reqs, vocab), jnp.float32, row_sharding),
                sds((num_reqs, ), jnp.int32, sharded()), max_logprobs))
    if spec is not None:
        for num_logits in logits_paddings:
            for num_reqs in req_paddings:
                if num_reqs > num_logits:
                    continue
                n = num_logits + num_reqs
                add("gather_logprobs", {"num_logits": num_logits,
                                        "num_reqs": num_reqs},
                    lambda: compute_and_gather_logprobs.lower(
                        sds((n, vocab), jnp.float32, sharded()),
                        sds((n, ), jnp.int32, data), max_logprobs))
    for num_tokens in token_paddings:
        if num_tokens > 1024:  # as the runner: longer prompts at run time
            continue
        add("gather_prompt_logprobs", {"num_tokens": num_tokens},
            lambda: compute_and_gather_prompt_logprobs.lower(
                sds((num_tokens, vocab), jnp.float32, logits_sharding),
                sds((num_tokens, ), jnp.int32, sharded()), max_logprobs))

    # _precompile_structured_decoding: the grammar bitmask applied to the
    # logits, per request bucket (not under data parallelism, as the
    # runner). Its inputs are the runner's host arrays sliced to the bucket
    # (tpu_runner._init_inputs: require_structured_out_cpu (max_num_reqs,
    # 1) bool, grammar_bitmask_cpu (max_num_reqs, cdiv(vocab, 32)) int32,
    # structured_decode_arange (32, ) int32), put on the mesh unsplit by
    # device_array; the manager reads only the runner's vocab_size.
    if vllm_config.sharding_config.total_dp_size == 1:
        from tpu_inference.runner.structured_decoding_manager import \
            StructuredDecodingManager
        manager = StructuredDecodingManager(
            types.SimpleNamespace(vocab_size=vocab))
        words = -(-vocab // 32)
        for num_reqs in req_paddings:
            add("structured_decode", {"num_reqs": num_reqs},
                lambda: StructuredDecodingManager.structured_decode_fn.lower(
                    manager, sds((num_reqs, 1), jnp.bool_, whole),
                    sds((num_reqs, words), jnp.int32, whole),
                    sds((num_reqs, vocab), jnp.bfloat16, whole),
                    sds((32, ), jnp.int32, whole)))


def _compile_spec_helpers(report, vllm_config, mesh, token_paddings,
                          req_paddings, logits_paddings, tp, log) -> None:
    """Speculative decoding's programs of the target's runner, as
    `_precompile_speculative_decoding` compiles them (its drafter's are
    `_compile_drafter`'s): the rejection sampler, greedy and random, per
    (logits bucket, request bucket) (the runner's `RejectionSampler` is no
    jit: compilation_manager compiles it in its warm-up call, through the
    jitted `RejectionSampler.forward` lowered here); then
    `extract_last_sampled_tokens`, `_extract_draft_token_ids`,
    `process_and_extend_logits`, `extend_logits_simple` and
    `_select_from_array_spec_decode`'s bonus and target logits; with async
    scheduling also `_subtract_num_rejected_tokens_fn` per token bucket and
    `concat_last_sampled_tokens_and_draft_tokens` (capture_model runs those
    two right after the placeholder substitution). Shapes and shardings as
    compilation_manager gives them (its `device_array` without a sharding:
    unsplit)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.layers.jax.sample.rejection_sampler import \
        RejectionSampler
    from tpu_inference.layers.jax.sample.sampling_metadata import \
        TPUSupportedSamplingMetadata
    from tpu_inference.runner import tpu_runner
    from tpu_inference.runner.utils import SpecDecodeMetadata
    from tpu_inference.spec_decode.jax.utils import (
        concat_last_sampled_tokens_and_draft_tokens, extend_logits_simple,
        extract_last_sampled_tokens, process_and_extend_logits)
    from tpu_inference.utils import (align_to, get_mesh_shape_product,
                                     to_jax_dtype)

    model_config = vllm_config.model_config
    k = vllm_config.speculative_config.num_speculative_tokens
    vocab = align_to(model_config.get_vocab_size(), tp)
    dtype = to_jax_dtype(model_config.dtype)
    max_num_reqs = max(req_paddings)  # the runner's max_num_reqs
    dp_size = vllm_config.sharding_config.total_dp_size

    def sharded(*spec_):
        return NamedSharding(mesh, P(*spec_))

    sds = _sds

    def add(name, shape, lower):
        _add_program(report, mesh, log, name, shape, lower)

    data = sharded(ShardingAxisName.ATTN_DATA)
    whole = sharded(None)
    empty = sharded()

    if vllm_config.scheduler_config.async_scheduling:
        positions_2d = model_config.uses_mrope
        for num_tokens in token_paddings:
            positions = sds((3, num_tokens), jnp.int32, sharded(
                None, ShardingAxisName.ATTN_DATA)) if positions_2d else \
                sds((num_tokens, ), jnp.int32, data)
            add("subtract_num_rejected_tokens", {"num_tokens": num_tokens},
                lambda: tpu_runner._subtract_num_rejected_tokens_fn.lower(
                    sds((max_num_reqs, ), jnp.int32, data), positions,
                    sds((max_num_reqs, ), jnp.int32, data),
                    sds((max_num_reqs, ), jnp.int32, whole),
                    sds((num_tokens, ), jnp.int32, whole)))
        add("concat_last_sampled_and_draft_tokens",
            {"num_reqs": max_num_reqs, "k": k},
            lambda: concat_last_sampled_tokens_and_draft_tokens.lower(
                sds((max_num_reqs, ), jnp.int32, data),
                sds((max_num_reqs, k), jnp.int32, data)))

    # _precompile_rejection_sampler
    sampler = RejectionSampler(mesh)
    key = jax.eval_shape(
        lambda: nnx.Rngs(jax.random.key(model_config.seed)).params())
    key = sds(key.shape, key.dtype, empty)
    for num_logits in logits_paddings:
        for num_reqs in req_paddings:
            target = sds((num_logits, vocab), dtype, sharded(
                ShardingAxisName.MLP_DATA, ShardingAxisName.MLP_TENSOR))
            per_req = sds((num_reqs, ), jnp.int32, whole)
            for do_sampling in (False, True):
                dummy = sds((2, ), jnp.int32, whole)  # logprobs=False
                if do_sampling:
                    metadata = TPUSupportedSamplingMetadata(
                        temperature=sds((num_reqs, ), jnp.float32, whole),
                        top_k=per_req,
                        top_p=sds((num_reqs, ), jnp.float32, whole),
                        _cache_collision_dummy=dummy, do_sampling=True)
                else:
                    metadata = TPUSupportedSamplingMetadata(
                        _cache_collision_dummy=dummy, do_sampling=False)
                add("random_rejection_sampler" if do_sampling
                    else "greedy_rejection_sampler",
                    {"num_logits": num_logits, "num_reqs": num_reqs},
                    lambda: RejectionSampler.forward.lower(
                        sampler, draft_token_ids=sds((num_logits, ),
                                                     jnp.int32, whole),
                        num_draft_tokens=per_req, draft_probs=None,
                        target_logits=target, bonus_token_ids=per_req,
                        sampling_metadata=metadata, key=key))

    def spec_metadata(num_logits, num_reqs, sharding):
        return SpecDecodeMetadata(
            draft_lengths=sds((num_reqs, ), jnp.int32, sharding),
            target_logits_indices=sds((num_logits, ), jnp.int32, sharding),
            bonus_logits_indices=sds((num_reqs, ), jnp.int32, sharding),
            final_logits_indices=sds((num_logits, ), jnp.int32, sharding))

    # _precompile_extract_last_sampled_tokens
    for num_logits in logits_paddings:
        for num_reqs in req_paddings:
            add("extract_last_sampled_tokens",
                {"num_logits": num_logits, "num_reqs": num_reqs},
                lambda: extract_last_sampled_tokens.lower(
                    spec_metadata(num_logits, num_reqs, data),
                    sds((num_logits + num_reqs, ), jnp.int32, data),
                    k, vocab, max_num_reqs // dp_size, mesh))

    # _precompile_extract_draft_token_ids: a jit of the runner's method
    # (the runner static: it reads its mesh only).
    runner = type("Runner", (), {"mesh": mesh})()
    for num_tokens in token_paddings:
        for num_logits in logits_paddings:
            if num_logits > num_tokens:  # _should_skip_padding_combination
                continue
            add("extract_draft_token_ids",
                {"num_tokens": num_tokens, "num_logits": num_logits},
                lambda: tpu_runner.TPUModelRunner._extract_draft_token_ids
                .lower(runner, sds((num_tokens, ), jnp.int32, data),
                       sds((num_logits, ), jnp.int32, data),
                       sds((num_logits, ), jnp.int32, data)))

    # _precompile_process_and_extend_logits
    for num_logits in logits_paddings:
        for num_reqs in req_paddings:
            if num_reqs > num_logits:
                continue
            metadata = TPUSupportedSamplingMetadata(
                temperature=sds((num_reqs, ), jnp.float32, empty),
                top_k=sds((num_reqs, ), jnp.int32, empty),
                top_p=sds((num_reqs, ), jnp.float32, empty),
                _cache_collision_dummy=sds((1, ), jnp.int32, whole),
                do_sampling=True, logprobs=True)
            add("process_and_extend_logits",
                {"num_logits": num_logits, "num_reqs": num_reqs},
                lambda: process_and_extend_logits.lower(
                    mesh, sds((num_logits, vocab), jnp.float32, empty),
                    sds((num_reqs, vocab), jnp.float32, empty),
                    spec_metadata(num_logits, num_reqs, empty), metadata))

    # _precompile_extend_logits_simple
    split = get_mesh_shape_product(mesh, ShardingAxisName.ATTN_DATA) > 1
    logits_sharding = sharded(ShardingAxisName.ATTN_DATA, None) if split \
        else empty
    for num_logits in logits_paddings:
        for num_reqs in req_paddings:
            if num_reqs > num_logits:
                continue
            add("extend_logits_simple",
                {"num_logits": num_logits, "num_reqs": num_reqs},
                lambda: extend_logits_simple.lower(
                    sds((num_logits, vocab), jnp.bfloat16, logits_sharding),
                    sds((num_reqs, vocab), jnp.bfloat16, logits_sharding),
                    mesh))

    # _precompile_select_from_array_spec_decode: the logits split over the
    # attention data axis, in the model's dtype, every (logits, requests)
    # pair (the target logits' program does not depend on the requests:
    # compiled once per logits bucket).
    select = tpu_runner.TPUModelRunner._select_from_array_fn
    pcp = vllm_config.sharding_config.prefill_cp_size
    rows2d = sharded(ShardingAxisName.ATTN_DATA, None)
    for num_logits in logits_paddings:
        for what, count in [("spec bonus logits", r) for r in req_paddings] \
                + [("spec target logits", num_logits)]:
            add("select_from_array", {"of": what, "rows": num_logits,
                                      "indices": count},
                lambda: select.lower(sds((num_logits, vocab), dtype, rows2d),
                                     sds((count, ), jnp.int32, data), mesh,
                                     pcp))


def _compile_images(report, model, mesh, kv_caches, layer_to_cache, step,
                    step_inputs, paddings, attn_reqs, model_config,
                    log) -> None:
    """A multimodal model's image programs, as the runner runs them: the
    vision encoder (`get_single_image_embedding`, one micro-batch of the
    vision data-parallel size, at the patches Gemma 4's image processor
    pads an image to: default_output_length x pooling_kernel_size^2), the
    embedding merge with and without image embeddings
    (`_precompile_input_embeddings_merger`), and the step with input
    embeddings per token bucket (`_precompile_backbone_with_inputs_embeds`,
    whose loop leaves the largest request bucket; token ids passed too, as
    gemma_qat's fixes/image_steps.py has the runner pass them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.models.jax.utils.multi_modal_utils import \
        flatten_pad_mm_embeds
    from tpu_inference.utils import get_mesh_shape_product, to_jax_dtype

    from vllm_gemma_qat import substitute
    data = NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA))
    rows2d = NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA, None))
    dtype = to_jax_dtype(model_config.dtype)
    hidden = model_config.get_hidden_size()

    sds = _sds

    vision = model_config.hf_config.vision_config
    patches = vision.default_output_length * vision.pooling_kernel_size ** 2
    images = get_mesh_shape_product(mesh, ShardingAxisName.VIT_BATCH)
    pixels = NamedSharding(mesh, P(ShardingAxisName.VIT_BATCH, None, None))
    prog = Program("vision_encoder", {"images": images, "patches": patches})
    # (a jit of the method: the module, its parameters abstract, is its
    # first argument, as when the runner calls it on the merged model)
    _compile(prog, lambda: type(model.model).get_single_image_embedding.lower(
        model.model, sds((images, patches, 3 * vision.patch_size ** 2), dtype, pixels),
        sds((images, patches, 2), jnp.int32, pixels)), mesh, log)
    report.programs.append(prog)

    embed = model.multimodal_fns.embed_input_ids_fn
    cells = dict(zip(embed.__code__.co_freevars,
                     (c.cell_contents for c in embed.__closure__ or ())))
    if "jitted_embed_input_ids" not in cells or \
            "flatten_pad_mm_embeds" not in embed.__code__.co_names:
        raise substitute.MissingTarget(
            "tpu_inference.models.common.model_loader:get_flax_model's "
            "run_embed_input_ids no longer pads through flatten_pad_mm_embeds "
            "into jitted_embed_input_ids")
    merge = cells["jitted_embed_input_ids"]
    for num_tokens in paddings:
        ids = sds((num_tokens, ), jnp.int32, data)
        # flatten_pad_mm_embeds of the runner's one (num_tokens, hidden)
        mm = jax.eval_shape(lambda x: flatten_pad_mm_embeds(
            [x], target_pad_len=num_tokens),
            sds((num_tokens, hidden), dtype, rows2d))
        mm = sds(mm.shape, mm.dtype, rows2d)
        for name, args in (("input_embeddings_merger",
                            (mm, sds((num_tokens, ), jnp.bool_, data))),
                           ("input_embeddings_merger_text_only",
                            (None, None))):
            prog = Program(name, {"num_tokens": num_tokens})
            _compile(prog, lambda: merge.lower(
                model.state_leaves, ids, args[0], is_multimodal=args[1]),
                mesh, log)
            report.programs.append(prog)

    for num_tokens in paddings:
        num_reqs = attn_reqs[-1]
        ids, positions, md = step_inputs(num_tokens, num_reqs)
        embeds = sds((num_tokens, hidden), dtype, rows2d)
        prog = Program("step_with_embeds", {"num_tokens": num_tokens,
                                            "num_reqs": num_reqs})
        _compile(prog, lambda: step.lower(
            model.state_leaves, kv_caches, ids, md, embeds, positions,
            layer_to_cache, None, None, True, True), mesh, log)
        if prog.ok:
            prog.est_seconds = prog.optimal_seconds + prog.concat_bitcasts
        report.programs.append(prog)


def _compile_drafter(report, vllm_config, model, mesh, kv_caches,
                     layer_to_cache, groups, group_names, draft_sources,
                     text, p, max_num_tokens, paddings, attn_reqs,
                     max_num_reqs, max_blocks, plan_assistant_bytes,
                     log) -> None:
    """The Gemma 4 assistant, as tpu-inference's `Eagle3Proposer` loads it
    (`load_model`: `get_model(is_draft_model=True)`, the target's embedding
    shared), and its two programs per (token bucket, request bucket), as
    `_precompile_mtp_helpers` compiles them: `_propose` (the k draft steps)
    and `_prepare_inputs`. The runner is not built here: the proposer gets
    the runner attributes it reads (the mesh, the largest token bucket, the
    target's state, the layer -> cache index)."""
    import types
    from dataclasses import replace

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tpu_inference.layers.common.attention_metadata import \
        AttentionMetadata
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.spec_decode.jax.eagle3 import Eagle3Proposer
    from tpu_inference.utils import to_jax_dtype

    from vllm_gemma_qat.fixes import sliding_window
    spec_config = vllm_config.speculative_config
    k = spec_config.num_speculative_tokens
    report.assistant = str(spec_config.draft_model_config.model)
    report.num_speculative_tokens = k
    runner = types.SimpleNamespace(
        mesh=mesh, max_num_tokens=max_num_tokens, state=model.state,
        layer_name_to_kvcache_index=dict(layer_to_cache))
    try:
        proposer = Eagle3Proposer(vllm_config, runner)
        proposer.load_model(model.state)
    except AotError:
        raise
    except Exception as e:
        raise AotError(f"tpu-inference did not build the assistant for "
                       f"these flags: {type(e).__name__}: {e}") from e
    # Its parameters that are not the target's (the embedding is shared).
    target_leaves = {id(x) for x in model.state_leaves}
    own = [x for x in proposer.state_leaves if id(x) not in target_leaves]
    report.assistant_weight_bytes = sum(_nbytes_per_chip(x) for x in own)
    report.plan_assistant_weight_bytes = plan_assistant_bytes
    report.weight_bytes += report.assistant_weight_bytes

    # Under gemma_qat's sliding-window KV (several cache groups), the draft
    # layers read their sources' groups: the plugin's own bookkeeping
    # (fixes/sliding_window.py `_read_for_the_drafter`, as its
    # initialize_kv_cache runs it), and the proposer's block tables, one
    # per group read, interleaved per request (its `propose` wrapper).
    rows = sliding_window.row_layout(text) if p.kv_sliding_window else None
    reads_were = dict(sliding_window._draft_reads)
    tables = 1
    try:
        sliding_window._draft_reads.clear()
        if rows is not None and len(groups) > 1:
            places, source = {}, {}
            for draft, target_layer in draft_sources.items():
                place = rows.place.get(int(target_layer.split(".")[1]))
                places[draft] = None if place is None else \
                    sliding_window.RowPlace(*place, rows.slots_per_row)
                source[draft] = target_layer if place is None \
                    else f"layer.{place[0]}"
            manager = types.SimpleNamespace(gemma_qat_draft_places=places)
            sliding_window._read_for_the_drafter(manager, [
                types.SimpleNamespace(layer_names=list(names) + [
                    d for d, s in source.items() if s in names])
                for names in group_names])
            tables = len(manager.gemma_qat_draft_groups)
        _compile_draft_programs(
            report, proposer, Eagle3Proposer, mesh, kv_caches,
            layer_to_cache, paddings, attn_reqs, max_num_reqs, max_blocks,
            tables, k, vllm_config, AttentionMetadata, ShardingAxisName,
            NamedSharding, P, jax, jnp, to_jax_dtype, replace, log)
    finally:  # the plugin's state as it was
        sliding_window._draft_reads.clear()
        sliding_window._draft_reads.update(reads_were)


def _compile_draft_programs(report, proposer, Eagle3Proposer, mesh,
                            kv_caches, layer_to_cache, paddings, attn_reqs,
                            max_num_reqs, max_blocks, tables, k, vllm_config,
                            AttentionMetadata, ShardingAxisName,
                            NamedSharding, P, jax, jnp, to_jax_dtype,
                            replace, log) -> None:
    data = NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA))
    rows2d = NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA, None))

    def sds(shape, dtype, sharding=data):
        return _sds(shape, dtype, sharding)

    model_config = vllm_config.model_config
    draft_hidden = vllm_config.speculative_config.draft_model_config \
        .get_hidden_size()
    target_hidden = model_config.get_hidden_size()
    dtype = to_jax_dtype(model_config.dtype)
    per_req = sds((max_num_reqs, ), jnp.int32)
    for num_tokens in paddings:
        for num_reqs in attn_reqs:
            ids = sds((num_tokens, ), jnp.int32)
            md = AttentionMetadata(
                input_positions=sds((num_tokens, ), jnp.int32),
                block_tables=sds((max_num_reqs * max_blocks, ), jnp.int32),
                seq_lens=per_req,
                query_start_loc=sds((max_num_reqs + 1, ), jnp.int32),
                request_distribution=sds((3, ), jnp.int32),
                mamba_state_indices=None, padded_num_reqs=num_reqs)
            # propose: the block tables of every group the drafter reads.
            md_draft = replace(md, block_tables=sds(
                (max_num_reqs * tables * max_blocks, ), jnp.int32))
            prog = Program("drafter_propose", {"num_tokens": num_tokens,
                                               "num_reqs": num_reqs,
                                               "k": k})
            _compile(prog, lambda: Eagle3Proposer._propose.lower(
                proposer, state_leaves=proposer.state_leaves,
                kv_caches=kv_caches, input_ids=ids, attn_metadata=md_draft,
                last_token_indices=per_req,
                target_hidden_states=sds((num_tokens, draft_hidden), dtype,
                                         rows2d),
                num_speculative_tokens=k,
                layer_name_to_kvcache_index=layer_to_cache), mesh, log)
            if prog.ok:
                prog.est_seconds = prog.optimal_seconds + \
                    prog.concat_bitcasts
            report.programs.append(prog)
            prog = Program("drafter_prepare_inputs",
                           {"num_tokens": num_tokens, "num_reqs": num_reqs})
            _compile(prog, lambda: Eagle3Proposer._prepare_inputs.lower(
                proposer, state_leaves=proposer.state_leaves,
                num_reqs=sds((1, ), jnp.int32), block_tables=md.block_tables,
                attn_metadata=md, input_ids=ids,
                aux_hidden_states=(sds((num_tokens, target_hidden),
                                       jnp.bfloat16, rows2d), ),
                last_sampled_token_id=per_req, next_prompt_token_id=per_req,
                is_in_prefill=per_req, num_rejected_tokens=per_req), mesh,
                log)
            if prog.ok:
                prog.est_seconds = prog.optimal_seconds + \
                    prog.concat_bitcasts
            report.programs.append(prog)


def _compile_sampling(report, model_config, mesh, req_paddings, tp,
                      log) -> None:
    """`sample` per request bucket, with and without sampling parameters
    and logprobs, as `_precompile_sampling` does."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.layers.jax.sample.sampling import (
        distributed_sampling_allowed, sample)
    from tpu_inference.layers.jax.sample.sampling_metadata import \
        TPUSupportedSamplingMetadata
    from tpu_inference.utils import align_to
    vocab = align_to(model_config.get_vocab_size(), tp)
    whole = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA))
    key = jax.eval_shape(
        lambda: nnx.Rngs(jax.random.key(model_config.seed)).params())
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=whole)

    sds = _sds

    for num_reqs in req_paddings:
        logits = sds((num_reqs, vocab), jnp.float32, NamedSharding(
            mesh, P(ShardingAxisName.MLP_DATA, ShardingAxisName.MLP_TENSOR)))
        for do_sampling in (True, False):
            for logprobs in (True, False):
                per_req = [sds((num_reqs, ), dt, rows) if do_sampling
                           else None for dt in (jnp.float32, jnp.int32,
                                                jnp.float32)]
                metadata = TPUSupportedSamplingMetadata(
                    temperature=per_req[0], top_k=per_req[1],
                    top_p=per_req[2],
                    _cache_collision_dummy=sds((1 if logprobs else 2, ),
                                               jnp.int32, whole),
                    do_sampling=do_sampling, logprobs=logprobs)
                distributed = distributed_sampling_allowed(
                    logprobs, model_config.logprobs_mode)
                prog = Program("sample", {"num_reqs": num_reqs,
                                          "do_sampling": do_sampling,
                                          "logprobs": logprobs})
                _compile(prog, lambda: sample.lower(
                    key, mesh, logits, metadata,
                    allow_distributed_sampling=distributed), mesh, log)
                if prog.ok:
                    prog.est_seconds = prog.optimal_seconds + \
                        prog.concat_bitcasts
                report.programs.append(prog)


def _sds(shape, dtype, sharding):
    """An abstract argument: its shape, dtype and sharding."""
    import jax
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _add_program(report: Report, mesh, log, name: str, shape: dict,
                 lower) -> None:
    """Compile `lower()` as program `name` at `shape` into the report."""
    prog = Program(name, shape)
    _compile(prog, lower, mesh, log)
    report.programs.append(prog)


def _compile(prog: Program, lower, mesh, log) -> None:
    import jax
    started = time.perf_counter()
    log(f"compiling {prog.label}")
    try:
        with jax.set_mesh(mesh):
            compiled = lower().compile()
    except Exception as e:  # the TPU compiler's error, named with the program
        prog.error = f"{type(e).__name__}: {str(e).strip()[:2000]}"
        prog.compile_s = time.perf_counter() - started
        log(f"FAILED {prog.label}: {prog.error.splitlines()[0]}")
        return
    prog.compile_s = time.perf_counter() - started
    prog.ok = True
    mem = compiled.memory_analysis()
    prog.argument_bytes = mem.argument_size_in_bytes
    prog.output_bytes = mem.output_size_in_bytes
    prog.alias_bytes = mem.alias_size_in_bytes
    prog.temp_bytes = mem.temp_size_in_bytes
    prog.code_bytes = mem.generated_code_size_in_bytes
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    prog.flops = float(cost.get("flops", 0.0))
    prog.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    prog.optimal_seconds = float(cost.get("optimal_seconds", 0.0))
    text = compiled.as_text()
    prog.concat_bitcasts = text.count('custom_call_target="ConcatBitcast"')
    prog.mosaic_calls = text.count('custom_call_target="tpu_custom_call"')
    log(f"compiled {prog.label} in {prog.compile_s:.1f} s")


def _judge(report: Report, p) -> None:
    ok = [prog for prog in report.programs if prog.ok]
    report.max_temp_bytes = max((prog.temp_bytes for prog in ok), default=0)
    report.max_code_bytes = max((prog.code_bytes for prog in ok), default=0)
    if report.lm_weight_bytes != report.plan_lm_weight_bytes:
        report.disagreements.append(
            f"language-model weights per chip: the built model's parameters "
            f"{report.lm_weight_bytes} B, plan {report.plan_lm_weight_bytes} B")
    towers = report.weight_bytes - report.lm_weight_bytes
    plan_towers = report.plan_weight_bytes - report.plan_lm_weight_bytes
    if towers > plan_towers:  # plan counts them whole: an upper bound
        report.disagreements.append(
            f"towers per chip: the built model's {towers} B, more than "
            f"plan's whole-tower bound {plan_towers} B")
    if ok and report.step_weight_bytes != report.lm_laid_out_bytes:
        report.disagreements.append(
            f"language-model weights per chip: the compiled step's "
            f"arguments {report.step_weight_bytes} B, the parameters as "
            f"laid out in HBM {report.lm_laid_out_bytes} B")
    helper, plan_helper = (report.assistant_weight_bytes,
                           report.plan_assistant_weight_bytes)
    if report.assistant and plan_helper is not None and (
            helper > plan_helper or report.tp == 1 and helper != plan_helper):
        report.disagreements.append(
            f"assistant weights per chip: the built drafter's {helper} B "
            f"(its embedding is the target's), plan {plan_helper} B")
    if report.kv_bytes != report.plan_kv_bytes and not report.why_not:
        report.disagreements.append(
            f"KV cache per chip: compiled {report.kv_bytes} B, plan "
            f"{report.plan_kv_bytes} B")
    if report.total_bytes > report.hbm_bytes:
        report.why_not.append(
            f"weights + KV + largest temporary + code "
            f"{report.total_bytes / 1e9:.2f} GB exceed the chip's "
            f"{report.hbm_bytes / 1e9:.2f} GB of HBM")
    report.fits = report.all_compiled and not report.why_not
    report.caveats = [
        "est. seconds are XLA's cost model, not a measurement: optimal_seconds "
        "+ 1 per ConcatBitcast custom call (it comes out negative by exactly "
        "that count) + the KV bytes the step's attention reads at the chip's "
        "nominal HBM bandwidth (RPA v3 declares no cost; worst case: every "
        "request of the bucket at --max-model-len, capped by the cache)",
        "step weights per chip = the compiled step's argument bytes "
        "(memory_analysis) - those of its KV cache and inputs (a program "
        "taking only them); the towers are not its arguments (XLA drops "
        "unused ones); it includes TPU tile padding of small dimensions, "
        "which plan's byte counts (and the parameters' logical bytes) do not",
        "plan counts a vision tower whole on every chip (an upper bound); "
        "tpu-inference splits its attention and MLP under TP",
    ] + ([
        "plan counts the assistant whole on every chip (an upper bound "
        "under TP); the drafter's programs use the target's KV cache and "
        "embedding (no KV of its own)"] if report.assistant else [])
