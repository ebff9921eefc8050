"""The layering README.md states, checked on the source (an AST scan of every package folder
setup.py maps): nothing but the service itself imports `ctxcache.service` (clients use
`ctxcache.client`; the benchmarks start a server process), and nothing imports `ctxcache.bench`
(the CLI finds it through the `ctxcache.commands` entry point). Tests may import both."""

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
    through its private `_jobs` under its `_lock` (a change there would break them silently)."""
    found = []
    for f in sorted((ROOT / "service").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Attribute) and node.attr in ("_jobs", "_lock") and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{f.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert found == []
