"""`model.path` naming a checkpoint rankflow committed: resolved, verified, fetched, and named as the run's parent.

`model.path` may be a committed checkpoint's URL (`s3://bucket/prefix/RUN/checkpoints/step-N`, or the local
store's `/path/store/RUN/checkpoints/step-N`) or `RUN@latest` / `RUN@step-N` in the run's own store. Before
planning, the checkpoint is downloaded into `run.work_dir/cache/parents/RUN/step-N` with every file's size and
sha256 checked against its manifest (`checkpoints.download_checkpoint`), and `model.path` becomes that directory.
A copy already there is used again only if its manifest is the store's and every file still hashes to it.

The parent is written beside the files (`PARENT_FILE`): the plan's input fingerprint takes the manifest's sha256
from it (so the run id names the exact weights, trainer_core/run/validate.py), and the ledger's plan line
records it. A plain local model directory is left as it is.

The resolving and the verified fetch (`checkpoint_source`, `fetch_checkpoint`) serve any reader of a committed
checkpoint by reference: `rankflow eval` uses them too (flows/cli/eval.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.publication.checkpoints import download_checkpoint, resolve_latest
from infra.publication.latest import manifest_exists
from infra.publication.manifests import (
    MANIFEST_FILE,
    ManifestError,
    checkpoint_key,
    checkpoint_name,
    parse_manifest,
    read_capped,
    step_of,
)
from infra.store import open_store
from infra.store.base import ObjectStore, StorageSettings
from infra.store.verified import StoredObjectCorrupt, local_copy_matches
from trainer_core.config import RunConfig
from trainer_core.errors import BadInputError, ConfigError
from trainer_core.model_source import resolve_hub_model
from trainer_core.run.parent_record import PARENT_FILE
from trainer_core.storage_url import check_local_store

from .parent_adapter import continue_adapter

_RUN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_URL = re.compile(rf"^(?P<store>.+)/(?P<run>{_RUN})/checkpoints/(?P<name>step-\d+)/?$")
_REFERENCE = re.compile(rf"^(?P<run>{_RUN})@(?P<which>latest|step-\d+)$")


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint as fetched: where the store keeps it, and its manifest's sha256 (which pins every
    file's bytes). Written beside a parent's files as `PARENT_FILE`."""

    url: str
    run_id: str
    checkpoint: str
    manifest_sha256: str


@dataclass(frozen=True)
class CheckpointSource:
    """Where a committed checkpoint named by reference lives."""

    store_url: str | None
    """The store: the URL's own, or for `RUN@…` the store given with it (None: none was given)."""
    run_id: str
    name: str | None
    """The checkpoint (step-NNNNNNNN), or None for the run's LATEST."""


def checkpoint_source(reference: str, store_url: str | None) -> CheckpointSource | None:
    """Where `reference` points: a checkpoint URL (its store is the URL's), or `RUN@latest` / `RUN@step-N` in
    `store_url`; None where it has neither form."""
    named = _REFERENCE.match(reference)
    if named is not None:
        which = named["which"]
        # step-10 and step-00000010 name one checkpoint (stored under the zero-padded name)
        name = None if which == "latest" else checkpoint_name(int(which.removeprefix("step-")))
        return CheckpointSource(store_url, named["run"], name)
    url = _URL.match(reference.removeprefix("file://"))
    if url is None:
        return None
    return CheckpointSource(url["store"], url["run"], url["name"])


def _source(config: RunConfig) -> CheckpointSource | None:
    """Where model.path names a committed checkpoint; else None (a plain local model directory)."""
    path = config.model.path
    if path is None:
        return None
    source = checkpoint_source(path, config.storage.url)
    if source is not None and _REFERENCE.match(path) is None and "://" not in path:
        if not (Path(path) / MANIFEST_FILE).is_file():
            return None  # a local directory shaped like a checkpoint, but no committed one: an ordinary model directory
    return source


def resolve_parent(config: RunConfig, created: Created | None = None) -> CommittedCheckpoint | None:
    """Fetch the checkpoint `model.path` names (verified) and point `model.path` at the local copy.

    Raises ConfigError (exit 2, nothing trained) for a reference that names nothing usable; a checkpoint that does
    not verify in its store raises CheckpointNotVerified and a store that does not answer its OSError (both
    OSErrors: exit 1, not bad input).
    """
    resolve_hub_model(config)  # a hub model id: its snapshot in the Hugging Face cache (downloaded when online)
    source = _source(config)
    if source is None:
        return None
    if _REFERENCE.match(config.model.path or "") is None:  # a URL: its store may be a local path
        check_local_store(config.model.path or "", "model.path")
    store = open_source_store(source, config.storage)  # RUN@… is in the run's own store
    label = f"model.path={config.model.path!r}"  # a source was found, so model.path is set
    parent, dest = fetch_checkpoint(
        store,
        source,
        Path(config.run.work_dir) / "cache" / "parents",
        label,
        fix="point it at a committed checkpoint",
        created=created,
    )
    (dest / PARENT_FILE).write_text(json.dumps(asdict(parent), indent=1))
    if (dest / "adapter_config.json").is_file() and not (dest / "config.json").is_file():
        continue_adapter(config, dest, label)
        return parent
    config.model.path = str(dest)
    return parent


class CheckpointNotVerified(OSError):
    """A committed checkpoint that is in its store but does not verify there (a file or its manifest is damaged).

    The store's fault, not the user's input, for every reader: `rankflow run` with `model.path` naming it exits 1
    (nothing trained), as `rankflow eval` and `rankflow checkpoints pull` do. An OSError like `StoredObjectCorrupt`
    (a storage failure, `storage_outage`; a damaged store fails every try the same way, naming the file), never
    bad input (`bad_input`: fix the config). `undone_if_refused` removes what the fetch made, as for bad input."""


