"""The import graph of ``elastic/`` and ``service/``, computed from the source: no cycles, arrows one way.

Every ``import`` and ``from ... import`` counts, wherever it is (module level, under ``TYPE_CHECKING``,
inside a function): a lazy import still makes one module depend on the other. A module's package is the
directory it lives in; a package and its own subpackages are one unit for the package graph (``service.api``
assembles ``service.api.routes``, which use its auth and schemas), every other pair of packages must not
import each other in both directions, even through others.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("elastic", "service")

#: What each package of ``elastic/`` may not import (the layers: train -> live -> checkpoint / rendezvous ->
#: etcd, with contract below them all; the service plane above the whole of elastic/).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "elastic": ("service",),
    "elastic.live": ("elastic.train",),
    "elastic.checkpoint": ("elastic.train", "elastic.live", "elastic.rendezvous"),
    "elastic.rendezvous": ("elastic.train", "elastic.live", "elastic.checkpoint"),
    "elastic.etcd": ("elastic.train", "elastic.live", "elastic.checkpoint", "elastic.rendezvous", "elastic.contract"),
    "elastic.contract": (
        "elastic.train",
        "elastic.live",
        "elastic.checkpoint",
        "elastic.rendezvous",
        "elastic.prefork",
    ),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, mods: Mapping[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: None if path.name == "__init__.py" else -1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([base] if base else [])])
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    found = []
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


@functools.cache
def import_graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(t for t in _targets(module, path, node, mods) if t != module)
    return graph, mods


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _package(module: str, mods: Mapping[str, Path]) -> str:
    return module if mods[module].name == "__init__.py" else module.rpartition(".")[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


@pytest.mark.timeout(60)
def test_the_cycle_finder_finds_a_cycle_through_three_modules_and_none_in_a_chain() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.timeout(60)
def test_no_module_of_elastic_or_service_imports_itself_back_through_others() -> None:
    graph, _ = import_graph()
    assert len(graph) > 100  # the whole source was read
    assert cycles(graph) == []


@pytest.mark.timeout(60)
def test_no_two_packages_import_each_other() -> None:
    graph, mods = import_graph()
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        a = _package(module, mods)
        packages.setdefault(a, set()).update(b for b in (_package(t, mods) for t in targets) if not _related(a, b))
    assert "elastic.train" in packages and "service.client" in packages
    assert cycles(packages) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package: str) -> None:
    graph, _ = import_graph()
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _within(module, package)
        for target in targets
        if any(_within(target, f) for f in FORBIDDEN[package])
    )
    assert wrong == []


@pytest.mark.timeout(60)
def test_no_loop_module_is_left_at_the_root_of_elastic() -> None:
    assert sorted(p.name for p in (REPO / "elastic").glob("loop*.py")) == []
    assert (REPO / "elastic" / "train" / "trainer.py").is_file()
