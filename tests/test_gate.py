"""One gate for every fix: `is_gemma_qat` reads the load format from each
kind of config the fixes see; the package face is imported by nobody inside
the package (its names come from the low modules)."""
import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_gemma_qat import gate

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_gemma_qat"


@pytest.mark.parametrize("load_format", ["gemma_qat", "auto", None])
def test_is_gemma_qat_reads_every_config_kind(load_format):
    from vllm.config.load import LoadConfig
    expected = load_format == "gemma_qat"
    # EngineArgs (preflight) carries load_format itself, as a LoadConfig does.
    load = SimpleNamespace(load_format=load_format)
    assert gate.is_gemma_qat(SimpleNamespace(load_config=load)) is expected
    assert gate.is_gemma_qat(load) is expected
    if load_format is not None:
        load = LoadConfig(load_format=load_format)
        assert gate.is_gemma_qat(load) is expected
        assert gate.is_gemma_qat(SimpleNamespace(load_config=load)) is expected
    assert not gate.is_gemma_qat(SimpleNamespace())


def test_the_face_reexports_the_gate():
    import vllm_gemma_qat
    assert vllm_gemma_qat.LOAD_FORMAT == gate.LOAD_FORMAT == "gemma_qat"


def test_nothing_in_the_package_imports_names_from_its_face():
    """`from vllm_gemma_qat import X` inside the package may only name
    submodules; the face's own names (LOAD_FORMAT, register) come from
    `gate` or are not imported at all."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == \
                    "vllm_gemma_qat" and node.level == 0:
                for alias in node.names:
                    if not ((PACKAGE / f"{alias.name}.py").is_file()
                            or (PACKAGE / alias.name).is_dir()):
                        offenders.append(f"{path.relative_to(PACKAGE)}: "
                                         f"{alias.name}")
    assert offenders == []
