"""The store package's seam: its files import one another without a cycle, and its schemes are the registry's.

An import cycle among infra/store's files (a function-local import counts: it
is a cycle the first call closes) once tied eleven of them together through a
re-export of `open_store`; the config's storage.url schemes are the registry's
names (trainer_core/registry_names.py), so a backend is never half-registered.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from infra.store import BACKENDS
from trainer_core.registry_names import STORE_SCHEMES
from trainer_core.storage_url import check_storage_url

STORE_DIR = Path(__file__).resolve().parents[2] / "infra" / "store"


def _module_name(path: Path) -> str:
    return "infra.store" if path.stem == "__init__" else f"infra.store.{path.stem}"


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The infra/store modules `path` imports at run time, function-local imports included (TYPE_CHECKING not)."""
    tree = ast.parse(path.read_text())
    checker_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in checker_only:
            continue
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative to the package infra.store
                target = ".".join(["infra.store", *([node.module] if node.module else [])])
            candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in candidates if name in modules}
    return found - {_module_name(path)}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order), or None when there is none."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)) is not None:
                return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_the_store_files_import_one_another_without_a_cycle():
    paths = sorted(STORE_DIR.glob("*.py"))
    modules = {_module_name(path) for path in paths}
    graph = {_module_name(path): _imported(path, modules) for path in paths}
    assert graph["infra.store"] >= {"infra.store.base", "infra.store.local", "infra.store.s3"}  # the reader sees
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_a_function_local_import_is_an_edge_and_a_checker_only_one_is_not(tmp_path):
    (tmp_path / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .local import LocalStore\n"
        "def open_store():\n    from . import open_store\n"
    )
    modules = {"infra.store", "infra.store.base", "infra.store.local"}
    assert _imported(tmp_path / "base.py", modules) == {"infra.store"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_config_accepts_exactly_the_registered_store_schemes():
    assert tuple(BACKENDS) == STORE_SCHEMES
    for scheme in STORE_SCHEMES:
        assert check_storage_url(f"{scheme}://rankflow/runs") == f"{scheme}://rankflow/runs"
    with pytest.raises(ValueError, match=r"storage\.url='gs://rankflow/runs': unsupported scheme 'gs'"):
        check_storage_url("gs://rankflow/runs")
