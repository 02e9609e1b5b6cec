"""Module paths stay true when files move: every module imports, no import cycle hides, every named module resolves.

A module named in a string (`python -m X`, `launch("X", …)`, a torchrun
entry point, a `monkeypatch.setattr("X.attr", …)` target) is not checked by
any import: a stale one fails only when that subprocess runs, often deep in a
slow end-to-end test. These checks read the source instead and fail in
seconds. Function-local imports count as edges of the import graph, so a
cycle cannot hide behind one.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "trainer_core", "infra")
NAMED_IN = ("flows", "tasks", "trainer_core", "infra", "tests", "bench")
"""Where module strings are looked for, and the top-level packages a string must start with to be checked."""

# `-m X` in code, docstrings and comments; `"-m", "X"` in argument lists; `launch("X"` / `launch_or_raise("X"`;
# torchrun's and each rank's entry module after the boot script; `*_MODULE = "X"` constants.
_MODULE_STRINGS = (
    re.compile(r"-m ([A-Za-z_][\w.]*)"),
    re.compile(r"""["']-m["'],\s*["']([A-Za-z_][\w.]*)["']"""),
    re.compile(r"""\blaunch(?:_or_raise)?\(\s*["']([A-Za-z_][\w.]*)["']"""),
    re.compile(r"""BOOT_SCRIPT\),\s*["']([A-Za-z_][\w.]*)["']"""),
    re.compile(r"""_MODULE\s*=\s*["']([A-Za-z_][\w.]*)["']"""),
)
_PATCH_TARGET = re.compile(r"""setattr\(\s*["']([A-Za-z_][\w.]*\.[A-Za-z_]\w*)["']""")


def _modules(packages=PACKAGES) -> dict[str, Path]:
    """Every module of `packages` by dotted name (a package by its own name)."""
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _source_files() -> list[Path]:
    files = [path for package in NAMED_IN for path in sorted((ROOT / package).rglob("*.py"))]
    return files + [path for path in (ROOT / ".ci" / "run",) if path.is_file()]


def _checked(name: str) -> bool:
    # `bench.NAME` in a usage line is a placeholder, not a module (module names are lower case).
    return name.split(".")[0] in NAMED_IN and not any(part.isupper() for part in name.split("."))


