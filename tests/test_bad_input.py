"""A bad checkpoint ends in one clear error that names the culprit, raised
by the real load path (vLLM config, tpu-inference's get_model, our loader)
before anything could be served. The other header-level cases are unit tests
of checkpoint.py / geometry.py (test_checkpoint.py, test_geometry.py)."""
import shutil

import pytest
from safetensors.torch import load_file, save_file

from vllm_gemma_qat.checkpoint import CheckpointError
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
