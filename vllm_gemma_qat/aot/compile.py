"""`vllm-gemma-qat compile`: what `vllm serve MODEL --load-format gemma_qat`
compiles at start-up, compiled by libtpu for a TPU topology on a machine
without one.

The flags become a `VllmConfig` through vLLM's `EngineArgs`, as `vllm
serve` parses them, from a directory holding only the checkpoint's
config (no weights are read). `engine.start` then runs the engine core's
own start-up on the topology's chips: tpu-inference's worker and runner,
its model (built abstractly: `__init__.py`'s substitutions), the KV cache
sized by tpu-inference and vLLM, and the runner's precompile, each
program compiled for the topology under the runner's own name and
signature. This module turns that into a report: per program, compiled
or the TPU compiler's error, its memory and XLA's cost estimate; per
chip, weights, KV cache, the largest temporary and generated code against
the chip's HBM and against `plan` for the same flags; and a verdict.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from vllm_gemma_qat.aot import AotError, Topology, substitutions, topology
from vllm_gemma_qat.aot.report import HBM_BYTES_PER_S, Program, Report, judge

KV_DTYPES = {"bf16": "auto", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3",
             "fp8_e5m2": "fp8_e5m2"}

# `compile`'s --no-* flags: the runner's programs they leave out, by name.
SKIPPABLE = {
    "logits": ("compute_logits", ),
    "sampling": (" sample", ),
    "images": ("input_embeddings_merger", "backbone with embeds",
               "vision_encoder", "audio_encoder"),
}


def selection(logits=True, sampling=True, images=True, helpers=True,
              token_buckets=None):
    """Which of the runner's programs to compile: a Program -> bool."""
    wanted = {"logits": logits, "sampling": sampling, "images": images}
    left_out = tuple(n for flag, names in SKIPPABLE.items()
                     if not wanted[flag] for n in names)
    named = tuple(n for names in SKIPPABLE.values() for n in names)

    def select(prog: Program) -> bool:
        if any(n in prog.name for n in left_out):
            return False
        if prog.is_step:
            return not token_buckets or \
                prog.shape.get("num_tokens") in token_buckets
        if prog.name.startswith("drafter_"):
            return True  # the assistant's own programs
        return helpers or any(n in prog.name for n in named)
    return select


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
                  log=None, load_format: str = "gemma_qat",
                  hbm_gib: float | None = None,
                  additional_config: dict | None = None) -> Report:
    """Build and compile; `token_buckets`: compile only these of the
    runner's token buckets (None: all of them); `assistant`: a Gemma 4
    assistant directory served with it (`--speculative-config '{"model":
    assistant, "num_speculative_tokens": k}'`; k required with it);
    `images`: a multimodal model's image programs too (as the runner
    compiles them for a multimodal model); `helpers`: the runner's small
    helper programs too; `load_format` "auto": stock tpu-inference (no
    gemma_qat fix; every layer's KV at full context, as 0.32 allocates
    it); `hbm_gib`: the memory a chip offers (default: the topology's);
    `additional_config`: vLLM's --additional-config (tpu-inference's
    options: `vision_warmup_config`'s image shapes precompile the vision
    encoder)."""
    topo = topology(topology_name)
    if hbm_gib:
        topo = replace(topo, hbm_gib=hbm_gib)
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
            images, helpers, load_format, additional_config)
        if assistant:
            report.assistant = assistant
        return report
    finally:  # the caller's environment back (a server started next)
        os.environ.clear()
        os.environ.update(environ)


def _compile_with_plugin(target, topo, tp, weights, kv_dtype, dtype,
                         max_model_len, max_num_seqs, max_num_batched_tokens,
                         utilization, logits, sampling, token_buckets, log,
                         speculative, images, helpers, load_format,
                         additional_config):
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
    # gemma_qat holds the kernel's int4 scales in f32 (fixes/int4_scales.py)
    table = substitutions(topo, functools.partial(
        _int4_layout, f32_scales=load_format == "gemma_qat"))
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
                              images, helpers, load_format,
                              additional_config)
    finally:  # (the knob, not a substitution: JAX's public config)
        jax.config.update("jax_enable_compilation_cache", cache_was)
        compilation_cache.reset_cache()
        jax.clear_caches()


