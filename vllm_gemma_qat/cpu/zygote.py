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

A zygote serves one environment: one whose values differ (a kernel choice,
a bug switch, image limits) gets its own zygote. XLA_FLAGS is left out of
that key: JAX reads it when its backend starts, in the server.
The output of the zygote's imports is written at the top of every server's
log, where a fresh process would have written it.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Read when a backend starts or a request arrives, not on import.
_NOT_KEYED = ("XLA_FLAGS", "PYTEST_CURRENT_TEST")
_KEYED_PREFIXES = ("VLLM", "JAX", "TPU", "XLA", "HF_", "TRANSFORMERS",
                   "TOKENIZERS", "MIN_TOKEN_BUCKET", "SKIP_JAX", "OMP_",
                   "PYTHON", "LIBTPU", "NEW_MODEL_DESIGN", "MODEL_IMPL")
_ZYGOTES: dict[tuple, "Zygote"] = {}
_MOST = 2  # zygotes kept per process (each holds ~1.5 GB of imports)


def key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_KEYED_PREFIXES)
                        and k not in _NOT_KEYED))


def start(command: list[str], env: dict[str, str],
          log: Path) -> "ForkedServer":
    """`command` (`vllm serve ...`) forked from the zygote for `env`."""
    k = key(env)
    zygote = _ZYGOTES.pop(k, None)
    if zygote is None or zygote.process.poll() is not None:
        idle = [other for other, z in _ZYGOTES.items() if not z.serving()]
        while idle and len(_ZYGOTES) >= _MOST:  # never one with a server
            _ZYGOTES.pop(idle.pop(0)).stop()
        zygote = Zygote(env)
    _ZYGOTES[k] = zygote  # most recently used last
    return zygote.fork(command, env, log)


@atexit.register
def stop_all() -> None:
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].stop()


class Zygote:
    def __init__(self, env: dict[str, str]):
        from vllm_gemma_qat.cpu.server import die_with_parent
        self.preamble = Path(tempfile.mkstemp(prefix="vllm-zygote-",
                                              suffix=".log")[1])
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.preamble)],
            env=dict(env, VLLM_WORKER_MULTIPROC_METHOD="fork"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()))
        self.servers: list[ForkedServer] = []
        if self._read() != {"ready": True}:
            raise RuntimeError(f"the server zygote did not start; see "
                               f"{self.preamble}")

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the server zygote exited "
                               f"({self.process.wait()}); see {self.preamble}")
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def fork(self, command, env, log) -> "ForkedServer":
        reply = self.ask(op="fork", argv=command, log=str(log),
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
        self.preamble.unlink(missing_ok=True)


class ForkedServer:
    """What CpuServer uses of a Popen, for a child of the zygote."""

    def __init__(self, pid: int, zygote: Zygote):
        self.pid, self.zygote, self.returncode = pid, zygote, None

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.zygote.process.poll() is not None:
                self.returncode = -signal.SIGKILL  # reaped with the zygote
            else:
                self.returncode = self.zygote.ask(
                    op="poll", pid=self.pid)["returncode"]
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


def _become_server(request: dict, preamble: Path, own_fds) -> None:
    """In the forked child: `vllm serve ...` as if just started."""
    import runpy

    from vllm_gemma_qat.cpu.server import die_with_parent
    os.setsid()
    # As a fresh interpreter has them.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_parent(os.getppid())
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(log, preamble.read_bytes())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (log, null, *own_fds):  # the zygote's pipes among them
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (
            0 if stop.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(preamble: Path) -> None:
    replies = os.fdopen(os.dup(1), "w")
    requests = os.fdopen(os.dup(0), "r")
    out = os.open(preamble, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    _preload()
    sys.stdout.flush()
    sys.stderr.flush()
    exited: dict[int, int] = {}

    def reply(**what):
        replies.write(json.dumps(what) + "\n")
        replies.flush()

    reply(ready=True)
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
            pid = os.fork()
            if pid == 0:
                _become_server(request, preamble, (
                    requests.fileno(), replies.fileno(), out))
            reply(pid=pid)
        elif request["op"] == "poll":
            reply(returncode=exited.get(request["pid"]))


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
