"""Which checkpoint tensors go to the model, and the strict accounting
around `model.load_weights`."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator

import ml_dtypes  # also registers bfloat16 / int4 with numpy
import numpy as np

from vllm_gemma_qat.checkpoint import Checkpoint, CheckpointError, numel
from vllm_gemma_qat.fixes import weight_dtype
from vllm_gemma_qat.geometry import CheckpointReport
from vllm_gemma_qat.quantization import PACKED_SUFFIXES

_PARAM_LAYER_KV = re.compile(r"layers\.(\d+)\.self_attn\.(?:k_proj|v_proj|k_norm)\.")


@dataclass
class WeightFeed:
    """What `model.load_weights` is fed from a checked checkpoint, and the
    accounting that every tensor and every parameter was used."""
    report: CheckpointReport
    # Modules stored as bf16 on the q4_0 grid that the model holds as wNa16
    # int4: their weight is handed over packed (see vllm_gemma_qat.int4).
    int4_modules: set[str] = field(default_factory=set)
    # The served dtype (vLLM's --dtype, made torch's once): floating-point
    # tensors are handed over in it (fixes/weight_dtype.py, patch 0005).
    dtype: object = None
    handed_over: int = 0

    def __post_init__(self):
        self.dtype = weight_dtype.served_dtype(self.dtype)

    @property
    def skipped(self) -> list[str]:
        """Regular exports ship k_proj / v_proj / k_norm for KV-shared
        layers, which never read them."""
        return self.report.skipped

    def tensors(self, ckpt: Checkpoint, progress: bool = False):
        """(name, tensor) for `load_weights`; `progress`: a progress bar
        over the tensors (as vLLM's own loader shows one over shards)."""
        from tqdm.auto import tqdm
        skip = set(self.skipped)
        desc = "gemma_qat: loading tensors" + (
            f" ({len(self.int4_modules)} q4_0 linears to int4)"
            if self.int4_modules else "")
        with tqdm(total=len(ckpt.tensors) - len(skip), desc=desc,
                  unit="tensor", disable=not progress) as bar:
            for name, tensor in stream_tensors(ckpt, lambda n: n not in skip):
                self.handed_over += 1
                module = name.removesuffix(".weight")
                if module in self.int4_modules:
                    yield from packed_int4(module, tensor)
                else:
                    yield name, weight_dtype.in_served_dtype(
                        name, tensor, self.dtype)
                bar.update()

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


def _param_values(model):
    for name, param in model.named_parameters():
        yield name, param.get_value() if hasattr(param, "get_value") else param


def _nbytes(shape, dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    bits = 4 if name in ("int4", "uint4") else np.dtype(name).itemsize * 8
    return numel(shape) * bits // 8


def param_bytes_by_dtype(model) -> dict[str, int]:
    """Bytes the model's parameters take on device, by dtype (int4: half a
    byte per value)."""
    out: dict[str, int] = {}
    for _, value in _param_values(model):
        name = str(value.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + _nbytes(value.shape, value.dtype)
    return out


def sharding_summary(model, include=lambda name: True) -> dict[str, int]:
    """How the parameters (those `include` accepts) lie on the devices:
    bytes of those split across devices (in all, and on the first device)
    and of those held whole."""
    out = {"devices": 1, "split": 0, "split_per_device": 0, "replicated": 0}
    devices = set()
    for name, value in _param_values(model):
        if not include(name):
            continue
        nbytes = _nbytes(value.shape, value.dtype)
        shards = getattr(value, "addressable_shards", None) or []
        devices.update(shard.device for shard in shards)
        first = _nbytes(shards[0].data.shape, value.dtype) if shards else nbytes
        if first < nbytes:
            out["split"] += nbytes
            out["split_per_device"] += first
        else:
            out["replicated"] += nbytes
    out["devices"] = max(1, len(devices))
    return out


def is_tower_param(name: str) -> bool:
    return any(t in name for t in ("vision", "audio"))


def shared_layer_kv_params(model, kv_share_map: dict[int, int]) -> list[str]:
    """Parameters of k_proj / v_proj / k_norm on the language model's
    KV-shared layers (none when the #3225 fix is in place). The vision and
    audio towers number their layers too, each with K/V of its own."""
    return [name for name, _ in model.named_parameters()
            if not is_tower_param(name)
            and (m := _PARAM_LAYER_KV.search(name))
            and int(m.group(1)) in kv_share_map]


def describe_bytes(by_dtype: dict[str, int]) -> str:
    return ", ".join(f"{name} {n / 2**20:.1f} MiB"
                     for name, n in sorted(by_dtype.items()))