def _compile_model(target, topo, tp, weights, kv_dtype, dtype, max_model_len,
                   max_num_seqs, max_num_batched_tokens, utilization, logits,
                   sampling, token_buckets, log, table, started, geo,
                   plan_weights,
                   config, planlib, speculative, images,
                   helpers, load_format, additional_config) -> Report:
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
                    load_format, additional_config)
            except ValueError as e:  # pydantic's ValidationError too
                raise AotError(f"vLLM refuses these flags for {target}: "
                               f"{_first_error(e)}") from None
            # None: vLLM's default, the model's max_position_embeddings.
            max_model_len = vllm_config.model_config.max_model_len
            # `plan --tp` for the same flags, weights in the dtype vLLM
            # resolved (--dtype auto: bf16 for a float32 config on TPU).
            served = vllm_config.model_config.dtype
            # --kv-dtype bf16 is vLLM's "auto": the model's dtype
            cache = "fp32" if kv_dtype == "bf16" and served.itemsize == 4 \
                else kv_dtype
            p = planlib.make_plan(
                geo, plan_weights, agents=max_num_seqs,
                context=max_model_len, kv_dtype=cache,
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
                kv_dtype=cache, hbm_gib=topo.hbm_gib,
                utilization=utilization, form=weights, tp=tp,
                dtype_bytes=served.itemsize,
                sliding_window=load_format == "gemma_qat")
            report = _start_and_report(
                vllm_config, desc, topo, tp, p, p_lm, target, weights,
                kv_dtype, utilization, selection(
                    logits, sampling, images, helpers, token_buckets),
                log, speculative[2] if speculative else None)
    report.build_s = time.perf_counter() - started
    return report


def _start_and_report(vllm_config, desc, topo: Topology, tp, p, p_lm, target,
                      weights, kv_dtype, utilization, select, log,
                      plan_assistant_bytes) -> Report:
    import jax
    from vllm.config import set_current_vllm_config

    from vllm_gemma_qat import substitute
    from vllm_gemma_qat.aot import engine
    from vllm_gemma_qat.fixes import sliding_window
    devices = list(desc.devices)[:tp]
    scheduler_config = vllm_config.scheduler_config
    report = Report(
        model=target, topology=topo.name, tp=tp, weights=weights,
        kv_dtype=kv_dtype,
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_seqs=scheduler_config.max_num_seqs,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        block_size=vllm_config.cache_config.block_size, num_blocks=0,
        hosts=len({d.process_index for d in devices}),
        hbm_bytes=int(topo.hbm_gib * 2**30), utilization=utilization,
        plan_weight_bytes=p.weight_bytes_per_chip,
        plan_lm_weight_bytes=p_lm.weight_bytes_per_chip,
        plan_kv_cache_tokens=p.kv_cache_tokens,
        plan_num_blocks=p.kv_pool_blocks)
    log(f"starting the engine for {target} on {topo.name} (TP={tp}, "
        f"{weights})")
    # The plugin's bookkeeping for the drafter's reads, as it was after.
    reads_were = dict(sliding_window._draft_reads)
    os.environ["SKIP_JAX_PRECOMPILE"] = "0"  # the runner's precompile on
    try:
        with set_current_vllm_config(vllm_config):
            started = engine.start(vllm_config, devices, report.hbm_bytes,
                                   select, log)
    except (AotError, substitute.MissingTarget):
        raise
    except Exception as e:
        raise AotError(f"tpu-inference did not start {target} for these "
                       f"flags: {type(e).__name__}: {e}") from e
    finally:
        sliding_window._draft_reads.clear()
        sliding_window._draft_reads.update(reads_were)
    report.programs = started.programs
    runner = started.runner
    if started.refused:
        report.why_not.append(f"vLLM does not start: {started.refused}")
        if p.kv_pool_blocks >= p.kv_blocks_per_agent:
            report.disagreements.append(
                f"plan gives the KV cache {p.kv_pool_blocks} pages, one "
                f"request's --max-model-len needs {p.kv_blocks_per_agent}: "
                "plan would start")
    if runner is None:
        judge(report)
        return report

    # Per chip: the parameters, the language model's part, the KV cache.
    chip = devices[0].id
    report.weight_bytes = engine.bytes_on(runner.state, chip)
    lm = [x for path, x in jax.tree_util.tree_flatten_with_path(
              runner.state)[0]
          if not any(t in jax.tree_util.keystr(path)
                     for t in ("vision", "audio"))]
    report.lm_weight_bytes = engine.bytes_on(lm, chip)
    holder = jax.jit(lambda *xs: None, keep_unused=True)
    with jax.set_mesh(runner.mesh):
        report.lm_laid_out_bytes = holder.lower(*lm).compile() \
            .memory_analysis().argument_size_in_bytes
    spec = vllm_config.speculative_config
    if spec is not None:
        report.assistant = str(spec.draft_model_config.model)
        report.num_speculative_tokens = spec.num_speculative_tokens
        # the drafter's parameters that are not the target's (the
        # embedding is shared)
        target_leaves = {id(x) for x in jax.tree.leaves(runner.state)}
        own = [x for x in jax.tree.leaves(runner.drafter.state)
               if id(x) not in target_leaves]
        report.assistant_weight_bytes = engine.bytes_on(own, chip)
        report.plan_assistant_weight_bytes = plan_assistant_bytes
        report.weight_bytes += report.assistant_weight_bytes
    if started.kv_cache_config is not None:
        report.num_blocks = started.kv_cache_config.num_blocks
        report.kv_bytes = engine.bytes_on(runner.kv_caches, chip)
        report.plan_kv_bytes = report.num_blocks * p.kv_block_bytes
        if report.num_blocks != p.kv_pool_blocks:
            why = f"KV cache pages: tpu-inference sized {report.num_blocks}, " \
                f"plan {p.kv_pool_blocks}"
            if tp > 1 and report.num_blocks > p.kv_pool_blocks and \
                    report.weight_bytes < report.plan_weight_bytes:
                report.caveats.append(
                    why + ": plan counts the towers whole on every chip (an "
                    "upper bound under TP), so its budget is smaller by the "
                    "difference")
            else:
                report.disagreements.append(why)
    _estimate_steps(report, runner, started, holder, topo, p, chip)
    judge(report)
    return report


