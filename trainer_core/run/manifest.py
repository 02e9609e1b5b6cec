"""MANIFEST.json: every file of a checkpoint with its size and sha256, and its provenance.

The manifest is the checkpoint's commit record: it is written last when staging
and uploaded last when committing, so a checkpoint without a manifest that
verifies is, by definition, not there.

Format `rankflow-checkpoint/2` (written here) adds provenance to version 1:
`run_id`, `step`, `plan_digest`, `parent_checkpoint` (the checkpoint the
weights were trained from, or null for the run's first), `world_size` and
`logical_dp`. Readers accept both versions. The file list is generic: whatever
the export staged (full weights, adapters, heads, tokenizer) is listed the same
way.

The format is written once, here: `CheckpointManifest` and its `FileEntry`
are what the writer serializes and what every reader (the staged verify below,
infra/publication/manifests.py for the store, the export task) validates. A manifest is
trusted only once `parse_manifest` accepts it: a known format version (every
earlier one stays readable), the run and step it is stored under, and file
paths that stay inside their checkpoint (no `..`, no absolute path, no empty or
odd segment) — a hostile manifest can neither make a reader write outside its
destination nor make a commit upload a host file. Every refusal is a
`ManifestError` naming where the manifest was and why.

This module stays free of torch (infra and the CLI import it): the file helpers
of `.files` are imported where they are used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

MANIFEST_FILE = "MANIFEST.json"
FORMAT_V1 = "rankflow-checkpoint/1"
FORMAT_V2 = "rankflow-checkpoint/2"
MANIFEST_FORMAT = FORMAT_V2
"""The format this writer writes."""
SUPPORTED_FORMATS = (FORMAT_V1, FORMAT_V2)
"""Every manifest format the readers accept, oldest first."""
MAX_MANIFEST_BYTES = 16 * 2**20
"""The most bytes a manifest (a checkpoint's, a run-state bundle's) may take: ~80,000 files, where a real one lists
a few hundred. A larger one is refused by its size before it is read (parsing takes ~5x its size in memory)."""

_NAME = re.compile(r"^step-(\d{8,})$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._+@=-][A-Za-z0-9._+@= -]*$")


class ManifestError(ValueError):
    """A manifest that must not be trusted; the message says which and why."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint name `step-NNNNNNNN`, or None for any other name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def _safe_relative_path(path: str) -> str:
    """`path` if it names a file inside its checkpoint (or bundle); ValueError saying why otherwise."""
    if not path:
        raise ValueError(f"file path {path!r} is not a non-empty string")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise ValueError(f"file path {path!r} is absolute or not a POSIX relative path; refusing it")
    for segment in path.split("/"):
        if segment in ("", ".", "..") or not _SEGMENT.match(segment):
            raise ValueError(
                f"file path {path!r} leaves its checkpoint or has an odd segment ({segment!r}); refusing the manifest"
            )
    if path == MANIFEST_FILE:
        raise ValueError("the manifest lists itself")
    return path


