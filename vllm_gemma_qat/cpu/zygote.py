"""`vllm serve` started from a process that has already imported it (the
test suite's servers: tests/conftest.py turns it on).

A fresh `vllm serve` spends most of its start-up importing: ~13 s in the
API server, and ~20 s again in the engine core, which `vllm serve` spawns
(a new interpreter). A zygote imports what both need once, in the order a
real start does (vLLM's CLI, then the plugins, which must substitute before
tpu-inference's sampling module builds its jit, then the API server and the
engine core's modules), and forks one process per server. Each child
becomes `vllm serve ARGS` as if just started (`bin/vllm` run as __main__,
its own session, its log, its environment) with
VLLM_WORKER_MULTIPROC_METHOD=fork, vLLM's own setting, so that its engine
core inherits the imports too. What a test sees through HTTP and the log is
the same; what it no longer sees is the spawned engine core's own plugin
load, so tests/test_serve_e2e.py keeps the real spawn.

A zygote serves every environment that agrees with its own where its
imports could have read it: the variables its imports read through
os.environ (watched while they run: a kernel choice, a bug switch), and
every variable of the prefixes that native libraries read as they load
(`_ALWAYS_KEYED`). A variable read only later, in the server (image limits,
tpu-inference's token bucket), is the server's own: servers that differ
only there share a zygote. XLA_FLAGS is never keyed: JAX reads it when its
backend starts, in the server. What
vLLM's and tpu-inference's imports did to the zygote's environment
(tpu-inference prepends `--xla_cpu_max_isa=AVX2` to XLA_FLAGS, among
others) is done again to each server's (`_as_imported`).
The output of the zygote's imports is written at the top of every server's
log, where a fresh process would have written it.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Read when JAX's backend starts (in the server), not on import.
_NOT_KEYED = ("XLA_FLAGS", )
# Native libraries read these as they load, past os.environ: always keyed.
_ALWAYS_KEYED = ("JAX", "TPU", "XLA", "HOME", "XDG_", "TMPDIR", "OMP_", "MKL",
                 "ONEDNN", "TORCH", "PYTORCH", "TRITON", "TILELANG",
                 "LD_LIBRARY_PATH", "PYTHON", "LIBTPU", "TF_")
# Python reads these: keyed where the zygote's imports read them.
_KEYED_IF_READ = ("VLLM", "HF_", "TRANSFORMERS", "TOKENIZERS",
                  "MIN_TOKEN_BUCKET", "SKIP_JAX", "NEW_MODEL_DESIGN",
                  "MODEL_IMPL")
_ALL = "*"  # the imports iterated over the environment: every name read
_ZYGOTES: list["Zygote"] = []  # most recently used last
_OWNER = os.getpid()  # not a child forked from this process
_MOST = 2  # zygotes kept per process (each holds ~1.5 GB of imports)


def keyed(name: str, read: frozenset[str] | str = _ALL) -> bool:
    if name in _NOT_KEYED:
        return False
    if name.startswith(_ALWAYS_KEYED):
        return True
    return name.startswith(_KEYED_IF_READ) and (read == _ALL or name in read)


def key(env: dict[str, str], read: frozenset[str] | str = _ALL) -> tuple:
    """What a zygote whose imports read `read` (names, or _ALL) must agree
    on with a server's environment `env`."""
    names = {n for n in env if keyed(n, read)}
    if read != _ALL:
        names |= {n for n in read if keyed(n, read)}  # unset there: here too
    return tuple(sorted((n, env.get(n)) for n in names))


def start(command: list[str], env: dict[str, str],
          log: Path) -> "ForkedServer":
    """`command` (`vllm serve ...`) forked from the zygote for `env`. The
    server's `zygote_seconds`: how long a new zygote took to import (0
    where one was ready)."""
    for dead in [z for z in _ZYGOTES if z.process.poll() is not None]:
        _ZYGOTES.remove(dead)
        dead.stop()
    fits = [z for z in _ZYGOTES if z.serves(env)]
    started = time.monotonic()
    if fits:
        zygote, imported = fits[-1], 0.0
        _ZYGOTES.remove(zygote)
    else:
        idle = [z for z in _ZYGOTES if not z.serving()]
        while idle and len(_ZYGOTES) >= _MOST:  # never one with a server
            oldest = idle.pop(0)
            _ZYGOTES.remove(oldest)
            oldest.stop()
        zygote = Zygote(env)
        imported = time.monotonic() - started
    _ZYGOTES.append(zygote)
    server = zygote.fork(command, env, log)
    server.zygote_seconds = imported
    return server


