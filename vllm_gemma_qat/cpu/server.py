"""Start and stop a real `vllm serve` on 127.0.0.1 in CPU mode (for the
demo, the end-to-end tests and the serving benchmark's smoke run)."""
from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from vllm_gemma_qat.gate import LOAD_FORMAT
from vllm_gemma_qat.cpu import CPU_MODE_ENV
from vllm_gemma_qat.cpu.lifetime import die_with_parent

# By default these servers pad every step to this many tokens, so
# tpu-inference compiles the model once per server instead of once per token
# bucket it meets (three or four in a test, ~6 s each at TP=4 on CPU).
# Small, because CPU mode's attention scores every prefill token of a step
# against every sequence's context in use; longer prompts are prefilled in
# chunks (vLLM's chunked prefill).
STEP_TOKENS = 32

# Fork servers from a process that has imported `vllm serve` already
# (cpu/zygote.py): the test suite turns this on for its own process.
FORK_FROM_ZYGOTE = False


# Servers started by this process and not yet stopped: a signal that ends
# the process ends them first (`_stop_live_servers_on_signals`).
_LIVE: set["CpuServer"] = set()


def stop_live_servers() -> None:
    """Stop every server this process started and has not stopped: each
    process group (API server, engine cores) SIGTERMed, then SIGKILLed
    after a grace period."""
    servers = list(_LIVE)
    for server in servers:
        server._signal_group(signal.SIGTERM)
    deadline = time.time() + 10
    for server in servers:
        try:
            server.process.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
        server._signal_group(signal.SIGKILL)
        _LIVE.discard(server)


_handlers_installed = False