SafeRelativePath = Annotated[str, AfterValidator(_safe_relative_path)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class FileEntry(BaseModel):
    """One listed file: its path relative to the checkpoint (or the run directory, for a bundle), size, sha256."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    path: SafeRelativePath
    size: int = Field(ge=0)
    sha256: Sha256


def _distinct_paths(files: list[FileEntry]) -> list[FileEntry]:
    """No path twice, and none both a file and a directory (`a` and `a/b`)."""
    seen: set[str] = set()
    for entry in files:
        path = entry.path
        if path in seen or any(other.startswith(path + "/") or path.startswith(other + "/") for other in seen):
            raise ValueError(f"{path} is listed twice or is both a file and a directory")
        seen.add(path)
    return files


FileList = Annotated[list[FileEntry], AfterValidator(_distinct_paths)]


class CheckpointManifest(BaseModel):
    """A checkpoint's manifest, checked; its provenance keys (`plan_digest`, `world_size`, …) ride as extras.

    Validated with `context={"run_id": …, "step": …}`, it also checks it is
    stored where it says it belongs (either may be None: not checked). The
    fields are declared in the order the checks report: the first refusal is
    the one a reader would meet first.
    """

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    format: Literal["rankflow-checkpoint/1", "rankflow-checkpoint/2"]
    step: int = Field(ge=0)
    run_id: str | None = Field(default=None, validate_default=True)
    files: FileList

    @field_validator("step")
    @classmethod
    def _stored_as_step(cls, step: int, info: ValidationInfo) -> int:
        stored = (info.context or {}).get("step")
        if stored is not None and step != stored:
            raise ValueError(f"manifest of step {step} stored as step {stored}; refusing it")
        return step

    @field_validator("run_id")
    @classmethod
    def _stored_under_run(cls, run_id: str | None, info: ValidationInfo) -> str | None:
        stored = (info.context or {}).get("run_id")
        if stored is not None and run_id is not None and run_id != stored:
            raise ValueError(f"manifest of run {run_id!r} stored under run {stored!r}; refusing it")
        if info.data.get("format") == FORMAT_V2 and run_id is None:
            raise ValueError(f"a {FORMAT_V2} manifest must name its run_id")
        return run_id

    @property
    def raw(self) -> dict[str, Any]:
        """The manifest as stored (the keys it had, provenance included)."""
        return self.model_dump(exclude_unset=True)

    @property
    def num_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    @property
    def provenance(self) -> dict[str, Any]:
        return {key: value for key, value in self.raw.items() if key != "files"}

    def to_json(self) -> str:
        # The bytes of every manifest written before this model: publications compare them and journal their sha256.
        return json.dumps(self.model_dump(exclude_unset=True), indent=2, sort_keys=True)


Problems = dict[str, Callable[[object], str]]
"""How a record's readers word a wrong or missing field (by field name; "" for a record that is not an object)."""

MANIFEST_PROBLEMS: Problems = {
    "": lambda value: "not a JSON object",
    "format": lambda value: (
        f"unknown format {value!r}; this reader knows {', '.join(SUPPORTED_FORMATS)} "
        "(a newer rankflow wrote it? upgrade to read it)"
    ),
    "step": lambda value: f"step {value!r} is not a non-negative integer",
    "run_id": lambda value: f"run_id {value!r} is not a string",
    "files": lambda value: "'files' is not a list",
}
_ENTRY_PROBLEMS = {
    "path": lambda path, value: f"file path {value!r} is not a non-empty string",
    "size": lambda path, value: f"{path}: size {value!r} is not a non-negative integer",
    "sha256": lambda path, value: f"{path}: sha256 {value!r} is not 64 lowercase hex digits",
}


def refusal(error: ValidationError, raw: object, where: str, problems: Problems = MANIFEST_PROBLEMS) -> ManifestError:
    """The ManifestError for the first problem pydantic found in `raw` (a record's decoded JSON), worded as the
    readers always have: a validator's own message, else `problems`' for a top-level field, else the file entry's."""
    first = error.errors()[0]
    loc, kind = tuple(first["loc"]), first["type"]
    value = None if kind == "missing" else first.get("input")
    if kind == "value_error":  # a validator's ValueError: its message says it all
        return ManifestError(f"{where}: {first.get('ctx', {}).get('error')}")
    field = str(loc[0]) if loc else ""
    if len(loc) <= 1 and field in problems:
        return ManifestError(f"{where}: {problems[field](value)}")
    if field == "files" and len(loc) == 2:
        return ManifestError(f"{where}: files[{loc[1]}] is not an object")
    if field == "files" and len(loc) == 3 and str(loc[2]) in _ENTRY_PROBLEMS:
        entry = raw["files"][loc[1]] if isinstance(raw, dict) else {}
        return ManifestError(f"{where}: {_ENTRY_PROBLEMS[str(loc[2])](entry.get('path'), value)}")
    if field == "files" and len(loc) == 3:
        return ManifestError(f"{where}: files[{loc[1]}] has an unknown key {loc[2]!r}")
    return ManifestError(f"{where}: {'.'.join(map(str, loc))}: {first['msg']}")


def decode(data: bytes, where: str) -> object:
    """A stored record's JSON (NaN and Infinity read as json.dumps wrote them); ManifestError if it is not JSON."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise ManifestError(f"{where}: not valid JSON ({error})") from None


def parse_manifest(
    data: bytes, where: str, *, run_id: str | None = None, step: int | None = None
) -> CheckpointManifest:
    """Validate a manifest's bytes; `run_id`/`step` are where it was found (checked when given)."""
    raw = decode(data, where)
    try:
        return CheckpointManifest.model_validate(raw, context={"run_id": run_id, "step": step})
    except ValidationError as error:
        raise refusal(error, raw, where) from None


def staged_files(directory: Path) -> list[Path]:
    """The files of a staged checkpoint (all but the manifest), in a stable order."""
    return [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE]


def file_entry(directory: Path, path: Path) -> FileEntry:
    from trainer_core.files import sha256_file

    return FileEntry(path=path.relative_to(directory).as_posix(), size=path.stat().st_size, sha256=sha256_file(path))


def manifest_of(entries: list[FileEntry], extra: dict | None = None) -> CheckpointManifest:
    """The manifest of `entries` with provenance `extra` (run_id, step, …); ManifestError if a reader would refuse it."""
    raw = {"format": MANIFEST_FORMAT, "files": sorted(entries, key=lambda e: e.path), **(extra or {})}
    try:
        return CheckpointManifest.model_validate(raw)
    except ValidationError as error:
        raise refusal(error, raw, "manifest to write") from None


def write_checkpoint_manifest(directory: Path, manifest: CheckpointManifest) -> dict:
    from trainer_core.files import write_text_atomic

    write_text_atomic(directory / MANIFEST_FILE, manifest.to_json())
    return manifest.raw


def write_manifest(directory: Path, extra: dict | None = None) -> dict:
    """List every staged file of `directory` in its MANIFEST.json (written last); the manifest as written."""
    entries = [file_entry(directory, p) for p in staged_files(directory)]
    return write_checkpoint_manifest(directory, manifest_of(entries, extra))


def verify_staged(directory: Path) -> dict | None:
    """The manifest if it parses and every listed file is present with its size and digest, else None."""
    from trainer_core.files import sha256_file

    path = directory / MANIFEST_FILE
    if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
        return None
    try:
        manifest = parse_manifest(path.read_bytes(), str(path))
    except ManifestError:
        return None
    root = directory.resolve()
    for entry in manifest.files:
        file = directory / entry.path
        if root not in file.resolve().parents:
            return None  # a link that leaves the staging is never "verified"
        if not file.is_file() or file.stat().st_size != entry.size or sha256_file(file) != entry.sha256:
            return None
    return manifest.raw
