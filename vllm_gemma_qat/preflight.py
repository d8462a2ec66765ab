"""Fail fast: the header check (< 0.1 s) runs where `vllm serve` / `LLM()`
turn their arguments into a config, before any engine process starts, so a
damaged gemma_qat checkpoint ends the command with one named error instead
of a failed engine start-up. So does a Gemma 4 assistant named by
`--speculative-config` that does not fit its target (`assistant.py`).

A checkpoint not on this machine yet (a hub id not in the cache) is left to
the engine's loader, which downloads it and runs the same check.
"""
from __future__ import annotations

import functools
import os

from vllm_gemma_qat import assistant, checkpoint, geometry
from vllm_gemma_qat.checkpoint import CheckpointError
from vllm_gemma_qat.gate import is_gemma_qat
from vllm_gemma_qat.substitute import Substitution


def substitutions() -> list[Substitution]:
    return [Substitution(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        check_before_engine, "a damaged gemma_qat checkpoint stops `vllm "
        "serve` before any engine starts, with the named error", wraps=True)]


def check_before_engine(create_engine_config):
    """Wraps `EngineArgs.create_engine_config`."""

    @functools.wraps(create_engine_config)
    def wrapped(self, *args, **kwargs):
        if is_gemma_qat(self):
            check_local_checkpoint(self.model, getattr(self, "revision", None),
                                   getattr(self, "download_dir", None),
                                   getattr(self, "tensor_parallel_size", 1),
                                   getattr(self, "hf_overrides", None))
            if not _draft_has_own_load_config(self):
                check_local_assistant(self.model, _draft_model(self),
                                      getattr(self, "revision", None),
                                      getattr(self, "download_dir", None))
        return create_engine_config(self, *args, **kwargs)

    return wrapped


def _draft_model(engine_args) -> str | None:
    """`--speculative-config`'s draft model, if any (a dict there)."""
    spec = getattr(engine_args, "speculative_config", None)
    if isinstance(spec, dict):
        return spec.get("model")
    return getattr(spec, "model", None)


def _draft_has_own_load_config(engine_args) -> bool:
    spec = getattr(engine_args, "speculative_config", None)
    if isinstance(spec, dict):
        return spec.get("draft_load_config") is not None
    return getattr(spec, "draft_load_config", None) is not None


def check_local_assistant(target: str, draft: str | None,
                          revision: str | None = None,
                          download_dir: str | None = None) -> None:
    """A Gemma 4 assistant named by `--speculative-config` checked against
    its target from both headers, when both are on this machine (else the
    engine's loader checks it after downloading). Another kind of draft
    model (an EAGLE head, say) is an error here: gemma_qat's loader would
    be asked to load it (the caller skips drafts with a draft_load_config
    of their own)."""
    if not draft:
        return
    try:
        target_path = checkpoint.resolve(target, revision, download_dir,
                                         allow_download=False)
        draft_path = checkpoint.resolve(draft, None, download_dir,
                                        allow_download=False)
        for model, path in ((target, target_path), (draft, draft_path)):
            if not os.path.isdir(model):
                checkpoint.shard_files(path)
        config = checkpoint.read_config(draft_path)
    except CheckpointError:
        return  # not (all) here yet: the engine's loader checks it
    if not assistant.is_assistant(config):
        # gemma_qat's loader would be asked to load it (no draft_load_config)
        raise assistant.not_an_assistant(draft, config)
    report = assistant.check(checkpoint.open_checkpoint(draft_path),
                             checkpoint.read_config(target_path), target)
    report.raise_if_invalid()


def check_local_checkpoint(model: str, revision: str | None = None,
                           download_dir: str | None = None, tp: int = 1,
                           hf_overrides=None) -> None:
    try:
        path = checkpoint.resolve(model, revision, download_dir,
                                  allow_download=False)
        if not os.path.isdir(model):  # a hub id found in the HF cache
            checkpoint.shard_files(path)
    except CheckpointError:
        return  # not (all) here yet: the engine downloads it, then checks
    try:
        report = geometry.check(checkpoint.open_checkpoint(path))
        report.raise_if_invalid(path)
        quant = (hf_overrides.get("quantization_config")
                 if isinstance(hf_overrides, dict) else None)
        geometry.check_tensor_parallel(
            report, set(report.quantized)
            | geometry.bf16_linears_to_int4(report, quant), tp)
    except CheckpointError as e:
        raise CheckpointError(f"{e} [`vllm-gemma-qat inspect {model}` shows "
                              "the full report]") from None
