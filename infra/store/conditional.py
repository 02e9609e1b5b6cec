"""Compare-and-swap on one small object: create it if absent, replace it if unchanged.

The lease (infra/store/lease.py) and LATEST (infra/publication/latest.py) are built on these
operations, so that two writers on two machines can never both win.

- S3: a conditional PutObject (`If-None-Match: *` to create, `If-Match: ETAG`
  to replace). SeaweedFS 4.48 honours both,
  atomically under contention (tests/storage/test_conditional.py races 16
  writers); `check_conditional_writes` refuses a store that ignores them rather
  than silently losing mutual exclusion.
- Local filesystem (infra/store/local.py): create publishes a fully written
  file with os.link (which fails when the name exists); replace holds an
  exclusive flock on a sidecar lock file while it compares and renames. The
  tag is the sha256 of the bytes.

Each backend's `conditional_write` makes one unconfirmed attempt; this module
wraps it (and imports no backend).

A write whose answer was lost is confirmed from the store. When the server
applied a conditional PUT but its answer never arrived, the client's retry of
the same request is refused (412: the first one changed the object), or the
client gives up with a connection error. So after a refused or failed write
the object is read back: if it holds exactly the bytes written, the write
landed and its tag is returned. A lease record carries a fresh token, so its
bytes are this write's own; for LATEST they may be a racer's identical
pointer, which leaves LATEST where this write wanted it.
"""

from __future__ import annotations

import posixpath
import secrets
import threading
from collections.abc import Callable

from .base import ObjectStore, PutMode, StoreLocation, Versioned, location_of

_PRECONDITION_CODES = ("PreconditionFailed", "ConditionalRequestConflict")

# Store identities (server and bucket, or root) whose conditional writes were probed in this
# process: a store does not stop honouring them, and the probe costs three requests.
_VERIFIED_STORES: set[str] = set()
_VERIFIED_LOCK = threading.Lock()


class ConditionalWritesUnsupported(OSError):
    """The store accepted a write that its precondition should have refused."""


def _is_precondition_failure(error: BaseException) -> bool:
    cause = error.__cause__ if error.__cause__ is not None else error
    response = getattr(cause, "response", None) or {}
    return response.get("Error", {}).get("Code") in _PRECONDITION_CODES or "pre-conditions" in str(error)


def is_precondition_failure(error: BaseException) -> bool:
    """Whether an S3 write failed because its If-None-Match or If-Match did not hold."""
    return _is_precondition_failure(error)


def read_versioned(store: ObjectStore, path: str) -> Versioned | None:
    """The object's bytes and tag, or None if it does not exist."""
    with store.errors(f"read of {path}"):
        return store.get(store.key_of(path))


def _holding(store: ObjectStore, path: str, data: bytes) -> str | None:
    """The object's tag if it holds exactly `data`, else None (an unreadable store raises)."""
    current = read_versioned(store, path)
    return current.tag if current is not None and current.data == data else None


def _confirmed(store: ObjectStore, path: str, data: bytes, what: str, write: Callable[[], str | None]) -> str | None:
    """Run a conditional `write`; a refused or failed one that nonetheless landed (its answer lost) wins."""
    try:
        with store.errors(what):
            tag = write()
    except OSError:
        try:
            landed = _holding(store, path, data)
        except OSError:
            landed = None
        if landed is None:
            raise  # the write's own error stands (the object is not ours, or cannot be read): retry later
        return landed
    # Refused: by another writer, or by a first try of this very request that landed unanswered.
    # If the object cannot be read now, that is an outage, never a refusal.
    return tag if tag is not None else _holding(store, path, data)


def create_if_absent(store: ObjectStore, path: str, data: bytes) -> str | None:
    """Write `data` only if `path` does not exist; the new tag, or None if it existed."""

    def create() -> str | None:
        return location_of(store).conditional_write(store.key_of(path), data, None)

    return _confirmed(store, path, data, f"conditional create of {path}", create)


def replace_if_unchanged(store: ObjectStore, path: str, data: bytes, tag: str) -> str | None:
    """Replace the object only if it still carries `tag`; the new tag, or None if it changed."""

    def replace() -> str | None:
        return location_of(store).conditional_write(store.key_of(path), data, tag)

    return _confirmed(store, path, data, f"conditional replace of {path}", replace)


def put_conditional(store: ObjectStore, key: str, data: bytes, mode: PutMode, tag: str | None) -> str | None:
    """`put`'s create and if-match modes for a backend with `conditional_write`, confirmed on every answer."""
    path = store.path(key)
    if mode == "create":
        return create_if_absent(store, path, data)
    if tag is None:
        raise ValueError(f"put(mode='if_match') of {key} names no tag")
    return replace_if_unchanged(store, path, data, tag)


def check_conditional_writes(store: ObjectStore, probe_prefix: str) -> None:
    """Refuse a store whose conditional writes do not hold (they guard leases and LATEST).

    Creates a probe object with `put(mode="create")` and tries again: the
    second must be refused. The probe's name is unique, so concurrent checks
    do not meet. Every backend is probed (once per store identity and
    process): a backend that ignores the mode would silently lose mutual
    exclusion. `probe_prefix` is a key under the store's root.
    """
    identity = store.identity
    with _VERIFIED_LOCK:
        if identity in _VERIFIED_STORES:
            return
    probe = posixpath.join(probe_prefix.rstrip("/"), f".conditional-probe-{secrets.token_hex(8)}")
    first = store.put(probe, b"first", mode="create")
    second = store.put(probe, b"second", mode="create")
    with store.errors(f"removal of {store.url_of(probe)}"):
        store.remove([probe])
        if isinstance(store, StoreLocation):
            store.forget_lock(probe)  # a local create's sidecar lock file (the probe's name is unique)
    if first is None or second is not None:
        raise ConditionalWritesUnsupported(
            f"object storage at {store.url} ignores conditional writes (If-None-Match); rankflow needs them "
            "for its leases and LATEST — use an S3 service that supports them (AWS S3, SeaweedFS >= 4, MinIO)"
        )
    with _VERIFIED_LOCK:
        _VERIFIED_STORES.add(identity)
