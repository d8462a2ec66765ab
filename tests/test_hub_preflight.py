"""`vllm-gemma-qat inspect REPO_ID` answers before any download: config.json
and the safetensors headers come from the hub with range requests. The hub
here is a local HTTP server on 127.0.0.1 (HF_ENDPOINT) serving header-only
checkpoints with the real E2B shapes; nothing leaves the machine."""
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from vllm_gemma_qat.testing import synthetic

CLI = shutil.which("vllm-gemma-qat")
COMMIT = "0" * 40


class Hub(http.server.ThreadingHTTPServer):
    """GET / HEAD /{org}/{name}/resolve/{revision}/{file}, with Range."""

    def __init__(self, repos: dict[str, Path]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.bytes_sent = 0


class _Handler(http.server.BaseHTTPRequestHandler):

    def log_message(self, *args):
        pass

    def _file(self) -> Path | None:
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return None
        root = self.server.repos.get("/".join(parts[:2]))
        file = root / "/".join(parts[4:]) if root else None
        return file if file and file.is_file() else None

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body: bool):
        file = self._file()
        if file is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = file.stat().st_size
        start, end = 0, size - 1
        wanted = self.headers.get("Range")
        if wanted:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last or size - 1), size - 1)
        with open(file, "rb") as f:
            f.seek(start)
            data = f.read(end - start + 1)
        self.send_response(206 if wanted else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"%s"' % hashlib.sha1(
            f"{file}{size}".encode()).hexdigest())
        self.send_header("Content-Length", str(len(data)))
        if wanted:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if body:
            self.wfile.write(data)
            self.server.bytes_sent += len(data)


@pytest.fixture
def hub(tmp_path):
    repos = {"google/e2b-qat": synthetic.write_header_only(
        tmp_path / "qat", "e2b", "qat"),
        "google/e2b-bad": synthetic.write_header_only(
            tmp_path / "bad", "e2b", "qat",
            exclude={"model.language_model.layers.3.mlp.down_proj.weight"})}
    server = Hub(repos)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, tmp_path
    server.shutdown()


def inspect(repo, hub, tmp_path, command="inspect"):
    server, _ = hub
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
               HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_DISABLE_XET="1")
    out = subprocess.run([CLI, command, repo, "--json"], capture_output=True,
                         text=True, env=env, timeout=120)
    return out.returncode, out.stdout, out.stderr


def test_inspect_repo_id_reads_headers_only(hub, tmp_path):
    server, root = hub
    rc, out, err = inspect("google/e2b-qat", hub, tmp_path)
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["loads_with_gemma_qat"] and not summary["loads_with_auto"]
    assert summary["language_model_tensors"] == 540
    # Headers and config only: a few hundred KiB of a ~10 GB checkpoint.
    total = sum(f.stat().st_size for f in (root / "qat").iterdir())
    assert total > 9e9 and server.bytes_sent < 2e6


def test_plan_repo_id_from_the_hub_headers(hub, tmp_path):
    rc, out, err = inspect("google/e2b-qat", hub, tmp_path, "plan")
    assert rc == 0, err
    p = json.loads(out)
    assert p["kv_bytes_per_token"] == 18 * 1024
    assert p["weights_from"] == "checkpoint headers"


def test_inspect_repo_id_names_the_missing_tensor(hub, tmp_path):
    rc, out, _ = inspect("google/e2b-bad", hub, tmp_path)
    assert rc == 1
    missing = json.loads(out)["missing"]
    assert missing == ["model.language_model.layers.3.mlp.down_proj.weight"]


def test_unknown_repo_is_one_clear_error(hub, tmp_path):
    rc, out, _ = inspect("google/nothing-here", hub, tmp_path)
    assert rc == 2
    assert "google/nothing-here: not a local directory, and its config.json" \
        in json.loads(out)["error"]
