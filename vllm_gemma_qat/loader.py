"""`--load-format gemma_qat`: stream a Gemma 4 checkpoint's safetensors shards
into tpu-inference's JAX model (or vLLM's torch model), strictly.

Before any tensor is read the headers are checked against the geometry
(missing / wrong-shaped / unexpected tensors, damaged shards,
num_kv_shared_layers); afterwards every model parameter must have been loaded.
"""
from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from vllm_gemma_qat import (assistant, checkpoint, geometry, quantization,
                            weights)
from vllm_gemma_qat.fixes import compile_once

# Under the "vllm" logger so the lines show in vLLM's own log output.
logger = init_logger(f"vllm.{__name__}")


class GemmaQatModelLoader(BaseModelLoader):

    def download_model(self, model_config) -> None:
        self._resolve(model_config)

    def _resolve(self, model_config):
        # snapshot_download honours HF_HUB_OFFLINE (then: local cache only).
        return checkpoint.resolve(model_config.model, model_config.revision,
                                  self.load_config.download_dir,
                                  allow_download=True)

    def load_weights(self, model, model_config) -> None:
        path = self._resolve(model_config)
        ckpt = checkpoint.open_checkpoint(path)
        if assistant.is_assistant(ckpt.config):
            return self._load_assistant(model, ckpt)
        if getattr(model_config, "runner", None) == "draft":
            raise assistant.not_an_assistant(model_config.model, ckpt.config)
        report = geometry.check(ckpt)
        report.raise_if_invalid(path)

        int4_from_bf16 = _int4_from_bf16(model_config, report)
        geometry.check_tensor_parallel(
            report, set(report.quantized) | int4_from_bf16,
            _tensor_parallel_size())
        feed = weights.WeightFeed(report, int4_from_bf16, model_config.dtype)
        progress = getattr(self.load_config, "use_tqdm_on_load", True)
        # One clear of JAX's caches at the end, not one per module: each
        # distinct processing program compiles once (fixes/compile_once.py, patch 0004).
        with compile_once.CompileLog() as compiled, \
                compile_once.one_cache_clear() as deferred:
            loaded = model.load_weights(feed.tensors(ckpt, progress=progress))
            clears = deferred()
        feed.verify(model, loaded, ckpt)
        logger.info("gemma_qat: loaded %d tensors from %s; %s", feed.handed_over,
                    path, feed.skip_summary())
        if compiled.total:  # a JAX model (vLLM's torch model compiles none)
            logger.info("gemma_qat: loading compiled %d XLA programs (%d "
                        "distinct); %d cache clears deferred to one at the "
                        "end", compiled.total, compiled.distinct, clears)
        if feed.int4_modules:
            logger.info("gemma_qat: %d q4_0 bf16 linears recovered exactly and "
                        "served as wNa16 int4", len(feed.int4_modules))
        by_dtype = weights.param_bytes_by_dtype(model)
        logger.info("gemma_qat: model weights by dtype: %s (%d bytes)",
                    weights.describe_bytes(by_dtype), sum(by_dtype.values()))
        kv_share_map = report.geometry.kv_share_map
        if kv_share_map:
            layers = sorted(kv_share_map)
            owned = weights.shared_layer_kv_params(model, kv_share_map)
            logger.info("gemma_qat: KV-shared layers %d-%d own %d K/V "
                        "parameters", layers[0], layers[-1], len(owned))
        shards = weights.sharding_summary(
            model, lambda name: not weights.is_tower_param(name))
        if shards["devices"] > 1:  # what `vllm-gemma-qat plan --tp` predicts
            logger.info(
                "gemma_qat: language-model weights on %d devices: split %d "
                "bytes, %d per device; replicated %d bytes", shards["devices"],
                shards["split"], shards["split_per_device"],
                shards["replicated"])


    def _load_assistant(self, model, ckpt) -> None:
        """The drafter of `--speculative-config '{"model": ASSISTANT}'`
        (tpu-inference builds it through the target's loader): checked
        against its target as strictly as the target is checked, every
        tensor loaded in the served dtype, every parameter accounted for."""
        vllm_config = getattr(model, "vllm_config", None)
        if vllm_config is None:
            from vllm.config import get_current_vllm_config
            vllm_config = get_current_vllm_config()
        target = vllm_config.model_config
        target_path = checkpoint.resolve(target.model, target.revision,
                                         self.load_config.download_dir)
        report = assistant.check(ckpt, checkpoint.read_config(target_path),
                                 target.model)
        report.raise_if_invalid()
        feed = weights.WeightFeed(report, set(), target.dtype)
        progress = getattr(self.load_config, "use_tqdm_on_load", True)
        with compile_once.one_cache_clear() as deferred:
            loaded = model.load_weights(feed.tensors(ckpt, progress=progress))
            deferred()
        feed.verify(model, loaded, ckpt)
        logger.info("gemma_qat: assistant loaded %d tensors from %s (%d "
                    "layers, all KV-shared and Q-only, reading %s's cache); "
                    "weights by dtype: %s", feed.handed_over, ckpt.path,
                    report.geometry.num_layers, target.model,
                    weights.describe_bytes(weights.param_bytes_by_dtype(model)))


def _tensor_parallel_size() -> int:
    from vllm.config import get_current_vllm_config
    return get_current_vllm_config().parallel_config.tensor_parallel_size


def _int4_from_bf16(model_config, report) -> set[str]:
    """Linears to quantize while loading: the model config asks for
    compressed-tensors int4 (e.g. via --hf-overrides) but the checkpoint holds
    them as bf16 (the -qat-q4_0-unquantized export)."""
    quant = getattr(model_config.hf_config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict()
    chosen = geometry.bf16_linears_to_int4(report, quant)
    mixed = geometry.gate_up_mismatches(
        report.geometry.linear_modules(report.prefix), chosen)
    if mixed:
        raise checkpoint.CheckpointError("--hf-overrides quantization_config: "
                                         + "; ".join(mixed[:3]))
    return chosen
