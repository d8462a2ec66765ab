"""patches/ fixes tpu-inference itself (#3225; image steps; preemption;
one cache clear per weight load; weights in the model's dtype; the
speculative drafter's load config and quantization; sliding-window KV,
#3220; no async placeholder for discarded samples under speculation;
prompt_logprobs refused where the runner cannot serve them; text-only
checkpoints as transformers saves them; padded draft tokens in rejection
sampling; dense int4 gmm_v2 tiles; f32 int4 scales; audio input):
applied to a copy of the installed (pinned) tpu-inference, stock `auto`
loads both layouts with no plugin, each patch's own tests pass, and the
plugin steps aside."""
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# One worker runs this module: its module-scoped fixture is expensive.
pytestmark = pytest.mark.xdist_group("upstream_patch")

ROOT = Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
PINNED = "0.32.0"
UPSTREAM_TESTS = "tests/models/jax/test_gemma4_kv_share.py"
# Patches that add a test file of their own: (patch, test file, files the
# fix touches, how many tests pass: the count patches/README.md states).
NEW_TEST_FILES = {
    "0002-Gemma4-Image-steps-keep-token-ids-with-the-embeddings.patch": (
        "tests/models/jax/test_gemma4_mm_inputs.py",
        ("tpu_inference/runner/tpu_runner.py",
         "tpu_inference/runner/compilation_manager.py",
         "tpu_inference/models/jax/gemma4_mm.py"), 7),
    "0003-Runner-Restore-resumed-requests-output-tokens-under-async.patch": (
        "tests/runner/test_persistent_batch_manager_async.py",
        ("tpu_inference/runner/persistent_batch_manager.py",
         "tpu_inference/runner/tpu_runner.py"), 2),
    "0004-Weights-Clear-JAX-caches-once-per-load-not-per-module.patch": (
        "tests/models/jax/test_weight_loading_compiles.py",
        ("tpu_inference/models/jax/utils/weight_utils.py", ), 1),
    "0005-Weights-Load-floating-point-weights-in-the-model-dtype.patch": (
        "tests/models/jax/test_weight_loading_dtype.py",
        ("tpu_inference/models/jax/utils/weight_utils.py", ), 4),
    "0006-Spec-decode-Load-the-drafter-with-draft_load_config.patch": (
        "tests/models/common/test_model_loader_draft_load_config.py",
        ("tpu_inference/models/common/model_loader.py", ), 3),
    "0007-Spec-decode-Build-the-drafter-with-its-own-quantization-config"
    ".patch": (
        "tests/models/common/test_model_loader_draft_quantization.py",
        ("tpu_inference/models/common/model_loader.py",
         "tpu_inference/layers/jax/quantization/__init__.py"), 4),
    "0008-Gemma4-Sliding-window-aware-KV-cache.patch": (
        "tests/models/jax/test_gemma4_sliding_window_kv.py",
        ("tpu_inference/runner/kv_cache_manager.py",
         "tpu_inference/models/jax/gemma4.py",
         "tpu_inference/models/common/kv_share.py"), 8),
    "0009-Spec-decode-No-async-placeholder-for-discarded-samples.patch": (
        "tests/runner/test_tpu_runner_spec_decode_placeholders.py",
        ("tpu_inference/runner/tpu_runner.py", ), 2),
    "0010-Platform-Refuse-prompt_logprobs-the-runner-cannot-serve.patch": (
        "tests/platforms/test_tpu_platform_prompt_logprobs.py",
        ("tpu_inference/platforms/tpu_platform.py", ), 4),
    "0011-Gemma4-Build-and-load-text-only-checkpoints-saved-by-transformers"
    ".patch": (
        "tests/models/jax/test_gemma4_text_only.py",
        ("tpu_inference/models/jax/gemma4.py", ), 4),
    "0012-Spec-decode-Padded-draft-tokens-do-not-count-as-the-last-sequence"
    ".patch": (
        "tests/layers/jax/sample/test_rejection_sampler_padding.py",
        ("tpu_inference/layers/jax/sample/rejection_sampler.py", ), 3),
    "0013-Linear-Dense-gmm_v2-calls-one-M-bucket-N-tiles-bound.patch": (
        "tests/layers/common/test_linear_gmm_tiling.py",
        ("tpu_inference/layers/common/linear.py", ), 3),
    "0014-Quantization-wNa16-Hold-the-gmm_v2-kernel-s-scales-in-f32.patch": (
        "tests/layers/jax/quantization/test_wna16_scale_dtype.py",
        ("tpu_inference/layers/jax/quantization/wna16.py", ), 2),
    "0015-Gemma4-Audio-input-the-conformer-audio-tower-and-its-embedder"
    ".patch": (
        "tests/models/jax/test_gemma4_audio.py",
        ("tpu_inference/models/jax/gemma4_mm.py",
         "tpu_inference/models/jax/gemma4_audio.py"), 3),
}


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    version = importlib.metadata.version("tpu-inference")
    assert version == PINNED, (
        f"patches/ targets tpu-inference {PINNED}, installed is {version}: "
        "rebase the patch")
    assert PATCHES, "no patch in patches/"
    src = Path(importlib.util.find_spec("tpu_inference").origin).parent
    root = tmp_path_factory.mktemp("tpu-inference-patched")
    shutil.copytree(src, root / "tpu_inference",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for patch in PATCHES:
        # git apply refuses any hunk that does not match exactly (no fuzz).
        # The wheel ships no tests/: the package part only.
        apply = ["git", "apply", "--include=tpu_inference/*", str(patch)]
        out = subprocess.run([*apply[:2], "--check", "-v", *apply[2:]],
                             cwd=root, capture_output=True, text=True)
        assert out.returncode == 0, (
            f"{patch.name} no longer applies to tpu-inference {version}:\n"
            f"{out.stderr}")
        subprocess.run(apply, cwd=root, check=True)
    return root


def appended_tests(patch_text: str, path: str) -> str:
    """The lines the patch appends at the end of `path` (its last hunk)."""
    diff = patch_text.split(f"diff --git a/{path} b/{path}\n", 1)[1]
    diff = diff.split("\ndiff --git ", 1)[0]
    last_hunk = diff.rsplit("\n@@ ", 1)[1].split("\n", 1)[1]
    return "".join(line[1:] + "\n" for line in last_hunk.splitlines()
                   if line.startswith("+"))


def new_file(patch_text: str, path: str) -> str:
    """The content of a file the patch creates."""
    diff = patch_text.split(f"diff --git a/{path} b/{path}\n", 1)[1]
    diff = diff.split("\ndiff --git ", 1)[0]
    assert "new file mode" in diff.split("\n@@ ", 1)[0], path
    body = diff.split("\n@@ ", 1)[1].split("\n", 1)[1]
    return "".join(line[1:] + "\n" for line in body.splitlines()
                   if line.startswith("+"))


def _run(args, root, **env):
    path = [str(root), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                   **env)
    return subprocess.run([sys.executable, *map(str, args)], cwd=root,
                          env=environ, capture_output=True, text=True,
                          timeout=900)


def test_patch_touches_what_it_should(patched):
    text = PATCHES[0].read_text()
    for path in ("tpu_inference/models/common/kv_share.py",
                 "tpu_inference/models/jax/gemma4.py",
                 "tpu_inference/models/jax/gemma4_mm.py", UPSTREAM_TESTS):
        assert f"diff --git a/{path} b/{path}" in text
    # Tests go into tpu-inference's existing KV-share test file.
    assert "new file mode" not in text


def test_stock_auto_loads_both_layouts_with_patch_and_no_plugin(
        patched, tiny_models):
    paths = [_bare_text_checkpoint(patched, tiny_models)]  # 0011
    for geometry, multimodal in (("e2b", True), ("e4b", False)):
        for layout in ("qat", "regular"):
            src = tiny_models.checkpoint(geometry, multimodal, layout)
            dst = patched.parent / f"{geometry}-{layout}"
            if not dst.exists():
                shutil.copytree(src, dst)
            paths.append(dst)
    # VLLM_PLUGINS names only tpu-inference's own plugin: ours stays out.
    out = _run([ROOT / "tests" / "upstream_check.py", "stock", *paths], patched,
               VLLM_PLUGINS="register_layers")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count("ok stock auto") == 5, out.stdout
    assert "ok stock auto e4b bare" in out.stdout
    assert "ok stock bfloat16 from float32 e4b-regular" in out.stdout  # 0005


def test_patch_own_tests_pass_against_patched_copy(upstream_tests_run):
    tests = appended_tests(PATCHES[0].read_text(), UPSTREAM_TESTS)
    assert tests.count("\ndef test_") == 2
    outcomes, output = upstream_tests_run
    assert outcomes.get(UPSTREAM_TESTS) == ["passed"] * 2, (
        f"{UPSTREAM_TESTS}: {outcomes.get(UPSTREAM_TESTS)}\n{output[-4000:]}")


def _bare_text_checkpoint(patched, tiny_models):
    """The E4B-like text model as transformers saves it (0011)."""
    from vllm_gemma_qat.testing import tiny
    dst = patched.parent / "e4b-bare"
    if not dst.exists():
        tiny.save_checkpoint(tiny_models.model("e4b", False), dst, bare=True)
    return dst


def test_plugin_detects_fixed_tpu_inference_and_still_loads(patched, tiny_models):
    dst = patched.parent / "e2b-qat"
    if not dst.exists():
        shutil.copytree(tiny_models.checkpoint("e2b", True, "qat"), dst)
    # fixes/text_only.py over 0011: both read a bare config the same way.
    bare = _bare_text_checkpoint(patched, tiny_models)
    out = _run([ROOT / "tests" / "upstream_check.py", "plugin", dst, bare],
               patched)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "ok plugin gemma_qat e2b qat" in out.stdout
    assert "ok plugin gemma_qat e4b bare" in out.stdout
    assert "tpu-inference already builds no K/V" in out.stdout + out.stderr
    # 0008: the plugin's sliding-window fix sees the packing and steps
    # aside (it would pack the rows a second time).
    assert "packs True" in out.stdout, out.stdout[-2000:]


@pytest.fixture(scope="module")
def upstream_tests_run(patched, tmp_path_factory):
    """The first patch's tests (appended to tpu-inference's KV-share test
    file) and every later patch's new test file, written into the patched
    copy and run in one pytest process (each file alone imports
    tpu-inference for ~20 s): {test file: its junit testcases' outcomes},
    and the output."""
    import xml.etree.ElementTree as ET
    own = patched / UPSTREAM_TESTS
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_text((ROOT / "tests" / "upstream_test_context.py").read_text()
                   + appended_tests(PATCHES[0].read_text(), UPSTREAM_TESTS))
    files = [own]
    for patch_name, (tests, _, _) in sorted(NEW_TEST_FILES.items()):
        text = (ROOT / "patches" / patch_name).read_text()
        file = patched / tests
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(new_file(text, tests))
        files.append(file)
    report = tmp_path_factory.mktemp("new-test-files") / "report.xml"
    out = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider",
                f"--rootdir={patched}", f"--junitxml={report}", *files],
               patched)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname").replace(".", "/") + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        outcomes.setdefault(path, []).append(outcome)
    return outcomes, out.stdout


def test_the_audio_tower_is_the_plugins_own_code():
    """Patch 0015's models/jax/gemma4_audio.py is the plugin's
    fixes/audio_tower.py under tpu-inference's license header: one tower,
    not two that drift apart."""
    patch = next(p for p in PATCHES if p.name.startswith("0015-"))
    added = new_file(patch.read_text(),
                     "tpu_inference/models/jax/gemma4_audio.py")
    own = (ROOT / "vllm_gemma_qat" / "fixes" / "audio_tower.py").read_text()
    header, _, body = added.partition("\n\n")
    assert body == own
    assert all(line.startswith("#") for line in header.splitlines())


@pytest.mark.parametrize("patch_name", sorted(NEW_TEST_FILES))
def test_new_test_files_of_later_patches_pass_against_patched_copy(
        upstream_tests_run, patch_name):
    tests, touched, count = NEW_TEST_FILES[patch_name]
    text = (ROOT / "patches" / patch_name).read_text()
    for path in touched:
        assert f"diff --git a/{path} b/{path}" in text
    outcomes, output = upstream_tests_run
    assert outcomes.get(tests) == ["passed"] * count, (
        f"{tests}: {outcomes.get(tests)}\n{output[-4000:]}")