def _estimate_steps(report, runner, started, holder, topo, p,
                    chip) -> None:
    """Per step program: the parameters it takes as laid out in HBM, the KV
    bytes its attention may read (arithmetic: RPA v3 declares no cost) and
    XLA's time estimate with them."""
    import jax

    from vllm_gemma_qat.aot import engine
    text = runner.model_config.hf_text_config
    block_size, max_model_len = report.block_size, report.max_model_len
    window = getattr(text, "sliding_window", None) \
        if p.kv_sliding_window else None
    # Bytes of KV one token of context costs each layer's attention
    # (shared layers read their source's cache; a sliding layer reads its
    # whole row, at most window + a page of tokens), per chip.
    read_per_token = {True: 0, False: 0}  # by: reads the window only
    tokens = max(report.num_blocks, 1) * block_size
    for name, n in runner.layer_name_to_kvcache_index.items():
        if not name.startswith("layer."):
            continue
        i = int(name.split(".")[1])
        read_per_token[bool(window) and text.layer_types[i] ==
                       "sliding_attention"] += engine.bytes_on(
            runner.kv_caches[n], chip) // tokens
    bw = HBM_BYTES_PER_S.get(topo.tpu_version)
    for prog in report.programs:
        if not prog.ok:
            continue
        if not prog.is_step:
            prog.est_seconds = prog.optimal_seconds + prog.concat_bitcasts
            continue
        if prog.name.endswith("backbone"):  # the text-only step
            # its kept arguments after the parameters (the first argument)
            others = [x for i, x in started.step_arguments[prog.label]
                      if i >= len(jax.tree.leaves(runner.state_leaves))]
            with jax.set_mesh(runner.mesh):
                others = holder.lower(*others).compile().memory_analysis() \
                    .argument_size_in_bytes
            report.step_weight_bytes = prog.argument_bytes - others
        num_reqs = prog.shape.get("num_reqs", 1)
        # Context every request of the bucket could hold.
        ctx = min(num_reqs * max_model_len, tokens)
        in_window = num_reqs * min(max_model_len, (window or 0) + block_size)
        prog.kv_read_bytes = (ctx * read_per_token[False]
                              + in_window * read_per_token[True])
        if bw:
            prog.est_seconds = (prog.optimal_seconds + prog.concat_bitcasts
                                + prog.kv_read_bytes / bw)


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
    # The runner's CompilationManager would point JAX's persistent cache at
    # vLLM's (deviceless executables cannot be loaded; and JAX's config
    # outlives the compile), and the worker would report usage stats.
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
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
                 speculative_config=None, load_format="gemma_qat",
                 additional_config=None):
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=str(model_dir), load_format=load_format,
                      skip_tokenizer_init=True, tensor_parallel_size=tp,
                      dtype=dtype, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens,
                      kv_cache_dtype=KV_DTYPES[kv_dtype],
                      gpu_memory_utilization=utilization,
                      speculative_config=speculative_config,
                      additional_config=additional_config or {})
    return args.create_engine_config()


def _int4_layout(model, mesh, f32_scales: bool = True) -> None:
    """wNa16 linears: the layout `WNA16LinearMethod.
    process_weights_after_loading` leaves (int4 [in, out]; the scale
    [in / group, 1, out] for gmm_v2, in f32 under gemma_qat (`f32_scales`),
    else [in / group, out] in bf16; shardings as `shard_linear_weights`
    gives them), in place of the checkpoint's packed parameters."""
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
            scale_dtype = jnp.float32 if f32_scales else jnp.bfloat16
        else:
            scale_shape = (method.num_groups, method.out_features)
            scale_spec, scale_dtype = spec, jnp.bfloat16
        scale = jax.ShapeDtypeStruct(scale_shape, scale_dtype,
                                     sharding=NamedSharding(mesh, scale_spec))
        for name in ("weight_packed", "weight_scale", "weight_shape"):
            delattr(module, name)
        module.weight = nnx.Param(weight)
        module.weight_scale = nnx.Param(scale)
