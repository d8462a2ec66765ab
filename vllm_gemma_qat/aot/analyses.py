"""What libtpu's compile of a program told `compile`, kept under the key
JAX would give the program's executable.

A deviceless executable cannot be loaded, so JAX's persistent compilation
cache cannot hold one (compile.py keeps them out of it). Where that cache
is configured (JAX_COMPILATION_CACHE_DIR: the user keeps compiles), what
`compile` reads from each executable (its memory and cost analyses, its
custom calls: `Program.analysis`) is kept beside it, in
`<cache dir>/vllm-gemma-qat-aot/<key>.json`. The key is JAX's own
(`compilation_cache.get_cache_key`): the program's module, the topology's
devices, the compile options, XLA flags and the jax / jaxlib / libtpu
versions, so a program compiled the same way again is answered from there,
and any change to it compiles it. A failed compile is never kept; an entry
that cannot be read is compiled again and rewritten.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

SUBDIRECTORY = "vllm-gemma-qat-aot"


class Kept(Exception):
    """Raised in place of a compile whose analysis is kept."""

    def __init__(self, analysis: dict):
        super().__init__("kept")
        self.analysis = analysis


class Analyses:
    """The kept analyses; `keyed` wraps JAX's `compile_or_get_cached`. In
    `compiling`, a compile takes JAX's key for its executable (`key`; None
    if JAX answered from its in-memory cache) and is answered by `Kept` if
    its analysis is in `directory`."""

    def __init__(self, directory: Path | None, fields: tuple[str, ...]):
        self.directory = directory
        self.fields = fields
        self.armed = False
        self.key: str | None = None

    @classmethod
    def configured(cls, fields: tuple[str, ...]) -> "Analyses":
        import jax
        cache = jax.config.jax_compilation_cache_dir
        return cls(Path(cache) / SUBDIRECTORY if cache else None, fields)

    @contextlib.contextmanager
    def compiling(self):
        self.armed, self.key = True, None
        try:
            yield
        finally:
            self.armed = False

    def keyed(self, compile_or_get_cached):
        def compile_or_kept(backend, computation, devices, compile_options,
                            *args, **kwargs):
            if self.armed and self.directory is not None:
                from jax._src import compilation_cache
                self.key = compilation_cache.get_cache_key(
                    computation, devices, compile_options, backend)
                analysis = self.read(self.key)
                if analysis is not None:
                    raise Kept(analysis)
            return compile_or_get_cached(backend, computation, devices,
                                         compile_options, *args, **kwargs)
        return compile_or_kept

    def read(self, key: str) -> dict | None:
        try:
            analysis = json.loads((self.directory / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(analysis, dict) or set(analysis) != set(
                self.fields):
            return None
        return analysis

    def write(self, analysis: dict) -> None:
        """`analysis` under the key of the compile `compiling` last saw."""
        if self.directory is None or self.key is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(analysis, f)
        os.replace(tmp, self.directory / f"{self.key}.json")
