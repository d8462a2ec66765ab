"""A bad checkpoint ends in one clear error that names the culprit, raised
by the real load path (vLLM config, tpu-inference's get_model, our loader)
before anything could be served. The other header-level cases are unit tests
of checkpoint.py / geometry.py (test_checkpoint.py, test_geometry.py)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from vllm_gemma_qat.checkpoint import CheckpointError
from vllm_gemma_qat.cpu.server import CpuServer
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
    out = _vllm_serve(qat_copy)
    assert out.returncode != 0
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("vllm_gemma_qat.checkpoint.CheckpointError: ")
    assert "num_kv_shared_layers=4, but the checkpoint has K/V projections " \
        "for 5 of 10 layers" in last
    assert f"`vllm-gemma-qat inspect {qat_copy}` shows the full report" in last
    assert "EngineCore" not in out.stdout


def _vllm_serve(model, *args):
    """`vllm serve MODEL --load-format gemma_qat ARGS` in CPU mode, which
    must stop before serving: exit code and output (forked from the
    suite's zygote: a refusal needs no fresh import of vLLM)."""
    start = time.monotonic()
    fd, log = tempfile.mkstemp(suffix=".log", dir=Path(model).parent)
    os.close(fd)
    out = CpuServer(model, *args, log=log).refusal()
    print(f"vllm serve ended after {time.monotonic() - start:.1f} s")
    return out


def test_int4_groups_tp_cannot_split_fail_fast(tmp_path):
    # The tiny model's down_proj has 128 inputs: 4 int4 groups, which 8
    # chips cannot split (tpu-inference would end in a raw JAX
    # IndivisibleError while sharding the scales). Named before any engine
    # starts; `plan --tp` says the same.
    from vllm_gemma_qat.testing import tiny
    model = tmp_path / "w4a16"
    tiny.save_servable_int4(model, "w4a16", "e2b", multimodal=False)
    out = _vllm_serve(model, "--tensor-parallel-size", "8")
    assert out.returncode != 0
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("vllm_gemma_qat.checkpoint.CheckpointError: "
                           "model.language_model.layers.0.mlp.down_proj: 4 "
                           "int4 groups of 32 input columns do not split over "
                           "--tensor-parallel-size 8"), last
    assert "EngineCore" not in out.stdout and "IndivisibleError" not in out.stdout
    cli = Path(sys.executable).with_name("vllm-gemma-qat")
    plan = subprocess.run([cli, "plan", _bf16_twin(tmp_path),
                           "--weights", "int4", "--tp", "8", "--context",
                           "256"], capture_output=True, text=True)
    assert plan.returncode == 1
    assert ("does NOT load at int4: model.language_model.layers.0.mlp."
            "down_proj: 4 int4 groups") in plan.stdout
    plan = subprocess.run([cli, "plan", _bf16_twin(tmp_path),
                           "--weights", "int4", "--tp", "4", "--context",
                           "256"], capture_output=True, text=True)
    assert plan.returncode == 0 and "does NOT" not in plan.stdout


def _bf16_twin(tmp_path):
    """The same tiny geometry as a bf16 checkpoint (plan takes bf16)."""
    from vllm_gemma_qat.testing import tiny
    path = tmp_path / "bf16"
    if not path.exists():
        tiny.save_checkpoint(tiny.build_model("e2b", False), path)
    return path