def test_every_module_imports():
    # A fresh interpreter: no module is already imported by another test, so each import is its own proof.
    # A package's `__main__` is the command itself (it runs on import): `find_spec` is its check.
    names = sorted(name for name in _modules() if not name.endswith(".__main__"))
    assert all(importlib.util.find_spec(name) for name in _modules() if name.endswith(".__main__"))
    script = (
        "import importlib, sys, traceback\nfailed = []\nfor name in sys.argv[1:]:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except BaseException:\n        failed.append(name + ': ' + traceback.format_exc(limit=2))\n"
        "print('\\n'.join(failed))\nsys.exit(1 if failed else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *names], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert len(names) > 100  # the walk found the code, not an empty folder


def _imported_by(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its body (function-local imports included).

    Imports under `if TYPE_CHECKING:` are left out: they never run, so they order no import at run time
    (an annotation naming a module that imports this one is not a cycle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
            edges.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {edge for edge in edges if edge in modules and edge != name}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


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
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # A package's __init__ re-exporting its submodules is not a cycle of the code: leave those edges out.
    return {
        name: {edge for edge in _imported_by(name, path, modules) if not name.startswith(edge + ".")}
        for name, path in modules.items()
    }


def test_the_cycle_finder_sees_a_function_local_cycle():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_an_import_only_for_annotations_is_not_an_edge_but_a_function_local_one_is(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\ndef f():\n    import a.c\n")
    assert _imported_by("a.m", module, {"a.b": module, "a.c": module}) == {"a.c"}


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    # The two former cycles, now layered: the dispatch imports both paths, which import only what they share.
    assert {"tasks.nodes.local", "tasks.nodes.work_pool"} <= graph["tasks.nodes"]
    assert "tasks.nodes" not in graph["tasks.nodes.work_pool"] | graph["tasks.nodes.local"]
    assert "trainer_core.model_config" in graph["trainer_core.model"] & graph["trainer_core.model_checks"]
    assert "trainer_core.model" not in graph["trainer_core.model_checks"]
    # Three more: the config checks its choices against torch-free names (trainer_core.registry_names) and asks
    # trainer_core.hub_ids, not the objectives or model_source; the planner imports the backward-mode registry,
    # not its own package (an edge to a module's package is left out of the graph above, so it is checked here).
    config_imports = graph["trainer_core.config"] | graph["trainer_core.config_train"]
    assert not {"trainer_core.objectives", "trainer_core.model_source"} & config_imports
    assert "trainer_core.training.memory" not in _imported_by(
        "trainer_core.training.memory.planner", ROOT / "trainer_core/training/memory/planner.py", _modules()
    )
    assert _cycles(graph) == []


def _named_modules() -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    for path in _source_files():
        text = path.read_text()
        for pattern in _MODULE_STRINGS:
            for found in pattern.finditer(text):
                line = text.count("\n", 0, found.start()) + 1
                named.setdefault(found[1].rstrip("."), []).append(f"{path.relative_to(ROOT)}:{line}")
    return {name: where for name, where in named.items() if _checked(name)}


def test_every_module_named_on_a_command_line_resolves():
    named = _named_modules()
    missing = {name: where for name, where in named.items() if importlib.util.find_spec(name) is None}
    assert missing == {}
    # The scan sees the strings that matter most: the rank entry points and the torchrun wrapper.
    entry_points = {
        "trainer_core.run.segment_main",
        "trainer_core.run.export_main",
        "infra.launch.loopback_torchrun",
        "flows.cli",
    }
    assert entry_points <= set(named)


def _resolves(target: str) -> bool:
    module, _, attribute = target.rpartition(".")
    while module:
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError:
            module, _, rest = module.rpartition(".")
            attribute = f"{rest}.{attribute}"
            continue
        for part in attribute.split("."):
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def test_every_monkeypatched_dotted_target_exists():
    targets: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        for found in _PATCH_TARGET.finditer(text):
            if found[1].split(".")[0] in NAMED_IN:
                line = text.count("\n", 0, found.start()) + 1
                targets.setdefault(found[1], []).append(f"{path.relative_to(ROOT)}:{line}")
    stale = {target: where for target, where in targets.items() if not _resolves(target)}
    assert stale == {}
    assert not _resolves("tasks.nodes.no_such_name") and _resolves("tasks.nodes.report_failure")


def _file_relative_paths() -> list[tuple[str, Path]]:
    """Every module-level `NAME = Path(__file__)…` under tests, bench and scripts, evaluated for its file (no import)."""
    found = []
    for top in ("tests", "bench", "scripts"):
        for file in sorted((ROOT / top).rglob("*.py")):
            for node in ast.parse(file.read_text()).body:
                if isinstance(node, ast.Assign) and "__file__" in ast.unparse(node.value):
                    value = eval(
                        compile(ast.Expression(node.value), str(file), "eval"), {"Path": Path, "__file__": str(file)}
                    )
                    if isinstance(value, Path):
                        found.append((f"{file.relative_to(ROOT)}: {ast.unparse(node.targets[0])}", value))
    return found


def test_every_path_a_test_derives_from_its_own_file_exists():
    # A file moved one folder deeper keeps `parents[2]` and silently points at tests/ instead of the repository.
    paths = _file_relative_paths()
    assert len(paths) >= 20
    assert [name for name, path in paths if not path.exists()] == []
    # A repository root must be the repository's, not a folder that happens to exist.
    roots = [(name, path) for name, path in paths if name.endswith(("ROOT", "REPO"))]
    assert len(roots) >= 8
    assert [name for name, path in roots if not (path / "pyproject.toml").is_file()] == []
