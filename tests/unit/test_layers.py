"""The import graph: one `tandem` namespace, layers that only look down, no cycles.

Every module's imports are read with ast (function-level and TYPE_CHECKING imports
count: a cycle through a lazy import is still a cycle in the design).

    top        tandem (CLI, launcher, models, placement), tandem.bench   may import everything
    service    tandem.prefill, tandem.decode                            engine, kvtransfer, bottom
               tandem.gateway                                           bottom only (no torch)
    transfer   tandem.kvtransfer                                        engine, bottom
    engine     tandem.engine, tandem.kernels                            bottom
    bottom     tandem.cluster                                           nothing of ours; no torch
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"cluster": "tandem.cluster", "engine": "tandem.engine", "kernels": "tandem.kernels",
           "kvtransfer": "tandem.kvtransfer", "prefill": "tandem.prefill", "decode": "tandem.decode",
           "gateway": "tandem.gateway", "bench": "tandem.bench", "tandem": "tandem"}
OLD_NAMES = set(FOLDERS) - {"tandem"}

# which packages each package may import (besides itself)
ALLOWED = {
    "tandem.cluster": set(),
    "tandem.kernels": {"tandem.cluster"},
    "tandem.engine": {"tandem.cluster", "tandem.kernels"},
    "tandem.kvtransfer": {"tandem.cluster", "tandem.engine", "tandem.kernels"},
    "tandem.prefill": {"tandem.cluster", "tandem.engine", "tandem.kernels", "tandem.kvtransfer"},
    "tandem.decode": {"tandem.cluster", "tandem.engine", "tandem.kernels", "tandem.kvtransfer"},
    "tandem.gateway": {"tandem.cluster"},
    "tandem.bench": set(FOLDERS.values()),
    "tandem": set(FOLDERS.values()),
}
NO_TORCH = {"tandem.cluster", "tandem.gateway"}
SOURCE_ROOTS = [*FOLDERS, "tests", "scripts"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in FOLDERS:
        parts = FOLDERS[parts[0]].split(".") + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found = {}
    for folder in SOURCE_ROOTS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[_module_name(path)] = path
    return found


SOURCES = _sources()


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "tandem":
        return parts[0]
    if len(parts) > 1 and "tandem." + parts[1] in ALLOWED:
        return "tandem." + parts[1]
    return "tandem"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import; `from pkg import name` names pkg.name when that is a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if sub in SOURCES else node.module))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def test_every_package_folder_is_read():
    assert {_package(m) for m in SOURCES if m.startswith("tandem")} == set(ALLOWED)


def test_no_module_imports_an_old_top_level_name_or_relatively():
    bad = [f"{path.relative_to(ROOT)}:{line} {name}" for path in SOURCES.values()
           for line, name in _imports(path)
           if name.startswith(".") or name.split(".")[0] in OLD_NAMES]
    assert not bad, "import through the tandem namespace, absolutely:\n" + "\n".join(bad)


def test_imports_only_go_down_the_layers():
    bad = []
    for module, path in SOURCES.items():
        if not module.startswith("tandem"):
            continue
        own = _package(module)
        for line, name in _imports(path):
            if name.split(".")[0] == "torch" and own in NO_TORCH:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports torch")
            if not name.startswith("tandem"):
                continue
            target = _package(name)
            if target != own and target not in ALLOWED[own]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {name} ({target})")
    assert not bad, "imports up the layers:\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in SOURCES.items():
        if not module.startswith("tandem"):
            continue
        targets = set()
        for _, name in _imports(path):
            # `import tandem.a.b` runs tandem.a's __init__ too, but that is no design dependency
            while name and name not in SOURCES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in SOURCES and name != module and name.startswith("tandem"):
                targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", ["tandem.cluster", "tandem.gateway"])
def test_torch_free_layers_have_modules(module):
    assert sum(1 for m in SOURCES if m.startswith(module + ".")) > 5


def test_module_names_are_unique_or_listed_with_their_reason():
    """A module's file name says what it holds, once in the tree; the exceptions (the two pools'
    counterpart modules) are listed in docs/architecture.md with their reason."""
    import collections

    folders = ("cluster", "engine", "kernels", "kvtransfer", "gateway", "prefill", "decode", "tandem", "bench")
    names = collections.Counter(p.name for folder in folders for p in (ROOT / folder).rglob("*.py")
                                if p.name != "__init__.py")
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "### Same-named modules" in doc
    listed = doc.split("### Same-named modules", 1)[1].split("\n#", 1)[0]
    unlisted = sorted(name for name, count in names.items() if count > 1 and f"`{name}`" not in listed)
    assert not unlisted, f"modules of the same name in several packages, not listed in docs/architecture.md: {unlisted}"
