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
`_precompile_compute_logits` / `_precompile_sampling`. Not compiled here:
the runner's other small helpers (placeholder substitution, array
selection, logprob gathering, structured decoding), and a multimodal
model's image programs (vision encoder, embedding merge, the step with
input embeddings).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
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
                  log=None, load_format: str = "gemma_qat") -> Report:
    """Build and compile; `token_buckets`: compile only these of the
    runner's token buckets (None: all of them); `load_format` "auto":
    stock tpu-inference (no gemma_qat fix; every layer's KV at full
    context, as 0.32 allocates it)."""
    topo = topology(topology_name)
    tp = tp or topo.chips
    if tp > topo.chips:
        raise AotError(f"--tp {tp} needs {tp} chips; {topo.name} has "
                       f"{topo.chips}")
    if kv_dtype not in KV_DTYPES:
        raise AotError(f"--kv-dtype {kv_dtype!r}: one of "
                       f"{', '.join(KV_DTYPES)}")
    log = log or (lambda msg: None)
    environ = dict(os.environ)
    try:
        _environment(topo)
        return _compile_with_plugin(target, topo, tp, weights, kv_dtype,
                                    dtype, max_model_len, max_num_seqs,
                                    max_num_batched_tokens, utilization,
                                    logits, sampling, token_buckets, log,
                                    load_format)
    finally:  # the caller's environment back (a server started next)
        os.environ.clear()
        os.environ.update(environ)


def _compile_with_plugin(target, topo, tp, weights, kv_dtype, dtype,
                         max_model_len, max_num_seqs, max_num_batched_tokens,
                         utilization, logits, sampling, token_buckets, log,
                         load_format):
    started = time.perf_counter()

    from vllm_gemma_qat import cli, plan as planlib
    geo, plan_weights, _, _, config = cli._plan_inputs(
        target, int4_export_ok=weights == "int4")

    import jax

    from vllm.plugins import load_general_plugins
    load_general_plugins()  # the plugin, as `vllm serve` loads it
    table = substitutions(topo, _int4_layout)
    # Deviceless executables cannot be loaded here: keep them out of JAX's
    # persistent cache (a later read fails with a warning).
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return _compile_model(target, topo, tp, weights, kv_dtype, dtype,
                              max_model_len, max_num_seqs,
                              max_num_batched_tokens, utilization, logits,
                              sampling, token_buckets, log, table, started,
                              geo,
                              plan_weights, config, planlib, load_format)
    finally:  # (the knob, not a substitution: JAX's public config)
        jax.config.update("jax_enable_compilation_cache", cache_was)


def _compile_model(target, topo, tp, weights, kv_dtype, dtype, max_model_len,
                   max_num_seqs, max_num_batched_tokens, utilization, logits,
                   sampling, token_buckets, log, table, started, geo,
                   plan_weights,
                   config, planlib, load_format="gemma_qat") -> Report:
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
    # checkpoint; a hub repo is checked from its headers by _plan_inputs).
    from vllm_gemma_qat import cli, preflight, quantization
    bare = Path(target).is_file() or (Path(target).is_dir()
                                      and cli._config_only(Path(target)))
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
        with substitute.applied(table, "vllm-gemma-qat AOT mode"):
            try:
                vllm_config = _vllm_config(
                    model_dir, tp, weights, kv_dtype, dtype, max_model_len,
                    max_num_seqs, max_num_batched_tokens, utilization,
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
                                        token_buckets, log)
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
                 load_format="gemma_qat"):
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=str(model_dir), load_format=load_format,
                      skip_tokenizer_init=True, tensor_parallel_size=tp,
                      dtype=dtype, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens,
                      kv_cache_dtype=KV_DTYPES[kv_dtype],
                      gpu_memory_utilization=utilization)
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
                       token_buckets, log) -> Report:
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
        text = model_config.hf_config.text_config
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
        if token_buckets:
            paddings = [t for t in paddings if t in token_buckets]
        max_num_reqs = max(max_num_seqs, runner_utils.MIN_NUM_SEQS)
        attn_reqs = [r for r in runner_utils.get_attn_req_paddings(
            runner_utils.MIN_NUM_SEQS, max_num_seqs)]
        req_paddings = runner_utils.get_req_paddings(
            runner_utils.MIN_NUM_SEQS, max_num_reqs)

        batch = NamedSharding(mesh, P(ShardingAxisName.BATCH))
        data = NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA))

        def sds(shape, dtype, sharding):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

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
        for num_tokens in paddings:
            for num_reqs in attn_reqs:
                ids = sds((num_tokens, ), jnp.int32, batch)
                positions = sds((num_tokens, ), jnp.int32, data)
                per_group = [AttentionMetadata(
                    input_positions=positions,
                    block_tables=sds((max_num_reqs * max_blocks, ), jnp.int32,
                                     batch),
                    seq_lens=sds((max_num_reqs, ), jnp.int32, batch),
                    query_start_loc=sds((max_num_reqs + 1, ), jnp.int32,
                                        batch),
                    request_distribution=sds((3, ), jnp.int32, batch),
                    mamba_state_indices=None, padded_num_reqs=num_reqs,
                    pcp=None) for _ in groups]
                # As the runner passes them: one metadata, or one per group.
                md = per_group[0] if len(groups) == 1 else \
                    GroupedAttentionMetadata(per_group, group_names)
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
        if logits:
            hidden = model_config.get_hidden_size()
            for num_reqs in req_paddings:
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

    _judge(report, p)
    return report


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

    def sds(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

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
    prog.concat_bitcasts = compiled.as_text().count(
        'custom_call_target="ConcatBitcast"')
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
    ]