@atexit.register
def stop_all() -> None:
    while _ZYGOTES and os.getpid() == _OWNER:
        _ZYGOTES.pop().stop()


class Zygote:
    def __init__(self, env: dict[str, str]):
        from vllm_gemma_qat.cpu.lifetime import die_with_parent
        fd, preamble = tempfile.mkstemp(prefix="vllm-zygote-", suffix=".log")
        os.close(fd)
        self.preamble = Path(preamble)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.preamble)],
            env=dict(env, VLLM_WORKER_MULTIPROC_METHOD="fork"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()))
        self.servers: list[ForkedServer] = []
        self.busy = False
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"the server zygote did not start; see "
                               f"{self.preamble}")
        # The names its imports read (or _ALL) and what they set, and the
        # key that follows: environments compared as a server's imports
        # leave them (this process's own may already hold what they set:
        # a test here imported tpu-inference).
        self.read = ready["read"] if ready["read"] == _ALL else \
            frozenset(ready["read"])
        self.imported = ready["imported"]
        self.key = self._key(env)

    def _key(self, env: dict[str, str]) -> tuple:
        return key(_as_imported(env, self.imported), self.read)

    def serves(self, env: dict[str, str]) -> bool:
        # What the imports set is as the zygote had it before them, or as
        # they left it (not a value of the server's own they would keep).
        for name, (before, after) in self.imported.items():
            if keyed(name, self.read) and env.get(name) not in (before, after):
                return False
        return self._key(env) == self.key

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the server zygote exited "
                               f"({self.process.wait()}); see {self.preamble}")
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.busy = True  # a signal handler's poll must not interleave
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            return self._read()
        finally:
            self.busy = False

    def fork(self, command, env, log) -> "ForkedServer":
        reply = self.ask(op="fork", argv=command, log=str(log),
                         cwd=os.getcwd(),
                         env=dict(env, VLLM_WORKER_MULTIPROC_METHOD="fork"))
        server = ForkedServer(reply["pid"], self)
        self.servers.append(server)
        return server

    def serving(self) -> bool:
        self.servers = [s for s in self.servers if s.poll() is None]
        return bool(self.servers)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:  # a write the dead zygote never read
                pass
        self.preamble.unlink(missing_ok=True)


class ForkedServer:
    """What CpuServer uses of a Popen, for a child of the zygote."""

    def __init__(self, pid: int, zygote: Zygote):
        self.pid, self.zygote, self.returncode = pid, zygote, None
        self.zygote_seconds = 0.0

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.zygote.process.poll() is None and not self.zygote.busy:
                try:
                    self.returncode = self.zygote.ask(
                        op="poll", pid=self.pid)["returncode"]
                    return self.returncode
                except (OSError, RuntimeError):  # the zygote just died
                    pass
            # Not the zygote's to say: whether the process still exists
            # (an orphan is reaped by init; its exit status is lost).
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)


# The zygote process.

def _preload() -> None:
    import vllm.entrypoints.cli.main  # noqa: F401  (what bin/vllm imports)
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # before tpu-inference's runner (see above)
    import tpu_inference.runner.tpu_runner  # noqa: F401
    import tpu_inference.worker.tpu_worker  # noqa: F401
    import vllm.entrypoints.openai.api_server  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401


# Modules that iterate over the environment as they import, read to be
# harmless: they keep only names of their own prefix, none keyed here
# (tqdm TQDM_*, networkx NETWORKX_*, fsspec FSSPEC_*, numba NUMBA_*), or
# copy it for a `file` subprocess (platform) or as a WSGI server's base
# environ (wsgiref, which vLLM does not serve with). Any other one that
# iterates makes every name count as read.
_ITERATE_HARMLESSLY = ("tqdm.utils", "networkx.utils.backends",
                       "fsspec.config", "numba.core.config", "platform",
                       "wsgiref.handlers")


class _WatchedEnviron(os._Environ):
    """os.environ, noting each name read (a lookup, `get`, `in`,
    `setdefault`) and who iterates over it."""
    read: set[str] | str = set()

    def __getitem__(self, name):
        # (`items()` looks each name up: not a read where the iteration is
        # harmless)
        if _WatchedEnviron.read != _ALL and not _harmless(_caller()):
            _WatchedEnviron.read.add(name)
        return super().__getitem__(name)

    def __iter__(self):
        if not _harmless(_caller()):
            _WatchedEnviron.read = _ALL
        return super().__iter__()


