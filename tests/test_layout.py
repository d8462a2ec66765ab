"""Imports run one way: no module of the package imports, however lazily,
one that imports it back (the CLI and `compile` both resolve targets
through targets.py; aot/ never imports cli.py)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_gemma_qat"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports anywhere in it (function-level
    imports included: a lazy import is still an import)."""
    found = set()
    package = _module(path) if path.name == "__init__.py" else \
        _module(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split("."))
                                            - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from package import submodule` imports the submodule; any
            # other name comes from the module itself.
            names = [f"{base}.{alias.name}"
                     if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found - {_module(path)}


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(f) for f in files}
    return {_module(f): _imports(f, modules) for f in files}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "vllm_gemma_qat.targets" in graph["vllm_gemma_qat.cli"]
    assert "vllm_gemma_qat.targets" in graph["vllm_gemma_qat.aot.compile"]
    assert circles(graph) == []


def test_a_circle_is_seen():
    graph = import_graph()
    graph["vllm_gemma_qat.targets"] = graph["vllm_gemma_qat.targets"] | {
        "vllm_gemma_qat.cli"}
    assert any({"vllm_gemma_qat.cli", "vllm_gemma_qat.targets"} <= set(c)
               for c in circles(graph))