Created = list[tuple[Path, bool]]
"""What a fetch created, outermost first: (a directory, whether it is a download of its own)."""


@contextmanager
def undone_if_refused() -> Iterator[Created]:
    """A list for `fetch_checkpoint(created=)`: a command refused as bad input (a LoRA rank that differs, an empty
    data file), or by the fetch (a checkpoint that does not verify: `CheckpointNotVerified`), leaves nothing of it. Its own downloads are
    removed, and the directories it made are removed when empty: never a directory it did not make, nor one that
    another process filled meanwhile (a copy cached earlier stays)."""
    created: Created = []
    try:
        yield created
    except (BadInputError, CheckpointNotVerified):  # a checkpoint that does not verify leaves nothing either
        undo(created)
        raise


def undo(created: Created) -> None:
    """Remove what a fetch created (`undone_if_refused`): its own downloads, and the directories it made when empty."""
    for path, download in reversed(created):
        if download:
            shutil.rmtree(path, ignore_errors=True)
        else:
            with suppress(OSError):
                path.rmdir()  # only when empty
    created.clear()


def missing_directories(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, outermost first."""
    missing: list[Path] = []
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        missing.append(candidate)
    return missing[::-1]


def open_source_store(source: CheckpointSource, storage: StorageSettings | str) -> ObjectStore:
    """The store `source` is in: opened with `storage` (its credentials and options) where that is the same store,
    by the source's own URL otherwise."""
    assert source.store_url is not None, "RUN@… names no store of its own: the caller gives one"
    url = storage if isinstance(storage, str) else storage.url
    return open_store(storage if source.store_url.rstrip("/") == url.rstrip("/") else source.store_url)


def fetch_checkpoint(
    store: ObjectStore,
    source: CheckpointSource,
    cache_root: Path,
    label: str,
    *,
    fix: str,
    created: Created | None = None,
) -> tuple[CommittedCheckpoint, Path]:
    """The checkpoint `source` names (LATEST resolved), downloaded verified into `cache_root/RUN/NAME`: what it is
    and where. A copy already there is used again only if its manifest is the store's and every file still hashes
    to it. What it creates is recorded in `created` (see `undone_if_refused`).

    A reference that names no committed checkpoint raises ConfigError, one that does not verify (a file that does
    not match the manifest, a manifest refused, or for LATEST no checkpoint of the run that verifies)
    CheckpointNotVerified (`label`: the input as the message names it; `fix`: what to do about a checkpoint that
    does not verify); a store that does not answer raises its OSError.
    """
    run_id, name = source.run_id, source.name
    if name is None:
        resolution = resolve_latest(store, run_id)
        name = resolution.checkpoint
        # Committed checkpoints (a manifest there), none of which verifies: the store is damaged.
        damaged = [r for r in resolution.reports if manifest_exists(store, run_id, r.step)]
        if name is None and damaged:
            problems = "; ".join(f"{r.name}: {r.problems[0]}" for r in damaged[-2:])
            raise CheckpointNotVerified(
                f"{label}: no committed checkpoint of run {run_id} verifies in {store.url} ({problems}); nothing "
                f"was read from them: {fix} (rankflow checkpoints verify {run_id} --store URL names what fails)"
            )
        if name is None:
            raise ConfigError(
                f"{label}: run {run_id} has no committed checkpoint that verifies in {store.url}; "
                "name a run that has one (rankflow checkpoints runs lists them), or a checkpoint URL"
            )
    dest = cache_root / run_id / name
    manifest = _stored_manifest(store, run_id, name, label)
    if not _cached(dest, manifest):
        if created is not None:
            created.extend((directory, False) for directory in missing_directories(dest.parent))
            created.append((dest, True))
        shutil.rmtree(dest, ignore_errors=True)
        try:
            download_checkpoint(store, run_id, name, dest)
        except ManifestError as error:
            raise CheckpointNotVerified(f"{label}: {error}; {fix}") from None
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(f"{label}: {error}; {fix}") from None
        except StoredObjectCorrupt as corrupt:  # the verified download refused the bytes
            raise CheckpointNotVerified(
                f"{label} does not verify: {corrupt}; nothing was read from it: {fix} "
                f"(rankflow checkpoints verify {run_id} {step_of(name)} --store URL checks one)"
            ) from None
    fetched = CommittedCheckpoint(
        url=store.url_of(run_id, "checkpoints", name),
        run_id=run_id,
        checkpoint=name,
        manifest_sha256=hashlib.sha256(manifest).hexdigest(),
    )
    return fetched, dest


def _stored_manifest(store: ObjectStore, run_id: str, name: str, label: str) -> bytes:
    key = checkpoint_key(run_id, name, MANIFEST_FILE)
    try:
        stored = read_capped(store, key, store.url_of(key))
    except ManifestError as refused:  # one too large to be a manifest: refused unread
        raise CheckpointNotVerified(f"{label}: {refused}") from None
    if stored is None:
        raise ConfigError(
            f"{label}: checkpoint {name} of run {run_id} is not committed in {store.url} (no "
            f"{MANIFEST_FILE}); name a committed checkpoint (rankflow checkpoints list {run_id})"
        )
    return stored


def _cached(dest: Path, manifest: bytes) -> bool:
    """Whether `dest` holds this manifest's checkpoint, every file still of its size and sha256."""
    cached = dest / MANIFEST_FILE
    if not cached.is_file() or cached.stat().st_size != len(manifest) or cached.read_bytes() != manifest:
        return False
    try:
        entries = parse_manifest(manifest, str(dest / MANIFEST_FILE)).files
    except (ManifestError, ValueError):
        return False
    return all(local_copy_matches(dest / entry.path, entry) for entry in entries)  # a symlink never matches