def _caller() -> str | None:
    """The module that asked os.environ (past os and collections.abc)."""
    frame = sys._getframe(2)
    while frame and frame.f_globals.get("__name__") in (
            "os", "collections.abc", "_collections_abc"):
        frame = frame.f_back
    return frame.f_globals.get("__name__") if frame else None


def _harmless(module: str | None) -> bool:
    return module in _ITERATE_HARMLESSLY


@contextlib.contextmanager
def _watching_reads():
    """In the body, os.environ notes what is read: `_WatchedEnviron.read`,
    the names, or _ALL."""
    environ_class = os.environ.__class__
    _WatchedEnviron.read = set()
    os.environ.__class__ = _WatchedEnviron
    try:
        yield
    finally:
        os.environ.__class__ = environ_class


def _become_server(request: dict, preamble: Path, zygote: int,
                   imported: dict, own_fds) -> None:
    """In the forked child: `vllm serve ...` as if just started."""
    code = 1
    try:
        code = _run_server(request, preamble, zygote, imported, own_fds)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_server(request: dict, preamble: Path, zygote: int, imported: dict,
                own_fds) -> int:
    import runpy

    from vllm_gemma_qat.cpu.lifetime import die_with_parent
    os.setsid()
    # As a fresh interpreter has them.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_parent(zygote)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(log, preamble.read_bytes())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (log, null, *own_fds):  # the zygote's pipes among them
        os.close(fd)
    os.environ.clear()
    os.environ.update(_as_imported(request["env"], imported))
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    return 0


def _imports_changed(before: dict, after: dict) -> dict:
    """What importing vLLM and tpu-inference did to the environment:
    name -> (value before, value after)."""
    return {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
            if before.get(k) != after.get(k)}


def _as_imported(env: dict, imported: dict) -> dict:
    """`env` as a fresh server's imports leave it: a value they prepend to
    (tpu-inference's XLA_FLAGS) prepended to this server's own, any other
    set as they set it (the zygote's environment, so left, equals the
    server's in every keyed name: `Zygote.serves`). A prepended flag the
    server's own value holds already (its parent had imported tpu-inference
    too) is not doubled: XLA reads a flag given twice as once, but JAX keys
    its compilation cache by the flags as written, so a server's programs
    would otherwise be cached apart by whether the process that started it
    had imported tpu-inference yet."""
    env = dict(env)
    for name, (before, after) in imported.items():
        if after is None:
            env.pop(name, None)
        elif before and after.endswith(before) or not before and \
                name in _NOT_KEYED:
            own = env.get(name, "")
            added = [flag for flag in after[:len(after) - len(before or "")]
                     .split() if flag not in own.split()]
            env[name] = "".join(flag + " " for flag in added) + own
        else:
            env[name] = after
    return env


def _serve(preamble: Path) -> None:
    replies = os.fdopen(os.dup(1), "w")
    requests = os.fdopen(os.dup(0), "r")
    out = os.open(preamble, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    before = dict(os.environ)
    with _watching_reads():
        _preload()
    read = _WatchedEnviron.read
    imported = _imports_changed(before, dict(os.environ))
    # The imports' ~1M objects live as long as any server: out of every
    # garbage collection of the servers forked from here (vLLM's
    # freeze_gc_heap at start-up, each collection while they load), as a
    # fresh process's are only after its own freeze_gc_heap.
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    exited: dict[int, int] = {}

    def reply(**what):
        replies.write(json.dumps(what) + "\n")
        replies.flush()

    reply(ready=True, imported=imported, read=read if read == _ALL else
          sorted(name for name in read if isinstance(name, str)))
    for line in requests:
        request = json.loads(line)
        while True:  # reap what has exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            exited[pid] = os.waitstatus_to_exitcode(status)
        if request["op"] == "fork":
            sys.stdout.flush()
            sys.stderr.flush()
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                _become_server(request, preamble, zygote, imported, (
                    requests.fileno(), replies.fileno(), out))
            reply(pid=pid)
        elif request["op"] == "poll":
            reply(returncode=exited.get(request["pid"]))


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
