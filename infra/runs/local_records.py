"""Which store a local record describes: records of outcomes are kept per store, never shared.

The work dir is a cache and the store the truth, so anything this machine
writes down about what happened *in a store* (a publication's journal: "step
60 is CLEANED", the uploads it made) is only true of that store. The same
work dir used with another `storage.url` (a local store, then S3) must not
read the first store's records as the second's. Such records live in a
directory named after the store they describe:

    DIR/<store key>/…          the records about one store
    DIR/<store key>/STORE.json which store that is ({"url": …, "endpoint": …}), for people

The key is a digest of what identifies the store: the S3 endpoint and
bucket/prefix, or the resolved path of a local store. Two spellings of one
store (a symlinked path, another host name for the same endpoint) may get two
keys, which is safe: a store without local records is read from the store
itself. Content the work dir caches (the plan, segment states, a staged
export) is the same whatever the store (a function of the plan), so it is
shared: a store that lacks it gets it uploaded from the cache, a store that
has it is the reference the cache is checked against.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from infra.store.base import ObjectStore
from infra.store.durable import write_durable

STORE_FILE = "STORE.json"


def store_identity(store: ObjectStore) -> dict:
    """What tells this store from any other (no credentials)."""
    return store.describe()


def store_key(store: ObjectStore) -> str:
    identity = {key: value for key, value in store_identity(store).items() if key != "url"}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def records_dir(parent: Path, store: ObjectStore) -> Path:
    """`parent/<store key>`: where records about `store` are kept (not created)."""
    return parent / store_key(store)


def note_store(directory: Path, store: ObjectStore) -> None:
    """Name the store in `directory/STORE.json` once, so a person can tell the directories apart."""
    label = directory / STORE_FILE
    if not label.is_file():
        write_durable(label, json.dumps(store_identity(store), indent=2, sort_keys=True).encode())
