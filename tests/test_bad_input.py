"""A bad checkpoint ends in one clear error that names the culprit, raised
by the real load path (vLLM config, tpu-inference's get_model, our loader)
before anything could be served. The other header-level cases are unit tests
of checkpoint.py / geometry.py (test_checkpoint.py, test_geometry.py)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from vllm_gemma_qat.checkpoint import CheckpointError
from vllm_gemma_qat.cpu.env import CPU_ENV
from vllm_gemma_qat.testing import runner


@pytest.fixture
def qat_copy(tiny_models, tmp_path):
    src = tiny_models.checkpoint("e2b", True, "qat")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit):
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_missing_tensor(plugin, qat_copy):
    name = "model.language_model.layers.3.mlp.down_proj.weight"
    _edit_tensors(qat_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensor {name}"):
        runner.load(qat_copy, "gemma_qat")


def test_vllm_serve_fails_fast_with_the_named_error(qat_copy):
    # The header check runs where vLLM turns its arguments into a config:
    # no engine process starts, and the last line is the named error.
    config_file = qat_copy / "config.json"
    config = json.loads(config_file.read_text())
    config["text_config"]["num_kv_shared_layers"] = 4  # checkpoint has 5
    config_file.write_text(json.dumps(config))
    env = dict(os.environ, **CPU_ENV, VLLM_GEMMA_QAT_CPU_MODE="1")
    vllm = Path(sys.executable).with_name("vllm")
    start = time.monotonic()
    out = subprocess.run([vllm, "serve", qat_copy, "--load-format", "gemma_qat",
                          "--max-model-len", "256"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=600)
    print(f"vllm serve ended after {time.monotonic() - start:.1f} s")
    assert out.returncode != 0
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("vllm_gemma_qat.checkpoint.CheckpointError: ")
    assert "num_kv_shared_layers=4, but the checkpoint has K/V projections " \
        "for 5 of 10 layers" in last
    assert f"`vllm-gemma-qat inspect {qat_copy}` shows the full report" in last
    assert "EngineCore" not in out.stdout
