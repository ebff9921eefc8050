"""The layering README.md states, checked on the source (an AST scan of every package folder
setup.py maps): nothing but the service itself imports `ctxcache.service` (clients use
`ctxcache.client`; the benchmarks start a server process), and nothing imports `ctxcache.bench`
(the CLI finds it through the `ctxcache.commands` entry point). Tests may import both.

The rooms below the service: service -> indexer -> store and service -> decoder <- store; the
indexer and the decoder import each other in neither direction; the store imports neither; the
core (`ctxcache/`: model, methods, kernels, artifact) imports no room; the quality measurements
(`quality/`) are imported by the benchmarks only. And no two modules import
each other, directly or round a longer circle (imports under `if TYPE_CHECKING:` excepted: they
never run)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def package_folders() -> dict[str, str]:
    """setup.py's ROOTS: package name -> folder."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    roots = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ROOTS")
    return {k.value: v.value for k, v in zip(roots.keys, roots.values)}


def imported(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every import, and of import_module("...") with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            yield node.lineno, str(node.args[0].value)


def runtime_imported(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """`imported`, less the imports under `if TYPE_CHECKING:` (annotations only; they never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    pruned = [n for n in ast.walk(tree) if id(n) not in skip]
    mod = ast.Module(body=[], type_ignores=[])
    for node in pruned:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
            mod.body.append(node)
    yield from imported(mod)


def offenders(package: str, importer_folders: list[str]) -> list[str]:
    found = []
    for folder in importer_folders:
        for f in sorted((ROOT / folder).rglob("*.py")):
            for line, name in imported(ast.parse(f.read_text(), str(f))):
                if name == package or name.startswith(package + "."):
                    found.append(f"{f.relative_to(ROOT)}:{line} imports {name}")
    return found


@pytest.mark.parametrize("package", ["ctxcache.service", "ctxcache.bench"])
def test_only_the_package_itself_imports_it(package):
    others = [folder for name, folder in package_folders().items() if name != package]
    assert len(others) >= 6  # ctxcache, client, indexer, store, decoder and bench or service
    assert offenders(package, others) == []


def test_the_scan_sees_every_form_of_import():
    src = ("import ctxcache.service.cli\nfrom ctxcache.service import cli\nfrom ctxcache import service\n"
           "importlib.import_module('ctxcache.service.server')\nimport ctxcache.client\n")
    names = [name for _, name in imported(ast.parse(src))]
    assert sum(n.startswith("ctxcache.service") for n in names) == 4 and "ctxcache.client" in names


def test_no_service_module_reaches_into_another_objects_jobs_or_lock():
    """Issue 43: the servicer and the fleet read builds through BuildQueue.jobs() / job(), never
    through its private `_jobs` under its `_lock` (a change there would break them silently).
    The fleet's loops live in the indexer and the decoder now (issue 49), so those are read too."""
    found = []
    for f in sorted(p for room in ("service", "indexer", "decoder") for p in (ROOT / room).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Attribute) and node.attr in ("_jobs", "_lock") and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{f.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert found == []


# (importing room, rooms it must not import): the arrows service -> indexer -> store and
# service -> decoder <- store, read as what each room below the service may not reach
ROOMS_BELOW = {
    "indexer": ["ctxcache.decoder"],
    "decoder": ["ctxcache.indexer"],
    "store": ["ctxcache.indexer", "ctxcache.decoder"],
    "client": ["ctxcache.indexer", "ctxcache.decoder", "ctxcache.store"],
    "quality": ["ctxcache.indexer", "ctxcache.store"],  # measures the methods with the decoder's reference
}


@pytest.mark.parametrize("folder", sorted(ROOMS_BELOW))
def test_a_room_below_the_service_imports_no_room_beside_or_above_it(folder):
    assert folder in package_folders().values()
    assert [o for package in ROOMS_BELOW[folder] for o in offenders(package, [folder])] == []


def test_only_the_benchmarks_import_the_quality_measurements():
    readers = ("ctxcache.quality", "ctxcache.bench")
    others = [folder for name, folder in package_folders().items() if name not in readers]
    assert offenders("ctxcache.quality", others) == []


def test_the_core_imports_no_room():
    rooms = [name for name in package_folders() if name != "ctxcache"]
    found = [o for package in rooms for o in offenders(package, ["ctxcache"])]
    assert found == []


def module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports when it runs (a name
    imported from a module counts as that module; a package's `__init__` as the package)."""
    files: dict[str, Path] = {}
    for name, folder in package_folders().items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            files[".".join((name, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = f

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        tree = ast.parse(f.read_text(), str(f))
        names = [n for _, n in runtime_imported(tree)]
        package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):  # relative imports, should any appear
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                names += [f"{base}.{node.module}.{a.name}" if node.module else f"{base}.{a.name}" for a in node.names]
        graph[mod] = {m for m in map(module_of, names) if m and m != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next((w for w in it if w in graph), None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circle():
    assert cycles(module_graph()) == []


def test_the_cycle_check_finds_a_circle_and_skips_type_checking():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ctxcache.x\ndef f():\n    import ctxcache.y\n"
    assert [n for _, n in runtime_imported(ast.parse(src)) if n.startswith("ctxcache")] == ["ctxcache.y"]
