"""A stopped test run takes its servers with it. `vllm serve` runs in a
session of its own (cpu/server.py), which no terminal or process-group
signal reaches; SIGTERM to pytest, as `timeout` sends it to the controller
of a pytest-xdist run, must still leave no API server or engine core
behind (seen before: a suite killed at its time limit left two TP servers
running, holding GBs)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
HOLDS_A_SERVER = '''
import os
import time
from pathlib import Path

from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import tiny


def test_holds_a_server(tmp_path):
    tiny.save_servable(tmp_path / "model", multimodal=False)
    with CpuServer(tmp_path / "model", log=tmp_path / "server.log") as server:
        from vllm_gemma_qat.cpu import zygote
        zygotes = [z.process.pid for z in zygote._ZYGOTES]
        marker = Path(os.environ["HELD_SERVER_PID"])
        marker.with_suffix(".tmp").write_text(
            " ".join(map(str, [server.process.pid, *zygotes])))
        marker.with_suffix(".tmp").replace(marker)  # never seen half written
        time.sleep(900)
'''


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (a server's: its API server and
    engine cores)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2]
    except OSError:
        return False
    return state.split()[0] != "Z"


def wait_for(condition, seconds: float, step: float = 0.5):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


@pytest.mark.slow
def test_sigterm_to_pytest_leaves_no_server_process(tmp_path):
    (tmp_path / "test_holds.py").write_text(HOLDS_A_SERVER)
    marker = tmp_path / "server.pid"
    env = dict(os.environ, HELD_SERVER_PID=str(marker),
               PYTHONPATH=os.pathsep.join(
                   [str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    # A pytest-xdist run with this suite's conftest, in a session of its
    # own; SIGTERM goes to its controller only.
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(tmp_path / "test_holds.py"),
         "-q", "-p", "no:cacheprovider", "-p", "conftest", "-n", "1",
         f"--basetemp={tmp_path / 'run'}", f"--rootdir={tmp_path}"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    server, zygotes = None, []
    try:
        assert wait_for(lambda: marker.exists() or run.poll() is not None,
                        600), "the server did not start in 600 s"
        assert marker.exists(), run.communicate()[0][-3000:]
        server, *zygotes = map(int, marker.read_text().split())
        assert zygotes  # the server was forked from a zygote
        # Up and serving: the API server and at least one engine core.
        assert len(session_members(server)) >= 2, session_members(server)
        os.kill(run.pid, signal.SIGTERM)
        run.wait(timeout=120)
        assert wait_for(lambda: not session_members(server), 30), \
            f"left running: {session_members(server)}"
        # Nor the zygote it was forked from (cpu/zygote.py).
        assert wait_for(lambda: not any(map(alive, zygotes)), 30), zygotes
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        if server:
            for pid in session_members(server) + list(filter(alive, zygotes)):
                os.kill(pid, signal.SIGKILL)


def test_a_forked_server_gets_what_its_imports_add_to_its_environment():
    # As tpu-inference's env_override: XLA_FLAGS prepended to, others set.
    from vllm_gemma_qat.cpu.zygote import _as_imported, _imports_changed
    before = {"XLA_FLAGS": "--a", "VLLM_X": "0", "KEEP": "k"}
    after = {"XLA_FLAGS": "--avx2 --a", "VLLM_X": "1", "LIBTPU_INIT_ARGS": "-l",
             "KEEP": "k"}
    imported = _imports_changed(before, after)
    server = {"XLA_FLAGS": "--devices=4", "VLLM_X": "0", "OWN": "o"}
    assert _as_imported(server, imported) == {
        "XLA_FLAGS": "--avx2 --devices=4", "VLLM_X": "1",
        "LIBTPU_INIT_ARGS": "-l", "OWN": "o"}
    # A zygote started without XLA_FLAGS: the server's own kept after it.
    imported = _imports_changed({}, {"XLA_FLAGS": "--avx2 "})
    assert _as_imported({"XLA_FLAGS": "--d"}, imported) == {
        "XLA_FLAGS": "--avx2 --d"}
    # Started by a process that had imported tpu-inference itself: the flag
    # once, as from a process that had not (JAX's compilation cache keys
    # the flags as written).
    assert _as_imported({"XLA_FLAGS": "--avx2 --d"}, imported) == \
        _as_imported({"XLA_FLAGS": "--d"}, imported)


def test_a_zygote_is_keyed_by_what_its_imports_read():
    # What the imports read through os.environ is watched (a lookup, `in`,
    # get); a variable no import read is the server's own.
    from vllm_gemma_qat.cpu import zygote
    environ = {"VLLM_IMPORT_TIME": "a", "VLLM_RUN_TIME": "1",
               "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--x", "OTHER": "o"}
    with zygote._watching_reads():
        os.environ.get("VLLM_IMPORT_TIME")
        "HF_NOT_SET" in os.environ
    read = zygote._WatchedEnviron.read
    assert {"VLLM_IMPORT_TIME", "HF_NOT_SET"} <= read
    assert os.environ.__class__ is os._Environ  # restored
    k = zygote.key(environ, read)
    assert dict(k) == {"VLLM_IMPORT_TIME": "a", "HF_NOT_SET": None,
                       "JAX_PLATFORMS": "cpu"}  # native readers: always
    assert zygote.key(dict(environ, VLLM_RUN_TIME="2", XLA_FLAGS="--y"),
                      read) == k
    assert zygote.key(dict(environ, VLLM_IMPORT_TIME="b"), read) != k
    assert zygote.key(dict(environ, HF_NOT_SET="1"), read) != k
    # One read to keep only its own prefix iterates (and `items()` looks
    # every name up): nothing counts as read.
    with zygote._watching_reads():
        exec("{k: v for k, v in os.environ.items() if k.startswith('TQDM_')}",
             {"__name__": "tqdm.utils", "os": os})
    assert zygote._WatchedEnviron.read == set()
    # An import that iterates over the environment (here: this test, not
    # one read to keep only its own prefix) makes every name count.
    with zygote._watching_reads():
        dict(os.environ)
    assert zygote._WatchedEnviron.read == zygote._ALL
    assert zygote.key(dict(environ, VLLM_RUN_TIME="2"), zygote._ALL) != \
        zygote.key(environ, zygote._ALL)


def test_a_zygote_serves_an_environment_as_its_imports_leave_it():
    # A process that imported tpu-inference itself holds what the imports
    # set: served. A value of the server's own for such a name: not.
    from vllm_gemma_qat.cpu import zygote
    pre = {"JAX_PLATFORMS": "cpu", "VLLM_READ": "1"}
    imported = zygote._imports_changed(
        pre, dict(pre, LIBTPU_INIT_ARGS="--imports ", XLA_FLAGS="--avx2 "))
    z = object.__new__(zygote.Zygote)
    z.read, z.imported = frozenset({"VLLM_READ"}), imported
    z.key = z._key(pre)
    assert z.serves(pre)
    assert z.serves(dict(pre, LIBTPU_INIT_ARGS="--imports ",
                         XLA_FLAGS="--avx2 --devices=4", VLLM_UNREAD="x"))
    assert not z.serves(dict(pre, LIBTPU_INIT_ARGS="--own"))
    assert not z.serves(dict(pre, VLLM_READ="2"))
