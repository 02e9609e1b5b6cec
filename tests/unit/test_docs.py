"""The docs cannot drift: the configuration reference is the script's output, and every link resolves.

- docs/configuration.md is what scripts/config_reference.py prints from the
  pydantic models (so every config field needs a docstring);
- every docs/*.md the README links to exists, and every doc is linked from it;
- every relative link in README.md and docs/*.md names a file that exists,
  and a `#anchor` names a heading of that file (GitHub's anchors);
- every repository file a doc names (`infra/lease.py`) exists, and every
  `python -m MODULE` it shows names a module that can be found;
- no doc names an absolute path of a development machine (/work/..., /tmp/...).
"""

from __future__ import annotations

import importlib.util
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
REGENERATE = "python scripts/config_reference.py > docs/configuration.md"

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# An absolute path of this machine, not a path that merely ends in .../work (such as /var/lib/rankflow/work).
# A file of this repository named in prose or code (folders are left out: the layout table names packages).
_REPO_FILE = re.compile(
    r"(?<![\w/.-])((?:flows|tasks|trainer_core|infra|tests|bench|examples|scripts|docs|\.ci)/"
    r"[\w./*-]*\.(?:py|toml|md|json|jsonl|yaml|png|txt))\b"
)
_PYTHON_MODULE = re.compile(r"python -m ([\w.]+)")
_MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|tmp)(?=/|\b)")


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose_lines(path: Path) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a bash block is no heading)."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces as -, repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(path):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading[1].lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    return [target for line in _prose_lines(path) for target in _LINK.findall(line)]


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: are not files here


def test_the_configuration_reference_is_the_scripts_output():
    committed = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert committed == _config_reference().render(), f"docs/configuration.md is stale; run: {REGENERATE}"


def test_every_config_field_has_a_docstring():
    from pydantic import BaseModel

    from trainer_core.config import RunConfig

    missing = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                missing.append(f"{prefix}{name}")
            for member in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(member, type) and issubclass(member, BaseModel):
                    walk(member, f"{prefix}{name}.")

    walk(RunConfig, "")
    sections = set(RunConfig.model_fields)
    assert not [key for key in missing if key not in sections], (
        f"config fields without a docstring (the reference's meaning column): {missing}; "
        f"add one under each field in trainer_core/config.py, then run: {REGENERATE}"
    )


def test_the_reference_names_every_choice_of_a_literal_field():
    from trainer_core.config import TrainSection

    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `train.backward_mode` |"))
    for choice in typing.get_args(TrainSection.model_fields["backward_mode"].annotation):
        assert f"`{choice}`" in row


def test_every_doc_the_readme_links_exists_and_every_doc_is_linked():
    linked = {target.split("#")[0] for target in _links(ROOT / "README.md") if target.startswith("docs/")}
    manuals = {name for name in linked if name.endswith(".md")}
    assert manuals, "the README links no docs/*.md"
    assert [name for name in sorted(manuals) if not (ROOT / name).is_file()] == []
    unlinked = [f"docs/{page.name}" for page in sorted(DOCS.glob("*.md")) if f"docs/{page.name}" not in manuals]
    assert unlinked == [], f"docs not linked from the README's front page: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in _links(page):
        if not _relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_file_and_module_a_doc_names_exists(page: Path):
    text = page.read_text(encoding="utf-8")
    named = set(_REPO_FILE.findall(text))
    missing_files = sorted(
        name for name in named if not (_glob_matches(name) if "*" in name else (ROOT / name).exists())
    )
    missing_modules = sorted(module for module in set(_PYTHON_MODULE.findall(text)) if not _module_exists(module))
    assert (missing_files, missing_modules) == ([], []), (
        f"{page.relative_to(ROOT)} names files or `python -m` modules that do not exist (moved? update the doc): "
        f"{missing_files + missing_modules}"
    )


def _glob_matches(pattern: str) -> bool:
    return any(ROOT.glob(pattern))


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_no_doc_names_an_absolute_path_of_this_machine(page: Path):
    found = [
        f"{page.name}:{number}: {line.strip()}"
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if _MACHINE_PATH.search(line)
    ]
    assert found == [], found


def test_the_link_and_path_checks_catch_what_they_are_for(tmp_path):
    # The checks above would pass on anything if their patterns matched nothing.
    page = tmp_path / "page.md"
    page.write_text(
        "# A title: with `code`, punctuation\n\n```bash\n# not a heading\n[x](nowhere.md)\n```\n"
        "[ok](#a-title-with-code-punctuation) [gone](missing.md) [web](https://example.com/x)\n"
        "see /work/main/x and /tmp/y, not /var/lib/rankflow/work\n",
        encoding="utf-8",
    )
    assert _anchors(page) == {"a-title-with-code-punctuation"}
    assert _links(page) == ["#a-title-with-code-punctuation", "missing.md", "https://example.com/x"]
    assert [_relative(target) for target in _links(page)] == [True, True, False]
    assert len(_MACHINE_PATH.findall(page.read_text())) == 2
    assert _REPO_FILE.findall("see `infra/lease.py`, tests/storage/test_run_state_*.py and infra/store/") == [
        "infra/lease.py",
        "tests/storage/test_run_state_*.py",
    ]
    assert _module_exists("bench.packing") and not _module_exists("bench.no_such_benchmark")
    assert not _module_exists("no_such_package.module")
