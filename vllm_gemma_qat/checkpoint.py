"""Header-only access to a safetensors checkpoint: config.json, shard list,
tensor names/dtypes/shapes, and file-integrity checks. Reads no tensor data."""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

# Sanity cap on a safetensors header; real Gemma 4 headers are ~100 KiB.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2,
    "F16": 2, "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1,
    "U8": 1, "BOOL": 1,
}


def numel(shape) -> int:
    return math.prod(shape)


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the culprit."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int = 0  # of the data in the file

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return DTYPE_BYTES[self.dtype] * self.numel


@dataclass
class Checkpoint:
    path: Path
    config: dict
    files: list[Path]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def resolve(model: str, revision: str | None = None,
            cache_dir: str | None = None, allow_download: bool = False) -> Path:
    """A local directory, or a hub repo id looked up in the HF cache (or
    `cache_dir`, vLLM's --download-dir). Downloads only if allowed."""
    if os.path.isdir(model):
        return Path(model)
    if os.path.exists(model):
        raise CheckpointError(f"{model}: not a directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    try:
        return Path(snapshot_download(
            model, revision=revision, cache_dir=cache_dir,
            local_files_only=not allow_download,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja"]))
    except HFValidationError:
        raise CheckpointError(f"{model}: no such directory") from None
    except Exception as e:  # LocalEntryNotFoundError, network errors, ...
        where = "in the local HF cache" if not allow_download else "on the hub"
        raise CheckpointError(
            f"{model}: not a local directory and not found {where} "
            f"({type(e).__name__})") from None


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: missing config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e!r})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(
                    f"{f}: shard named in {index.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one shard's header and check the file holds all its data."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{file}: corrupt safetensors header (claims {n} header bytes, "
                f"file has {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a map)")
    header.pop("__metadata__", None)
    out: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            info = TensorInfo(name, entry["dtype"], tuple(entry["shape"]),
                              file.name, 8 + n + begin)
            ok = info.dtype in DTYPE_BYTES and end - begin == info.nbytes
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(
                f"{file}: corrupt safetensors header entry for tensor {name}")
        out[name] = info
        data_end = max(data_end, end)
    if 8 + n + data_end > size:
        raise CheckpointError(
            f"{file}: truncated: header needs {8 + n + data_end} bytes, "
            f"file has {size}")
    return out


def open_checkpoint(path: Path) -> Checkpoint:
    config = read_config(path)
    files = shard_files(path)
    ckpt = Checkpoint(path, config, files)
    for f in files:
        for name, info in read_header(f).items():
            if name in ckpt.tensors:
                raise CheckpointError(
                    f"{f}: tensor {name} also in {ckpt.tensors[name].file}")
            ckpt.tensors[name] = info
    return ckpt


def open_remote(repo_id: str, revision: str | None = None) -> Checkpoint:
    """config.json and every shard's safetensors header of a hub repo, read
    with range requests (huggingface_hub): no weights are downloaded. What
    only the files can tell (truncation) is not checked."""
    from huggingface_hub import HfApi, hf_hub_download
    try:
        config_file = hf_hub_download(repo_id, "config.json", revision=revision)
        meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)
    except Exception as e:  # offline, unknown repo, gated, not safetensors
        raise CheckpointError(
            f"{repo_id}: not a local directory, and its config.json / "
            f"safetensors headers could not be read from the hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    ckpt = Checkpoint(Path(repo_id), read_config(Path(config_file).parent),
                      [Path(f) for f in sorted(meta.files_metadata)])
    for file, header in sorted(meta.files_metadata.items()):
        for name, t in header.tensors.items():
            begin, end = t.data_offsets
            info = TensorInfo(name, t.dtype, tuple(t.shape), file, begin)
            if info.dtype not in DTYPE_BYTES or end - begin != info.nbytes:
                raise CheckpointError(f"{repo_id}/{file}: corrupt safetensors "
                                      f"header entry for tensor {name}")
            if name in ckpt.tensors:
                raise CheckpointError(f"{repo_id}/{file}: tensor {name} also "
                                      f"in {ckpt.tensors[name].file}")
            ckpt.tensors[name] = info
    return ckpt


def read_bf16(ckpt: Checkpoint, name: str):
    """One BF16 tensor as a numpy (ml_dtypes) array, read straight from its
    shard: no torch, no copy of the rest."""
    import ml_dtypes
    import numpy as np
    info = ckpt.tensors[name]
    if info.dtype != "BF16":
        raise CheckpointError(f"{name}: {info.dtype}, expected BF16")
    return np.fromfile(ckpt.path / info.file, dtype=ml_dtypes.bfloat16,
                       count=info.numel, offset=info.offset).reshape(info.shape)
