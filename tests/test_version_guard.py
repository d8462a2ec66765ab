"""The structural guard: a tpu-inference whose Gemma 4 is not what the
patch expects (here: a copy of the installed one with a fused qkv_proj, as
0.24-0.27 have) gets one clear error under gemma_qat, naming the installed
version and the supported range; other load formats are untouched. The
package's base requirements name none of the stack."""
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# One worker runs this module: its module-scoped fixture is expensive.
pytestmark = pytest.mark.xdist_group("version_guard")

ROOT = Path(__file__).resolve().parents[1]
STACK = {"vllm", "vllm-tpu", "tpu-inference", "jax", "jaxlib", "torch",
         "libtpu"}


def test_base_requirements_name_none_of_the_stack():
    import re
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[; ]", r, 1)[0].lower()
             for r in project["dependencies"]}
    assert not names & STACK, names & STACK
    # The [tpu] extra pins the tested release (with its [audio] decoders).
    assert any(re.split(r"[<>=!~\[; ]", r, 1)[0] == "vllm-tpu" and "==" in r
               for r in project["optional-dependencies"]["tpu"])


@pytest.fixture(scope="module")
def fused_qkv_copy(tmp_path_factory):
    src = Path(importlib.util.find_spec("tpu_inference").origin).parent
    root = tmp_path_factory.mktemp("tpu-inference-fused")
    shutil.copytree(src, root / "tpu_inference",
                    ignore=shutil.ignore_patterns("__pycache__"))
    gemma4 = root / "tpu_inference/models/jax/gemma4.py"
    text = gemma4.read_text()
    anchor = "class Gemma4Attention(JaxModule):\n"
    assert anchor in text
    # What 0.24-0.27 have: one fused Q/K/V projection.
    gemma4.write_text(text.replace(
        anchor, anchor + "    qkv_proj = None  # fused Q/K/V\n", 1))
    return root


CHECK = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_gemma_qat.testing.runner import load
import tpu_inference.models.jax.gemma4 as g
assert g.__file__.startswith(sys.argv[1]), g.__file__
try:
    load(sys.argv[2], "gemma_qat")
except Exception as e:
    print("ERROR", type(e).__name__, e)
model, _, _ = load(sys.argv[3], "auto")
print("auto loaded", type(model.model).__name__)
"""


def test_fused_qkv_is_refused_clearly_and_auto_untouched(fused_qkv_copy,
                                                         tiny_models):
    qat = tiny_models.checkpoint("e2b", True, "qat")
    regular = tiny_models.checkpoint("e2b", True, "regular")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(fused_qkv_copy), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHECK, str(fused_qkv_copy),
                          str(qat), str(regular)], env=env, cwd=fused_qkv_copy,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    version = importlib.metadata.version("tpu-inference")
    assert (f"ERROR UnsupportedTpuInference --load-format gemma_qat does not "
            f"support the installed tpu-inference {version}: Gemma4Attention "
            f"fuses Q/K/V into one qkv_proj. Supported: tpu-inference 0.22.1, "
            f"0.23.0 and 0.28.0-0.32.0") in out.stdout, out.stdout
    assert "auto loaded" in out.stdout
