"""Which checkpoint tensors go to the model, and the strict accounting
around `model.load_weights`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from vllm_gemma_qat.checkpoint import Checkpoint, CheckpointError
from vllm_gemma_qat.geometry import Report, is_shared_kv_tensor


def sanitize(names, kv_share_map: dict[int, int]) -> tuple[set, list]:
    """Split checkpoint tensor names into (to load, to skip). Regular exports
    ship k_proj/v_proj/k_norm for KV-shared layers, which never read them."""
    keep, skip = set(), []
    for name in names:
        if is_shared_kv_tensor(name, kv_share_map):
            skip.append(name)
        else:
            keep.add(name)
    return keep, sorted(skip)


@dataclass
class LoadPlan:
    report: Report
    skipped: list[str] = field(default_factory=list)
    handed_over: int = 0

    def stream(self, ckpt: Checkpoint):
        keep, self.skipped = sanitize(ckpt.tensors,
                                      self.report.geometry.kv_share_map)
        for name, tensor in stream_tensors(ckpt, keep.__contains__):
            self.handed_over += 1
            yield name, tensor

    def skip_summary(self) -> str:
        if not self.skipped:
            return "skipped none"
        layers = sorted(self.report.geometry.kv_share_map)
        return (f"skipped {len(self.skipped)} unused k_proj/v_proj/k_norm "
                f"tensors of KV-shared layers {layers[0]}-{layers[-1]} (they "
                f"read K/V from their source layer's cache)")

    def verify(self, model, loaded, ckpt: Checkpoint) -> None:
        """Every checkpoint tensor was read (loaded or skipped on purpose;
        the model's loader raises on names it does not know), and every
        model parameter was loaded."""
        if self.handed_over + len(self.skipped) != len(ckpt.tensors):
            raise CheckpointError(
                f"{ckpt.path}: only {self.handed_over + len(self.skipped)} of "
                f"{len(ckpt.tensors)} checkpoint tensors were read")
        if loaded is None:
            raise CheckpointError(
                f"{type(model).__name__}.load_weights reports no loaded "
                "weights; gemma_qat cannot check completeness")
        params = {name for name, _ in model.named_parameters()}
        missing = sorted(params - set(loaded))
        if missing:
            raise CheckpointError(
                f"{ckpt.path}: model parameters not initialized from the "
                f"checkpoint: {missing}")


def stream_tensors(ckpt: Checkpoint, keep) -> Iterator[tuple[str, object]]:
    """(name, torch tensor) for every tensor `keep(name)` accepts, one shard
    at a time; the others are never read."""
    from safetensors import safe_open
    for file in ckpt.files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    yield name, f.get_tensor(name)
