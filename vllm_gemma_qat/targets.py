"""What a command's target is: a checkpoint directory, a repo id (the HF
cache, else its headers from the hub) or a config.json, resolved to its
config, safetensors headers and geometry. Shared by the CLI and `compile`
(vllm_gemma_qat.aot); imports neither vLLM nor JAX."""
from __future__ import annotations

import json
from pathlib import Path

from vllm_gemma_qat import assistant, checkpoint, geometry, plan
from vllm_gemma_qat.checkpoint import CheckpointError


def open_headers(target: str, remote_ok: bool = False):
    """The checkpoint's headers: a local directory or the HF cache, else
    (`remote_ok`, a repo id) straight from the hub, before any download."""
    try:
        path = checkpoint.resolve(target, allow_download=False)
    except CheckpointError:
        if not (remote_ok and looks_like_repo_id(target)):
            raise
        ckpt = checkpoint.open_remote(target)
        return ckpt, geometry.check(ckpt)
    if config_only(path):
        raise CheckpointError(
            f"{path}: config.json but no *.safetensors shards (weights not "
            "downloaded?); inspect reads the shards' headers. `vllm-gemma-qat "
            f"plan {target}` works from config.json alone")
    ckpt = checkpoint.open_checkpoint(path)
    return ckpt, geometry.check(ckpt)


def looks_like_repo_id(target: str) -> bool:
    return (target.count("/") == 1 and not target.startswith((".", "/"))
            and not Path(target).exists())


def config_only(path: Path) -> bool:
    return ((path / "config.json").is_file()
            and not (path / "model.safetensors.index.json").is_file()
            and not any(path.glob("*.safetensors")))


def plan_inputs(target: str, int4_export_ok: bool = False):
    """(Geometry, plan.Weights as loaded, their dtypes, source) from a
    checkpoint (headers) or a bare config.json (language model from the
    geometry, bf16 assumed). `int4_export_ok`: a w4a16 export's language
    model counted from its geometry in bf16 (for the int4 form), its towers
    from the headers."""
    p = Path(target)
    if not p.is_file():
        try:
            resolved = checkpoint.resolve(target, allow_download=False)
        except CheckpointError:
            if not looks_like_repo_id(target):
                raise
            resolved = None  # not here: headers from the hub (below)
        if resolved and config_only(resolved):
            p = resolved / "config.json"
    if p.is_file():
        config = checkpoint.read_config(p.parent) if p.name == "config.json" \
            else load_json(p)
        errors = geometry.config_errors(config)
        if errors:
            raise CheckpointError(f"{p}: {errors[0]}")
        geo = geometry.Geometry.from_text_config(geometry.text_config_of(config))
        tensors = {n: (2 * checkpoint.numel(s), checkpoint.numel(s))
                   for n, s in geo.expected("").items()}
        return (geo, plan.Weights(tensors), "bf16 assumed",
                "config (language model only)", config)
    ckpt, report = open_headers(target, remote_ok=True)
    if report.config_errors:
        raise CheckpointError(f"{ckpt.path}: {report.config_errors[0]}")
    if report.export_kind == "qat-w4a16-ct" and not int4_export_ok:
        raise CheckpointError(
            f"{target}: plan takes a bf16 export (regular or QAT bf16); pass "
            "--weights int4 for the 4-bit figure")
    skipped = set(report.skipped)
    tensors, other, other_numel, vision, audio, dtypes = {}, 0, 0, 0, 0, set()
    if report.export_kind == "qat-w4a16-ct":
        tensors = {n: (2 * checkpoint.numel(s), checkpoint.numel(s))
                   for n, s in report.geometry.expected("").items()}
    for name, info in ckpt.tensors.items():
        if name in skipped:
            continue
        dtypes.add(info.dtype.lower())
        if geometry.is_language_model_tensor(name, report.prefix):
            if report.export_kind != "qat-w4a16-ct":
                tensors[name.removeprefix(report.prefix)] = (info.nbytes,
                                                             info.numel)
        else:
            other += info.nbytes
            other_numel += info.numel
            vision += info.nbytes if plan.is_vision_tensor(name) else 0
            audio += info.nbytes if plan.is_audio_tensor(name) else 0
    return (report.geometry, plan.Weights(tensors, other, vision,
                                          other_numel, audio_bytes=audio),
            ", ".join(sorted(dtypes)), "checkpoint headers", ckpt.config)


def load_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from None


SERVED_DTYPE_BYTES = {"auto": None, "bfloat16": 2, "float32": 4}


def assistant_bytes(target: str, config: dict, name: str,
                     dtype: str) -> tuple[int, int, str]:
    """(bytes on each chip, tensors, dtypes) of the Gemma 4 assistant
    `name` (a directory, a repo id in the HF cache, else its headers from
    the hub), after checking that it fits the target's config: the
    CheckpointError of the loader otherwise. Its floating-point tensors in
    the served `dtype` (auto: as stored)."""
    try:
        path = checkpoint.resolve(name, allow_download=False)
        ckpt = checkpoint.open_checkpoint(path)
    except CheckpointError:
        if not looks_like_repo_id(name):
            raise
        ckpt = checkpoint.open_remote(name)
    report = assistant.check(ckpt, config, target)
    report.raise_if_invalid()
    served = SERVED_DTYPE_BYTES[dtype]
    total, dtypes = 0, set()
    for tensor in ckpt.tensors.values():
        dtypes.add(tensor.dtype.lower())
        floating = tensor.dtype in ("BF16", "F16", "F32")
        total += tensor.numel * served if served and floating \
            else tensor.nbytes
    return total, len(ckpt.tensors), dtype if served else ", ".join(
        sorted(dtypes))
