"""Reader markers: a checkpoint being pulled says so in the store, so retention does not remove it underneath.

A reader (`download_checkpoint`, so `rankflow checkpoints pull` and every
other verifying download) writes `RUN_ID/readers/step-N/ID.json` with an
expiry before it reads the checkpoint's manifest, renews it every `ttl_s / 3`
while it downloads, and removes it when done. Retention (retention.py) skips
a checkpoint with a live marker, and removes one in this order: check the
markers, hide the manifest, check the markers again, and only then remove
the data. On a store that reads its own writes (a local disk, S3 since 2020,
SeaweedFS), a reader that saw the manifest wrote its marker before that, so
before the manifest was hidden, so before the second check: the data stay
(a later gc removes them once the marker is gone). A reader that comes after
the hide finds no manifest and says the checkpoint was removed. A reader that
may not write (read-only credentials) reads without a marker, unprotected, as
before markers existed.

Expiry is wall-clock time, as for leases (infra/store/lease.py): machines
need clocks within a small fraction of `ttl_s`. A reader paused past its
`ttl_s` (its heartbeat stopped) can lose the checkpoint; it then fails its
download (every file is verified against the manifest), never keeps bad bytes.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.publication.manifests import read_capped, reader_key, readers_dir_key
from infra.store.base import ObjectStore
from infra.store.lease import default_owner
from infra.store.objects import put_small

READER_TTL_S = 60.0
MARKER_MAX_BYTES = 64 * 2**10


class ReaderMarker(BaseModel):
    """`readers/step-N/ID.json`: who is pulling the checkpoint, and until when the marker counts without renewal."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    owner: str
    expires_at: Annotated[float, Field(allow_inf_nan=False)]
    ttl_s: Annotated[float, Field(gt=0, allow_inf_nan=False)]

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(), sort_keys=True).encode()


def live_readers(store: ObjectStore, run_id: str, name: str, now: float | None = None) -> list[str]:
    """The owners of the unexpired reader markers of checkpoint `name` (an unreadable marker does not count)."""
    now = time.time() if now is None else now
    live = []
    with store.errors(f"readers of {name} of run {run_id}"):
        for child in store.children(readers_dir_key(run_id, name)):
            try:  # a marker is ~100 bytes: one past MARKER_MAX_BYTES is refused unread, as any unreadable one
                found = read_capped(
                    store, reader_key(run_id, name, child.removesuffix(".json")), name, MARKER_MAX_BYTES
                )
                if found is None:
                    continue  # done meanwhile
                marker = ReaderMarker.model_validate(json.loads(found))
            except (ValueError, ValidationError):
                continue
            if marker.expires_at > now:
                live.append(marker.owner)
    return live


def remove_reader_markers(store: ObjectStore, run_id: str, name: str) -> None:
    """Forget the markers of a checkpoint that is gone (expired ones: their readers are dead or done)."""
    with store.errors(f"readers of {name} of run {run_id}"):
        keys = [
            reader_key(run_id, name, c.removesuffix(".json")) for c in store.children(readers_dir_key(run_id, name))
        ]
        if keys:
            store.remove(keys)


@contextmanager
def reading(store: ObjectStore, run_id: str, name: str, ttl_s: float = READER_TTL_S) -> Iterator[str | None]:
    """Hold a reader marker on checkpoint `name` (renewed every ttl_s / 3) for the duration of a download.

    A reader whose credentials may not write to the store (PermissionError: an inference server's read-only
    key) reads without a marker (None), as every reader did before markers: it is not protected from
    retention, and a checkpoint removed underneath it fails its verified download, never leaves bad bytes."""
    key = reader_key(run_id, name, secrets.token_hex(8))
    owner = default_owner()

    def write() -> None:
        put_small(
            store, store.path(key), ReaderMarker(owner=owner, expires_at=time.time() + ttl_s, ttl_s=ttl_s).to_bytes()
        )

    try:
        with store.errors(f"reader marker on {name} of run {run_id}"):
            write()
    except PermissionError:
        yield None
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(ttl_s / 3):
            with contextlib.suppress(OSError):  # the download itself fails on an unreachable store
                write()

    heartbeat = threading.Thread(target=beat, name=f"reader-marker {key}", daemon=True)
    heartbeat.start()
    try:
        yield key
    finally:
        stop.set()
        heartbeat.join(timeout=ttl_s)
        with contextlib.suppress(OSError):  # a marker left behind expires after ttl_s
            store.remove([key])
