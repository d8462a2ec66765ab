import os
import sys

from vllm_gemma_qat.cpu.env import set_defaults

set_defaults(os.environ)  # before anything imports JAX / tpu_inference
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


def _on_tpu() -> bool:
    return os.environ.get("JAX_PLATFORMS", "") not in ("cpu", "")


def pytest_collection_modifyitems(config, items):
    if _on_tpu():
        return
    skip = pytest.mark.skip(reason="needs a real TPU")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def plugin():
    """The plugin as vLLM loads it: through its entry point."""
    from vllm.plugins import load_general_plugins
    load_general_plugins()


class Tiny:
    """Tiny transformers models and their checkpoints, built once a session."""

    def __init__(self, root):
        self.root = root
        self.models = {}

    def model(self, geometry, multimodal):
        from vllm_gemma_qat.testing import tiny
        key = (geometry, multimodal)
        if key not in self.models:
            self.models[key] = tiny.build_model(geometry, multimodal)
        return self.models[key]

    def checkpoint(self, geometry="e2b", multimodal=True, layout="qat"):
        from vllm_gemma_qat.testing import tiny
        path = self.root / f"{geometry}-{'mm' if multimodal else 'text'}-{layout}"
        if not path.exists():
            tiny.save_checkpoint(self.model(geometry, multimodal), path, layout)
        return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    return Tiny(tmp_path_factory.mktemp("tiny"))