def _stop_live_servers_on_signals() -> None:
    """SIGTERM, SIGINT and SIGHUP stop this process's servers first, then
    do what they did before (a timeout or Ctrl-C must not leave `vllm
    serve` processes behind: they run in sessions of their own, which no
    terminal or process-group signal reaches)."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not \
            threading.main_thread():
        return
    owner = os.getpid()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        before = signal.getsignal(signum)
        if before in (signal.SIG_IGN, None):  # e.g. SIGHUP under nohup
            continue

        def handler(number, frame, before=before):
            if os.getpid() == owner:  # not in a forked child
                stop_live_servers()
            if callable(before):
                return before(number, frame)
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)

        signal.signal(signum, handler)
    _handlers_installed = True


TIMINGS_ENV = "VLLM_GEMMA_QAT_TIMINGS"


def record_timing(kind: str, seconds: float, **what) -> None:
    """Append one timing to the JSON-lines file `VLLM_GEMMA_QAT_TIMINGS`
    names, if any (a test run sums them: tests/conftest.py)."""
    path = os.environ.get(TIMINGS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "seconds": round(seconds, 2),
                                **what}) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CpuServer:
    """`vllm serve MODEL --load-format gemma_qat ...` with CPU mode on; the
    plugin reaches every vLLM process through its entry point.
    `step_tokens=None` keeps vLLM's step budget and tpu-inference's token
    buckets (what a benchmark should measure)."""

    def __init__(self, model: str | Path, *extra_args: str, log: Path,
                 port: int | None = None, startup_timeout: float = 600,
                 devices: int = 1, step_tokens: int | None = STEP_TOKENS,
                 env: dict[str, str] | None = None,
                 zygote: bool | None = None):
        self.model, self.log = str(model), Path(log)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--load-format", LOAD_FORMAT, "--host", "127.0.0.1",
                     "--port", str(self.port), "--dtype", "float32",
                     "--max-model-len", "256", "--max-num-seqs", "8",
                     # Let the engine drain and exit on SIGTERM (the
                     # default, 0, force-kills it).
                     "--shutdown-timeout", "30"]
        if step_tokens:
            self.args += ["--max-num-batched-tokens", str(step_tokens)]
        self.args += extra_args
        self.step_tokens = step_tokens
        self.startup_timeout = startup_timeout
        self.devices = devices  # CPU devices JAX offers (for TP / DP > 1)
        self.env = env or {}  # added to the server's environment
        # None: FORK_FROM_ZYGOTE decides; False: a fresh `vllm serve`.
        self.zygote = FORK_FROM_ZYGOTE if zygote is None else zygote
        self.command = None  # set by _launch
        self.process = None
        self._log_file = None

    def __enter__(self) -> "CpuServer":
        started = self._launch()
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                self.__exit__()  # its engine cores may still run
                raise RuntimeError(f"vllm serve exited with "
                                   f"{self.process.returncode}; see {self.log}")
            if self._healthy():
                record_timing("server start-up", time.monotonic() - started,
                              model=Path(self.model).name)
                return self
            time.sleep(0.25)
        self.__exit__()
        raise TimeoutError(f"vllm serve not up after {self.startup_timeout} s; "
                           f"see {self.log}")

    def refusal(self) -> subprocess.CompletedProcess:
        """Run a `vllm serve` that must stop before serving (a refused
        checkpoint or flag): its exit code and its output. One that comes
        up is stopped, and is an AssertionError."""
        self._launch()
        deadline = time.time() + self.startup_timeout
        try:
            while self.process.poll() is None:
                if self._healthy():
                    raise AssertionError(f"vllm serve {self.model} is serving; "
                                         f"see {self.log}")
                if time.time() > deadline:
                    raise TimeoutError(f"vllm serve still running after "
                                       f"{self.startup_timeout} s; see "
                                       f"{self.log}")
                time.sleep(0.25)
        finally:
            self.__exit__()
        return subprocess.CompletedProcess(
            self.command, self.process.returncode,
            self.log.read_text(errors="replace"))

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2):
                return True
        except OSError:
            return False

    def _launch(self) -> float:
        """Start `vllm serve` (forked from a zygote or spawned); returns
        when it started (time.monotonic)."""
        env = dict(os.environ, **{CPU_MODE_ENV: "1", "JAX_PLATFORMS": "cpu"},
                   **self.env)
        # tpu-inference compiles every padding bucket at start-up (~35 s on
        # CPU for nothing a test uses); shapes are compiled when first used.
        env.setdefault("SKIP_JAX_PRECOMPILE", "1")
        # A test or demo server is no deployment to report: vLLM's usage
        # report runs cpuinfo in a Python subprocess (~0.6 s of CPU a
        # server) to post it, off line here.
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        if self.step_tokens:  # tpu-inference's smallest bucket: its only one
            env.setdefault("MIN_TOKEN_BUCKET", str(self.step_tokens))
        if self.devices > 1:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_"
                                f"platform_device_count={self.devices}").strip()
        self.command = [str(Path(sys.executable).with_name("vllm")), "serve",
                        self.model, *self.args]
        _stop_live_servers_on_signals()
        started = time.monotonic()
        if self.zygote:
            from vllm_gemma_qat.cpu import zygote
            self.process = zygote.start(self.command, env, self.log)
            if self.process.zygote_seconds:
                # Its own row of the summary, not the server's start-up.
                record_timing("zygote start-up", self.process.zygote_seconds,
                              model=Path(self.model).name)
                started += self.process.zygote_seconds
        else:
            self._log_file = open(self.log, "w")
            self.process = subprocess.Popen(
                self.command, env=env, stdout=self._log_file,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid()))
        _LIVE.add(self)
        return started

    def __exit__(self, *exc) -> None:
        stopping = time.monotonic()
        if self.process and self.process.poll() is None:
            # As `kill <pid>` would: the API server then stops its engine
            # (signalling the whole group races that shutdown).
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Engine cores left by an API server that died first.
        self._signal_group(signal.SIGKILL)
        _LIVE.discard(self)
        if self._log_file:
            self._log_file.close()
        record_timing("server shutdown", time.monotonic() - stopping,
                      model=Path(self.model).name)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)

    def metrics(self) -> dict[str, float]:
        return metric_totals(self.url)


def metric_totals(base_url: str) -> dict[str, float]:
    """Prometheus samples of `base_url`/metrics, summed over label sets, by
    metric name."""
    text = urllib.request.urlopen(base_url + "/metrics").read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out
