"""`model.path` naming a checkpoint rankflow committed: resolved, verified, fetched, and named as the run's parent.

`model.path` may be a committed checkpoint's URL (`s3://bucket/prefix/RUN/checkpoints/step-N`, or the local
store's `/path/store/RUN/checkpoints/step-N`) or `RUN@latest` / `RUN@step-N` in the run's own store. Before
planning, the checkpoint is downloaded into `run.work_dir/cache/parents/RUN/step-N` with every file's size and
sha256 checked against its manifest (`checkpoints.download_checkpoint`), and `model.path` becomes that directory.
A copy already there is used again only if its manifest is the store's and every file still hashes to it.

The parent is written beside the files (`PARENT_FILE`): the plan's input fingerprint takes the manifest's sha256
from it (so the run id names the exact weights, trainer_core/run/validate.py), and the ledger's plan line
records it. A plain local model directory is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.publication.checkpoints import download_checkpoint, resolve_latest
from infra.publication.manifests import MANIFEST_FILE, ManifestError, checkpoint_key, checkpoint_name, parse_manifest
from infra.store.base import open_store
from infra.store.verified import local_copy_matches
from trainer_core.config import RunConfig
from trainer_core.errors import ConfigError
from trainer_core.run.validate import PARENT_FILE

_RUN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_URL = re.compile(rf"^(?P<store>.+)/(?P<run>{_RUN})/checkpoints/(?P<name>step-\d+)/?$")
_REFERENCE = re.compile(rf"^(?P<run>{_RUN})@(?P<which>latest|step-\d+)$")


@dataclass(frozen=True)
class ParentCheckpoint:
    url: str
    run_id: str
    checkpoint: str
    manifest_sha256: str


def _source(config: RunConfig) -> tuple[str, str, str | None] | None:
    """(store URL, run id, checkpoint name or None for LATEST) where model.path names a checkpoint; else None."""
    path = config.model.path
    if path is None:
        return None
    reference = _REFERENCE.match(path)
    if reference is not None:
        which = reference["which"]
        # step-10 and step-00000010 name one checkpoint (stored under the zero-padded name)
        name = None if which == "latest" else checkpoint_name(int(which.removeprefix("step-")))
        return config.storage.url, reference["run"], name
    url = _URL.match(path.removeprefix("file://"))
    if url is None:
        return None
    if "://" not in path and not (Path(path) / MANIFEST_FILE).is_file():
        return None  # a local directory shaped like a checkpoint, but no committed one: an ordinary model directory
    return url["store"], url["run"], url["name"]


def resolve_parent(config: RunConfig) -> ParentCheckpoint | None:
    """Fetch the checkpoint `model.path` names (verified) and point `model.path` at the local copy.

    Raises ConfigError (exit 2, nothing trained) for a reference that names nothing usable; a store that does
    not answer raises its OSError (an outage: run the same command again).
    """
    source = _source(config)
    if source is None:
        return None
    store_url, run_id, name = source
    same_store = store_url.rstrip("/") == config.storage.url.rstrip("/")
    store = open_store(config.storage if same_store else store_url)
    given = config.model.path or ""  # a source was found, so model.path is set
    if name is None:
        name = resolve_latest(store, run_id).checkpoint
        if name is None:
            raise ConfigError(
                f"model.path={given!r}: run {run_id} has no committed checkpoint that verifies in {store.url}; "
                "name a run that has one (rankflow checkpoints runs lists them), or a checkpoint URL"
            )
    dest = Path(config.run.work_dir) / "cache" / "parents" / run_id / name
    manifest = _stored_manifest(store, run_id, name, given)
    if not _cached(dest, manifest):
        shutil.rmtree(dest, ignore_errors=True)
        try:
            download_checkpoint(store, run_id, name, dest)
        except (FileNotFoundError, ManifestError, ValueError) as error:
            raise ConfigError(f"model.path={given!r}: {error}; point it at a committed checkpoint") from None
    if (dest / "adapter_config.json").is_file() and not (dest / "config.json").is_file():
        raise ConfigError(
            f"model.path={given!r} is a LoRA adapter checkpoint; continuing an adapter is not supported yet: set "
            "model.path to its base model and [model.lora] to train a new adapter, or name a full checkpoint"
        )
    parent = ParentCheckpoint(
        url=store.url_of(run_id, "checkpoints", name),
        run_id=run_id,
        checkpoint=name,
        manifest_sha256=hashlib.sha256(manifest).hexdigest(),
    )
    (dest / PARENT_FILE).write_text(json.dumps(asdict(parent), indent=1))
    config.model.path = str(dest)
    return parent


def _stored_manifest(store, run_id: str, name: str, given: str) -> bytes:
    stored = store.get(checkpoint_key(run_id, name, MANIFEST_FILE))
    if stored is None:
        raise ConfigError(
            f"model.path={given!r}: checkpoint {name} of run {run_id} is not committed in {store.url} (no "
            f"{MANIFEST_FILE}); name a committed checkpoint (rankflow checkpoints list {run_id})"
        )
    return stored.data


def _cached(dest: Path, manifest: bytes) -> bool:
    """Whether `dest` holds this manifest's checkpoint, every file still of its size and sha256."""
    if not (dest / MANIFEST_FILE).is_file() or (dest / MANIFEST_FILE).read_bytes() != manifest:
        return False
    try:
        entries = parse_manifest(manifest, str(dest / MANIFEST_FILE)).files
    except (ManifestError, ValueError):
        return False
    return all(local_copy_matches(dest / entry.path, entry) for entry in entries)  # a symlink never matches
