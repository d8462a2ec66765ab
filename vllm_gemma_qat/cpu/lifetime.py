"""A process started for a server or a training never outlives what
started it."""
from __future__ import annotations

import ctypes
import os
import signal

# Resolved here, not in the forked child (which must not load anything).
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """SIGTERM to this process when the thread that started it ends, however
    its process dies (SIGKILL included); at once if `parent` (the pid that
    started it) is already gone. Run in each server's process before exec,
    so a server never outlives what started it (the API server stops its
    engine on SIGTERM); conftest.py runs it in pytest-xdist workers."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
