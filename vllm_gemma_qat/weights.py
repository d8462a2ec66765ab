"""Checkpoint-name fixes between a Gemma 4 export and the model being loaded,
and the strict accounting around `model.load_weights`."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm_gemma_qat.checkpoint import Checkpoint, CheckpointError
from vllm_gemma_qat.geometry import Report, is_shared_kv_tensor


def sanitize(name: str, kv_share_map: dict[int, int],
             text_only_prefix: bool) -> str | None:
    """The name to hand to the model, or None to skip the tensor."""
    if is_shared_kv_tensor(name, kv_share_map):
        return None  # regular exports ship K/V that shared layers never read
    if text_only_prefix and name.startswith("model."):
        # transformers writes a text-only Gemma4ForCausalLM as `model.*`;
        # tpu-inference resolves its weights under `model.language_model.*`.
        return "model.language_model." + name[len("model."):]
    return name


@dataclass
class LoadPlan:
    report: Report
    text_only_prefix: bool
    skipped: list[str] = field(default_factory=list)
    handed_over: int = 0

    @classmethod
    def for_model(cls, report: Report, model) -> "LoadPlan":
        is_jax = type(model).__module__.startswith("tpu_inference.")
        return cls(report, text_only_prefix=is_jax and report.prefix == "model.")

    def stream(self, ckpt: Checkpoint):
        from vllm_gemma_qat.loader import stream_tensors
        share = self.report.geometry.kv_share_map
        renamed = {}
        for name in ckpt.tensors:
            new = sanitize(name, share, self.text_only_prefix)
            if new is None:
                self.skipped.append(name)
            else:
                renamed[name] = new
        for name, tensor in stream_tensors(ckpt, renamed.__contains__):
            self.handed_over += 1
            yield renamed[name], tensor

    def skip_summary(self) -> str:
        if not self.skipped:
            return "skipped none"
        layers = sorted(self.report.geometry.kv_share_map)
        return (f"skipped {len(self.skipped)} unused k_proj/v_proj/k_norm "
                f"tensors of KV-shared layers {layers[0]}-{layers[-1]} (they "
                f"read K/V from their source layer's cache)")

    def verify(self, model, loaded: set[str] | None, ckpt: Checkpoint) -> None:
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
