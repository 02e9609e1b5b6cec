"""Install metadata: `pip install` warns nothing, and every third-party module the code imports is declared.

The references are pip itself (resolving this pyproject.toml against the
installed environment, offline) and the installed distributions' own
metadata (which distribution provides each imported top-level module).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "trainer_core", "infra")


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(line) for line in project["dependencies"]]


def _importers() -> dict[str, set[Path]]:
    """Each third-party top-level module the code imports, and the files that import it."""
    found: dict[str, set[Path]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module.split(".")[0]]
                else:
                    continue
                for name in names:
                    found.setdefault(name, set()).add(path)
    for module in set(found) & (set(PACKAGES) | set(sys.stdlib_module_names)):
        del found[module]
    return found


def _imported_top_level_modules() -> set[str]:
    return set(_importers())


def _optional() -> set[str]:
    """The distributions the user-facing extras install (not dev's or bench's tools)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {
        canonicalize_name(Requirement(line).name)
        for name, lines in extras.items()
        if name not in ("dev", "bench")
        for line in lines
    }


def _backend_modules() -> set[Path]:
    """The tracking backends' modules: imported only when a run asks for that backend (infra/tracking/registry.py)."""
    from infra.tracking import BACKENDS

    return {ROOT / "infra" / "tracking" / f"{entry.module}.py" for entry in BACKENDS.values()}


def test_every_extra_asked_for_exists_in_the_installed_distribution():
    for requirement in _declared():
        provided = {canonicalize_name(e) for e in metadata.metadata(requirement.name).get_all("Provides-Extra") or []}
        missing = {canonicalize_name(e) for e in requirement.extras} - provided
        assert not missing, f"{requirement}: {requirement.name} has no extra {sorted(missing)}"


def test_every_third_party_module_the_code_imports_is_a_declared_dependency():
    """A dependency, or an extra's where only a lazily imported backend module imports it (the package imports
    without the extra: `rankflow run` names the extra to install instead, flows/cli/run.py)."""
    declared = {canonicalize_name(r.name) for r in _declared()}
    optional, backends = _optional(), _backend_modules()
    providers = metadata.packages_distributions()
    undeclared = {}
    for module, importers in sorted(_importers().items()):
        distributions = {canonicalize_name(d) for d in providers.get(module, [])}
        assert distributions, f"no installed distribution provides the imported module {module!r}"
        if distributions & declared:
            continue
        if distributions & optional and importers <= backends:
            continue
        undeclared[module] = sorted(distributions)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


# A whole `pip` program resolving the project (30-40 s of its own): the e2e tier, not the unit one.
@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("pip", path=str(Path(sys.executable).parent)) is None, reason="no pip in this venv")
def test_pip_resolves_the_project_offline_without_a_warning_and_pip_check_is_clean(tmp_path):
    # Metadata only: the project file and its readme, built without isolation, resolved against what is installed.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    resolved = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            "--disable-pip-version-check",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    output = resolved.stdout + resolved.stderr
    assert resolved.returncode == 0, output[-3000:]
    assert "WARNING" not in output, [line for line in output.splitlines() if "WARNING" in line]
    checked = subprocess.run(
        [sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
