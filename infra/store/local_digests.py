"""What a store that holds its bytes where rankflow can hash them (a local disk, memory) says of stored objects.

`remote_objects` of such a store needs no recorded metadata: each object's
own bytes give its digest (`RemoteObject.hashed`), computed only where the
size already matches the manifest's.
"""

from __future__ import annotations

from trainer_core.run.manifest import FileEntry

from .base import Deadline, ObjectStore
from .uploads import RemoteObject


def hashed_where_they_lie(
    store: ObjectStore, base: str, entries: list[FileEntry], deadline: Deadline | None
) -> dict[str, RemoteObject]:
    """`remote_objects` of a store that hashes the bytes where they lie (a local disk, memory): their own digest.

    Only what could match is hashed (a digest is computed when first read): a wrong size is a mismatch already."""
    by_key = {store.key_of(f"{base}/{entry.path}"): entry for entry in entries}
    found = {}
    for key, info in store.head(list(by_key), deadline=deadline).items():
        entry = by_key[key]
        same_size = info.size == entry.size
        found[entry.path] = RemoteObject(info.size, info.sha256 if same_size else None, hashed=same_size)
    return found
