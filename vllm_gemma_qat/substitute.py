"""Runtime substitutions into vLLM / tpu-inference, declared as tables.

Each `Substitution` names its target as "module:attribute.path", the
replacement and why it is needed. `apply` installs them in table order (the
order can matter: a module may read a patched function when imported); a
target that is not there raises `MissingTarget` naming it (a rename in a new
release must not silently add an unused attribute). It logs the list;
applying a table twice changes nothing more.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

from vllm.logger import init_logger

# Under the "vllm" logger so the lines show in vLLM's own log output.
logger = init_logger(f"vllm.{__name__}")

_MARK = "__vllm_gemma_qat_substitute__"


class MissingTarget(RuntimeError):
    """A declared substitution target does not exist in what is installed."""


@dataclass(frozen=True)
class Substitution:
    target: str  # "package.module:Name" or "package.module:Class.method"
    replacement: Any
    why: str
    # When True, `replacement` is called with the original and returns the
    # object to install (a wrapper); otherwise it is installed as it is.
    wraps: bool = False

    def resolve(self) -> tuple[Any, str]:
        """(owner, attribute name); raises MissingTarget."""
        module_name, _, path = self.target.partition(":")
        try:
            owner = importlib.import_module(module_name)
        except ImportError as e:
            raise MissingTarget(f"{self.target}: cannot import {module_name} "
                                f"({e})") from None
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
            if owner is None:
                break
        if owner is None or not hasattr(owner, name):
            raise MissingTarget(f"{self.target} does not exist in the "
                                f"installed {module_name.split('.')[0]}")
        return owner, name


def apply(table: list[Substitution], label: str,
          level: int = logging.INFO) -> list[tuple]:
    """Install `table` in order; a missing target stops it with
    MissingTarget, and what it installed before is put back. Returns
    (owner, name, previous) for what it changed."""
    changed = []
    for s in table:
        try:
            owner, name = s.resolve()
        except MissingTarget:
            restore(changed)  # nothing of a table that stopped stays
            raise
        current = getattr(owner, name)
        # Marked by target and reason: applying a table again changes
        # nothing, but another table's substitution for the same target
        # (AOT mode's model build over a fix's wrapper) still goes in.
        mark = (s.target, s.why)
        if getattr(current, _MARK, None) == mark:
            continue  # already installed
        new = s.replacement(current) if s.wraps else s.replacement
        try:
            setattr(new, _MARK, mark)
        except (AttributeError, TypeError):  # builtins such as dict
            new = _marked(new, mark)
        setattr(owner, name, new)
        changed.append((owner, name, current))
    if changed:
        logger.log(level, "%s substitutes:\n%s", label, describe(table))
    return changed


@contextlib.contextmanager
def applied(table: list[Substitution], label: str):
    """`apply` for the duration of a block, then the originals back."""
    changed = apply(table, label)
    try:
        yield
    finally:
        restore(changed)


def restore(changed: list[tuple]) -> None:
    """Put back what `apply` changed (its return value), last first."""
    for owner, name, previous in reversed(changed):
        setattr(owner, name, previous)


def installed(target: str) -> bool:
    """Whether a substitution for `target` is in place now."""
    owner, name = Substitution(target, None, "").resolve()
    mark = getattr(getattr(owner, name), _MARK, None) or (None, )
    return mark[0] == target


def after_import(module_name: str, callback: Callable) -> None:
    """Call `callback(module)` now if `module_name` is imported, else right
    after its import: patching a tpu-inference module must not import it
    (importing the model modules eagerly would cost every vLLM process
    seconds). Idempotent per (module, callback)."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport) and finder.name == module_name:
            if callback not in finder.callbacks:
                finder.callbacks.append(callback)
            return
    sys.meta_path.insert(0, _AfterImport(module_name, [callback]))


def apply_on_import(module_name: str,
                    table: Callable[[], list[Substitution]],
                    label: str, optional: bool = False) -> None:
    """`apply(table(), label)` when `module_name` is imported (now, if it
    is): how a fix installs its table without importing tpu-inference.
    Idempotent (the callback compares equal for the same table and label).
    `optional`: a table whose target is missing is logged and left out
    whole (for a feature the model works without, on another release),
    instead of stopping the import with MissingTarget."""
    after_import(module_name, _ApplyTable(table, label, optional))


@dataclass(frozen=True)
class _ApplyTable:
    table: Callable[[], list[Substitution]]
    label: str
    optional: bool = False

    def __call__(self, _module=None) -> None:
        table = self.table()
        if self.optional:
            try:
                for s in table:
                    s.resolve()
            except MissingTarget as e:
                logger.warning("%s: not applied, the installed release "
                               "differs (%s)", self.label, e)
                return
        apply(table, self.label)


class _AfterImport:
    """meta_path finder that lets the normal import run, then calls back."""

    def __init__(self, name: str, callbacks: list[Callable]):
        self.name, self.callbacks = name, callbacks

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_call_back(module):
            exec_module(module)
            for callback in self.callbacks:
                callback(module)

        spec.loader.exec_module = exec_then_call_back
        return spec


def describe(table: list[Substitution]) -> str:
    return "\n".join(f"  {s.target}: {s.why}" for s in table)


def _marked(function: Callable, mark: tuple) -> Callable:

    def call(*args, **kwargs):
        return function(*args, **kwargs)

    setattr(call, _MARK, mark)
    return call
