"""Tiny models the tests train, trained once per machine (and reference
computations too slow to repeat, computed once).

An entry is a directory under `root()` (outside any clone, beside the
venv: `~/.cache/vllm-gemma-qat/models`, or `VLLM_GEMMA_QAT_MODEL_CACHE`),
named by a hash of what made it: the trainer's source files, its inputs,
the pinned kernels and the torch / transformers versions. A changed trainer
or input is another name, so it trains anew. Its `MANIFEST.json`, written
last, holds that key and the SHA-256 of every file the training wrote; an
entry is served only when every hash still matches, else it is removed and
trained again (a run killed mid-write, a corrupt file). Workers that need
the same entry at once wait on a lock: one trains, the others read it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from vllm_gemma_qat.cpu.server import record_timing

ROOT_ENV = "VLLM_GEMMA_QAT_MODEL_CACHE"
MANIFEST = "MANIFEST.json"


def root() -> Path:
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "vllm-gemma-qat" / "models"


def source_digest(*files: str | Path) -> str:
    """SHA-256 of the given source files' bytes (the training code)."""
    h = hashlib.sha256()
    for file in files:
        h.update(Path(file).name.encode() + b"\0" + Path(file).read_bytes())
    return h.hexdigest()


def versions() -> dict:
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _file_hashes(directory: Path) -> dict[str, str]:
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            out[str(path.relative_to(directory))] = hashlib.sha256(
                path.read_bytes()).hexdigest()
    return out


def is_valid(path: Path, key: dict) -> bool:
    """`path` holds a complete entry made for `key`, every file unchanged."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("key") == key and \
        bool(manifest.get("files")) and manifest["files"] == _file_hashes(path)


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def entry(name: str, key: dict, build: Callable[[Path], None],
          log: Callable[[str], None] | None = None,
          kind: str = "training") -> Path:
    """The cache directory for (`name`, `key`), made by `build(directory)`
    when it is missing, stale or corrupt. `key` must be JSON-serializable
    and say everything the result depends on. `kind`: what the run's time
    summary counts a build as (a training, a reference computation)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()
                            ).hexdigest()[:16]
    path = root() / f"{name}-{digest}"
    with _locked(path):
        if is_valid(path, key):
            return path
        if path.exists() and log:
            log(f"model cache: {path} is incomplete or corrupt: rebuilding")
        shutil.rmtree(path, ignore_errors=True)
        # Left by a build that was killed (only the lock holder builds).
        for stale in path.parent.glob(path.name + ".building-*"):
            shutil.rmtree(stale, ignore_errors=True)
        scratch = path.with_name(path.name + f".building-{os.getpid()}")
        scratch.mkdir(parents=True)
        try:
            started = time.monotonic()
            build(scratch)
            record_timing(kind, time.monotonic() - started, name=name)
            files = _file_hashes(scratch)
            if not files:
                raise RuntimeError(f"model cache: building {name} wrote "
                                   f"nothing in {scratch}")
            (scratch / MANIFEST).write_text(json.dumps(
                {"key": key, "files": files}, indent=1, sort_keys=True))
            scratch.rename(path)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return path


def tensor_digest(model) -> str:
    """SHA-256 of a torch module's parameters and buffers (names, dtypes,
    shapes, bytes): what a model trained from it depends on."""
    import torch
    h = hashlib.sha256()
    for name, tensor in sorted({**dict(model.named_parameters()),
                                **dict(model.named_buffers())}.items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _config_key(config) -> str:
    """The config as JSON, less where it was loaded from (`_name_or_path`,
    in it and its sub-configs): the same model read from a moved cache is
    the same key."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()
                    if k != "_name_or_path"}
        return value
    return json.dumps(strip(config.to_dict()), sort_keys=True, default=str)


def reference(name: str, model, inputs: dict, source: str | Path,
              compute: Callable[[Path], None]) -> Path:
    """The entry of a reference computation on a transformers `model`
    (`compute(directory)` writes its result), keyed by the model's tensors
    and config, `inputs` (JSON), the `source` file that computes it and the
    torch / transformers versions."""
    key = {"model": tensor_digest(model), "config": _config_key(model.config),
           **inputs, "code": source_digest(source), "versions": versions()}
    return entry(name, key, compute, kind="reference")
