"""The runtime substitutions, declared once: every target of the fixes
(`vllm_gemma_qat.fixes`: kv-share, image steps, preemption, compile-once,
the drafter's load config and quantization, sliding-window KV, discarded
samples under speculation, request checks, text-only checkpoints,
rejection padding, int4 tiles and scales, audio),
of preflight and of CPU mode exists in the installed tpu-inference; a
missing target is named, never silently added; CPU mode refuses TPU
machines."""
import pytest

from vllm_gemma_qat import cpu, fixes, preflight, substitute
from vllm_gemma_qat.fixes import (audio, compile_once, discarded_samples,
                                  drafter_load, drafter_quantization,
                                  image_steps, int4_scales, int4_tiling,
                                  kv_share,
                                  preemption,
                                  rejection_padding, request_checks,
                                  sliding_window, text_only)
from vllm_gemma_qat.substitute import MissingTarget, Substitution

NAMES = ["kv_share", "image_steps", "preemption", "compile_once",
         "drafter_load", "drafter_quantization", "sliding_window",
         "discarded_samples", "request_checks", "text_only",
         "rejection_padding", "int4_tiling", "int4_scales", "audio",
         "preflight",
         "CPU kernels", "CPU runtime"]


def tables():
    return {"kv_share": kv_share.substitutions(None),
            "image_steps": image_steps.substitutions(),
            "preemption": preemption.substitutions(),
            "compile_once": compile_once.substitutions(),
            "drafter_load": drafter_load.substitutions(),
            "drafter_quantization": drafter_quantization.substitutions(),
            "sliding_window": sliding_window.cache_substitutions()
            + sliding_window.model_substitutions(),
            "discarded_samples": discarded_samples.substitutions(),
            "request_checks": request_checks.substitutions(),
            "text_only": text_only.substitutions(),
            "rejection_padding": rejection_padding.substitutions(),
            "int4_tiling": int4_tiling.substitutions(),
            "int4_scales": int4_scales.substitutions(),
            "audio": audio.substitutions() + audio.request_substitutions(),
            "preflight": preflight.substitutions(),
            "CPU kernels": cpu.kernel_substitutions(),
            "CPU runtime": cpu.runtime_substitutions()}


def test_every_installed_fix_has_its_table_checked():
    assert set(fixes.ALL) <= set(NAMES) == set(tables())


@pytest.mark.parametrize("name", NAMES)
def test_every_target_exists_in_the_installed_stack(name):
    table = tables()[name]
    assert table
    for s in table:
        owner, attr = s.resolve()
        assert callable(getattr(owner, attr)), s.target
        assert s.why


def test_a_renamed_target_is_named_not_added():
    import tpu_inference.utils as utils
    renamed = Substitution("tpu_inference.utils:get_device_hbm_limit_v2",
                           lambda: 0, "test")
    with pytest.raises(MissingTarget, match=r"tpu_inference\.utils:"
                       r"get_device_hbm_limit_v2 does not exist in the "
                       r"installed tpu_inference"):
        substitute.apply([renamed], "test")
    assert not hasattr(utils, "get_device_hbm_limit_v2")
    with pytest.raises(MissingTarget, match="cannot import"):
        Substitution("tpu_inference.no_such_module:x", None, "").resolve()


def test_applied_installs_once_and_restores():
    from tpu_inference.layers.common import attention_interface as ai
    original = ai.ragged_paged_attention
    target = ("tpu_inference.layers.common.attention_interface:"
              "ragged_paged_attention")
    with cpu.kernels():
        assert ai.ragged_paged_attention is not original
        assert substitute.installed(target)
        # Applying again changes nothing (no double wrapping).
        assert substitute.apply(cpu.kernel_substitutions(), "again") == []
    assert ai.ragged_paged_attention is original
    assert not substitute.installed(target)


def test_cpu_mode_refuses_tpu_machines(tmp_path):
    assert cpu.tpu_evidence({"JAX_PLATFORMS": "cpu"}, str(tmp_path)) is None
    assert "not 'cpu'" in cpu.tpu_evidence({"JAX_PLATFORMS": "tpu"},
                                           str(tmp_path))
    assert "not 'cpu'" in cpu.tpu_evidence({}, str(tmp_path))
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "0").touch()
    assert cpu.tpu_evidence({"JAX_PLATFORMS": "cpu"},
                            str(tmp_path)).endswith("vfio/0 exists (a TPU "
                                                    "device)")
    (tmp_path / "accel0").touch()
    assert "accel0 exists" in cpu.tpu_evidence({"JAX_PLATFORMS": "cpu"},
                                               str(tmp_path))


def test_another_tables_substitution_for_the_same_target_goes_in():
    # A fix wraps a target; AOT mode then replaces the same target for the
    # length of a compile (found: AOT's model build was skipped as "already
    # installed" once the drafter's load fix wrapped _get_nnx_model).
    import types
    owner = types.ModuleType("owner")
    owner.f = lambda: "original"
    import sys
    sys.modules["_substitute_test_owner"] = owner
    try:
        fix = [Substitution("_substitute_test_owner:f",
                            lambda f: (lambda: "fixed " + f()), "a fix",
                            wraps=True)]
        other = [Substitution("_substitute_test_owner:f", lambda: "other",
                              "another mode")]
        assert substitute.apply(fix, "fix") and owner.f() == "fixed original"
        assert not substitute.apply(fix, "fix")  # again: nothing more
        with substitute.applied(other, "other"):
            assert owner.f() == "other"
        assert owner.f() == "fixed original"
    finally:
        del sys.modules["_substitute_test_owner"]


def test_apply_on_import_waits_for_the_module_and_registers_once(
        tmp_path, monkeypatch):
    import importlib
    import sys
    (tmp_path / "_later_imported.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = lambda: [Substitution("_later_imported:f",  # noqa: E731
                                  lambda: 2, "test")]
    for _ in range(2):  # register() runs in every process, maybe twice
        substitute.apply_on_import("_later_imported", table, "test")
    finders = [f for f in sys.meta_path
               if getattr(f, "name", None) == "_later_imported"]
    assert len(finders) == 1 and len(finders[0].callbacks) == 1
    assert "_later_imported" not in sys.modules  # not imported by it
    try:
        assert importlib.import_module("_later_imported").f() == 2
    finally:
        sys.modules.pop("_later_imported", None)


def test_optional_table_with_a_missing_target_is_left_out_whole(
        tmp_path, monkeypatch):
    import importlib
    import logging
    import sys
    (tmp_path / "_older_release.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = lambda: [  # noqa: E731
        Substitution("_older_release:f", lambda: 2, "present"),
        Substitution("_older_release:renamed", lambda: 3, "missing")]
    substitute.apply_on_import("_older_release", table, "optional fix",
                               optional=True)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    substitute.logger.addHandler(handler)
    try:
        module = importlib.import_module("_older_release")
        assert module.f() == 1  # nothing applied, the import went through
        assert any("optional fix: not applied" in r
                   and "_older_release:renamed" in r for r in records)
        with pytest.raises(substitute.MissingTarget, match="renamed"):
            substitute.apply(table(), "required fix")
    finally:
        substitute.logger.removeHandler(handler)
        sys.modules.pop("_older_release", None)
