"""Which checkpoint tensors go to the model, and the strict accounting
around `model.load_weights`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import ml_dtypes  # also registers bfloat16 / int4 with numpy
import numpy as np

from vllm_gemma_qat.checkpoint import Checkpoint, CheckpointError
from vllm_gemma_qat.geometry import (PACKED_SUFFIXES, Report,
                                     is_shared_kv_tensor)


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
    # Modules stored as bf16 on the q4_0 grid that the model holds as wNa16
    # int4: their weight is handed over packed (see vllm_gemma_qat.int4).
    int4_modules: set[str] = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)
    handed_over: int = 0

    def stream(self, ckpt: Checkpoint):
        keep, self.skipped = sanitize(ckpt.tensors,
                                      self.report.geometry.kv_share_map)
        for name, tensor in stream_tensors(ckpt, keep.__contains__):
            self.handed_over += 1
            module = name.removesuffix(".weight")
            if module in self.int4_modules:
                yield from packed_int4(module, tensor)
            else:
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
        loaded = set(loaded)
        params = {name for name, _ in model.named_parameters()}
        missing = sorted(p for p in params - loaded
                         if not _loaded_as_packed_int4(p, loaded))
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


def _loaded_as_packed_int4(param: str, loaded: set[str]) -> bool:
    """tpu-inference's wNa16 method loads weight_packed / weight_scale /
    weight_shape, then replaces them by the int4 `weight` and its
    `weight_scale`: those count as loaded when all three arrived."""
    module, _, leaf = param.rpartition(".")
    return leaf in ("weight", "weight_scale") and all(
        f"{module}.{suffix}" in loaded for suffix in PACKED_SUFFIXES)


def packed_int4(module: str, weight) -> Iterator[tuple[str, object]]:
    """A bf16 q4_0-grid weight as the compressed-tensors pack-quantized
    tensors tpu-inference's wNa16 method loads."""
    import torch

    from vllm_gemma_qat import int4
    if weight.dtype != torch.bfloat16:
        raise int4.OffGridError(
            f"{module}.weight: {weight.dtype}, not a bf16 q4_0 QAT weight")
    w = weight.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    q, d = int4.recover_grid(w, f"{module}.weight")
    yield f"{module}.weight_packed", torch.from_numpy(int4.pack_int4(q))
    yield f"{module}.weight_scale", torch.from_numpy(d.view(np.int16)).view(
        torch.bfloat16)
    yield f"{module}.weight_shape", torch.tensor(list(weight.shape))


def param_bytes_by_dtype(model) -> dict[str, int]:
    """Bytes the model's parameters take on device, by dtype (int4: half a
    byte per value)."""
    out: dict[str, int] = {}
    for _, param in model.named_parameters():
        value = param.get_value() if hasattr(param, "get_value") else param
        name = str(value.dtype).removeprefix("torch.")
        bits = 4 if name in ("int4", "uint4") else np.dtype(name).itemsize * 8
        out[name] = out.get(name, 0) + int(np.prod(value.shape)) * bits // 8
    return out


def describe_bytes(by_dtype: dict[str, int]) -> str:
    return ", ".join(f"{name} {n / 2**20:.1f} MiB"
                     for name, n in sorted(by_dtype.items()))
