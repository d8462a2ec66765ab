"""`--load-format gemma_qat`: stream a Gemma 4 checkpoint's safetensors shards
into tpu-inference's JAX model (or vLLM's torch model), strictly.

Before any tensor is read the headers are checked against the geometry
(missing / wrong-shaped / unexpected tensors, damaged shards,
num_kv_shared_layers); afterwards every model parameter must have been loaded.
"""
from __future__ import annotations

import logging
import os
from typing import Iterator

from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from vllm_gemma_qat import checkpoint, geometry, weights

logger = logging.getLogger(__name__)


class GemmaQatModelLoader(BaseModelLoader):

    def download_model(self, model_config) -> None:
        self._resolve(model_config, allow_download=True)

    def _resolve(self, model_config, allow_download: bool):
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
        return checkpoint.resolve(model_config.model, model_config.revision,
                                  self.load_config.download_dir,
                                  allow_download=allow_download and not offline)

    def load_weights(self, model, model_config) -> None:
        path = self._resolve(model_config, allow_download=True)
        ckpt = checkpoint.open_checkpoint(path)
        report = geometry.check(ckpt)
        report.raise_if_invalid(path)

        plan = weights.LoadPlan.for_model(report, model)
        loaded = model.load_weights(plan.stream(ckpt))
        plan.verify(model, loaded, ckpt)
        logger.info("gemma_qat: loaded %d tensors from %s; %s", plan.handed_over,
                    path, plan.skip_summary())


def stream_tensors(ckpt: checkpoint.Checkpoint,
                   keep) -> Iterator[tuple[str, object]]:
    """(name, torch tensor) for every tensor `keep(name)` accepts, one shard
    at a time; the others are never read."""
    from safetensors import safe_open
    for file in ckpt.files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    yield name, f.get_tensor(name)
