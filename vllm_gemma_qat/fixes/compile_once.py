"""Weight loading compiles each XLA program once, under --load-format
gemma_qat only. Upstream patch: patches/0004-*.

tpu-inference 0.32's `JaxAutoWeightsLoader` calls `jax.clear_caches()` after
every module's `process_weights_after_loading` (`_load_module`) and after
the fused modules' (`load_weights`). That empties JAX's in-memory caches, so
each module's small processing ops (device puts, transposes, the wNa16
unpack) are traced and compiled again for every module: the tiny int4 model
compiles 1,047 programs, 168 of them distinct (tests/test_load_compiles.py).
The caches hold compiled programs and traces, not weights (the live device
arrays are the same with and without the clears); tpu-inference's runner
clears them again once the model is loaded, to free the programs'
reservations on TPU HBM.

While `GemmaQatModelLoader` feeds the weights (`one_cache_clear`), the
clears tpu-inference asks for are deferred and done once at the end of the
load: each distinct program compiles once. Other load formats, and
`jax.clear_caches()` outside a gemma_qat load, are untouched.
`VLLM_GEMMA_QAT_CLEAR_CACHES_PER_MODULE=1` keeps tpu-inference's clear after
every module (for before / after measurements).

`CompileLog` counts the programs compiled while it is open, from JAX's
compile log; the loader logs the count for its load.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from dataclasses import dataclass, field

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT
from vllm_gemma_qat.substitute import Substitution

# Imported by tpu-inference's JAX model loading (it calls jax.clear_caches()).
WEIGHT_UTILS = "tpu_inference.models.jax.utils.weight_utils"
PER_MODULE_ENV = "VLLM_GEMMA_QAT_CLEAR_CACHES_PER_MODULE"
# JAX logs every program it compiles (an in-memory cache miss; a persistent
# cache hit included) here, at DEBUG unless jax_log_compiles is set.
COMPILE_LOGGER = "jax._src.interpreters.pxla"
COMPILE_MESSAGE = "Compiling %s with global shapes and types %s."


@dataclass
class _Load:
    deferred: int = 0  # the clears tpu-inference asked for during the load


_loading: contextvars.ContextVar[_Load | None] = contextvars.ContextVar(
    "gemma_qat_weight_load", default=None)


def install() -> None:
    """Patch when tpu-inference's weight loader is imported (by the worker),
    not now: `register` must not import JAX."""
    substitute.apply_on_import(
        WEIGHT_UTILS, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, weight loading)")


def substitutions() -> list[Substitution]:
    return [Substitution(
        "jax:clear_caches", _deferred_while_loading,
        "during a gemma_qat weight load, the clears tpu-inference's "
        "JaxAutoWeightsLoader does after every module become one at the end "
        "(each distinct processing program compiles once); elsewhere "
        "unchanged", wraps=True)]


def _deferred_while_loading(clear_caches):

    @functools.wraps(clear_caches)
    def wrapped():
        load = _loading.get()
        if load is None:
            return clear_caches()
        load.deferred += 1

    return wrapped


@contextlib.contextmanager
def one_cache_clear():
    """The body (a gemma_qat weight load) keeps JAX's in-memory caches; the
    clears asked for meanwhile are one at the end (if any were). Yields the
    number of clears deferred so far, as a callable."""
    if os.environ.get(PER_MODULE_ENV) == "1":
        yield lambda: 0
        return
    load = _Load()
    token = _loading.set(load)
    try:
        yield lambda: load.deferred
    finally:
        _loading.reset(token)
        if load.deferred:
            import jax
            jax.clear_caches()


# eq=False: nested logs (a test's around the loader's) are told apart by
# identity; equal contents made close() drop the outer one first.
@dataclass(eq=False)
class CompileLog:
    """The XLA programs JAX compiles while this is open (any thread), read
    from its compile log; what that log shows does not change. A program is
    (name, input shapes and types, input shardings): `distinct` can only
    undercount programs that differ in nothing logged."""
    programs: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.programs)

    @property
    def distinct(self) -> int:
        return len(set(self.programs))

    def __enter__(self) -> CompileLog:
        _CompileFilter.get().open(self)
        return self

    def __exit__(self, *exc) -> None:
        _CompileFilter.get().close(self)


class _CompileFilter(logging.Filter):
    """One filter on JAX's compile logger for all open CompileLogs: lowers
    the logger to DEBUG while any is open, hands them each compile record,
    and passes on only what the logger's own level let through before."""
    _instance: _CompileFilter | None = None

    @classmethod
    def get(cls) -> _CompileFilter:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        super().__init__()
        self.logs: list[CompileLog] = []
        self.level = self.effective = logging.NOTSET

    def open(self, log: CompileLog) -> None:
        if not self.logs:
            logger = logging.getLogger(COMPILE_LOGGER)
            self.level, self.effective = logger.level, logger.getEffectiveLevel()
            logger.addFilter(self)
            logger.setLevel(logging.DEBUG)
        self.logs.append(log)

    def close(self, log: CompileLog) -> None:
        self.logs.remove(log)
        if not self.logs:
            logger = logging.getLogger(COMPILE_LOGGER)
            logger.removeFilter(self)
            logger.setLevel(self.level)

    def filter(self, record: logging.LogRecord) -> bool:
        if (isinstance(record.msg, str)
                and record.msg.startswith(COMPILE_MESSAGE)
                and len(record.args) >= 3):
            program = tuple(str(a) for a in record.args[:3])
            for log in self.logs:
                log.programs.append(program)
        return record.levelno >= self.effective
