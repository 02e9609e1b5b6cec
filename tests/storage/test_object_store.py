"""The ObjectStore protocol (infra/store/base.py): each method, against MemoryStore, LocalStore and S3Store.

The same assertions run on the three backends, so a backend that differs
from the others in what a caller can see fails here. The S3 case uses the
session's SeaweedFS (tests/s3_fixture.py) and carries the s3 mark. Also: the
conditional-write probe refuses a store whose `put` ignores its mode, on
every backend.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from infra.store import (
    BACKENDS,
    LocalStore,
    MemoryStore,
    ObjectInfo,
    ObjectStore,
    S3Store,
    StoreTimeouts,
    Upload,
    open_store,
)
from infra.store.base import Versioned, location_of
from infra.store.conditional import ConditionalWritesUnsupported, check_conditional_writes
from infra.store.objects import StagedFileChanged
from trainer_core.config import StorageSection


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    if request.param == "memory":
        with MemoryStore() as memory:
            yield memory
    elif request.param == "local":
        yield open_store(str(tmp_path / "store"))
    else:
        request.getfixturevalue("s3_env")
        yield open_store(request.getfixturevalue("s3_bucket_url"))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_every_backend_is_an_object_store(store):
    assert isinstance(store, ObjectStore)
    assert store.key("run", "checkpoints", "x") == "run/checkpoints/x"
    assert store.url_of("run/x").endswith("/run/x")


def test_full_paths_and_keys_name_the_same_object(store):
    """What the path-level callers use: `path` joins under `root`, `key_of` undoes it, `url_of` takes parts or a key."""
    path = store.path("run", "checkpoints", "x")
    assert path.startswith(store.root.rstrip("/") + "/") and path.endswith("/run/checkpoints/x")
    assert store.key_of(path) == "run/checkpoints/x" and store.key_of(store.root) == ""
    assert store.url_of("run", "checkpoints", "x") == store.url_of(store.key("run", "checkpoints", "x"))
    assert store.url_of("run", "checkpoints", "x") != store.url_of("run", "checkpoints", "y")


def test_location_of_gives_a_backend_itself_and_refuses_anything_else(store):
    assert location_of(store) is store

    class NotABackend:
        pass

    with pytest.raises(TypeError, match="NotABackend is no StoreLocation"):
        location_of(NotABackend())  # pyright: ignore[reportArgumentType] (the point of the test)


def test_get_of_a_missing_object_is_none_and_a_put_reads_back_with_a_tag(store):
    assert store.get("run/a.json") is None
    tag = store.put("run/a.json", b"one")
    got = store.get("run/a.json")
    assert isinstance(got, Versioned) and got.data == b"one" and got.tag == tag
    assert store.put("run/a.json", b"two") is not None  # overwrite replaces whatever is there
    assert store.get("run/a.json").data == b"two"


def test_create_writes_only_where_nothing_is(store):
    first = store.put("run/lease.json", b"first", mode="create")
    assert first is not None
    assert store.put("run/lease.json", b"second", mode="create") is None
    assert store.get("run/lease.json") == Versioned(b"first", first)


def test_if_match_replaces_only_the_tagged_bytes(store):
    first = store.put("run/latest", b"one", mode="create")
    second = store.put("run/latest", b"two", mode="if_match", tag=first)
    assert second is not None and store.get("run/latest").data == b"two"
    assert store.put("run/latest", b"three", mode="if_match", tag=first) is None  # the tag is stale
    assert store.put("run/absent", b"x", mode="if_match", tag=first) is None
    assert store.get("run/latest").data == b"two"
    with pytest.raises(ValueError, match="names no tag"):
        store.put("run/latest", b"four", mode="if_match")


def test_head_gives_size_and_recorded_digest_of_present_keys_only(store):
    store.put("run/ckpt/a.bin", b"a" * 10)
    found = store.head(["run/ckpt/a.bin", "run/ckpt/missing.bin"])
    assert set(found) == {"run/ckpt/a.bin"}
    info = found["run/ckpt/a.bin"]
    assert isinstance(info, ObjectInfo) and info.size == 10 and info.sha256 == _sha(b"a" * 10)


def test_list_is_recursive_and_children_are_immediate(store):
    for key, data in {"run/c/step-1/a": b"1", "run/c/step-1/sub/b": b"22", "run/c/step-2/a": b"333"}.items():
        store.put(key, data)
    assert store.list("run/c") == {"step-1/a": 1, "step-1/sub/b": 2, "step-2/a": 3}
    assert store.list("run/nothing") == {}
    assert store.children("run/c") == ["step-1", "step-2"]
    assert store.children("run/c/step-1") == ["a", "sub"]
    assert store.children("run/nothing") == []


def test_children_can_name_only_folders(store):
    for key in ("run/c/step-1/a", "run/c/step-2/a", "run/c/LATEST"):
        store.put(key, b"x")
    assert store.children("run/c") == ["LATEST", "step-1", "step-2"]
    assert store.children("run/c", dirs_only=True) == ["step-1", "step-2"]
    assert store.children("", dirs_only=True) == ["run"]  # the store's root itself


def test_read_range_reads_only_the_bytes_asked_for(store):
    store.put("run/ledger.jsonl", b"0123456789")
    assert store.read_range("run/ledger.jsonl", 6, 10) == b"6789"
    assert store.read_range("run/ledger.jsonl", 0, 3) == b"012"
    with pytest.raises(FileNotFoundError):
        store.read_range("run/never-there", 0, 3)


def test_remove_takes_what_is_named_and_a_missing_key_is_fine(store):
    store.put("run/x/a", b"a")
    store.put("run/x/b", b"b")
    store.remove(["run/x/a", "run/x/never-there"])
    assert store.list("run/x") == {"b": 1}


def test_open_read_streams_the_bytes(store):
    data = bytes(range(256)) * 1000
    store.put("run/big", data)
    with store.open_read("run/big") as handle:
        assert handle.read(10) == data[:10]
        assert handle.read() == data[10:]


def _staged(tmp_path: Path, files: dict[str, bytes]) -> list[Upload]:
    uploads = []
    for name, data in files.items():
        local = tmp_path / "staged" / name
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)
        uploads.append(Upload(local, f"run/ckpt/{name}", len(data), _sha(data)))
    return uploads


def test_upload_lands_every_file_and_reports_each(store, tmp_path):
    uploads = _staged(tmp_path, {"a.bin": b"a" * 1000, "dir/b.bin": b"b" * 5})
    landed = []
    store.upload(uploads, on_uploaded=landed.append, concurrency=4)
    assert sorted(u.key for u in landed) == ["run/ckpt/a.bin", "run/ckpt/dir/b.bin"]
    assert store.list("run/ckpt") == {"a.bin": 1000, "dir/b.bin": 5}
    assert store.head(["run/ckpt/a.bin"])["run/ckpt/a.bin"].sha256 == _sha(b"a" * 1000)
    assert store.get("run/ckpt/dir/b.bin").data == b"b" * 5


def test_upload_refuses_a_file_that_no_longer_matches(store, tmp_path):
    (upload,) = _staged(tmp_path, {"a.bin": b"a" * 100})
    upload.local.write_bytes(b"b" * 100)  # same size, other bytes
    with pytest.raises(StagedFileChanged, match="no longer matches its manifest"):
        store.upload([upload], on_uploaded=lambda u: None)
    assert store.list("run/ckpt") == {}


def test_abort_uploads_finds_nothing_dangling_after_whole_writes(store):
    store.put("run/ckpt/a", b"a")
    assert store.abort_uploads("run/ckpt") == 0


def test_check_writable_passes_on_a_writable_store(store):
    store.check_writable()
    assert store.list("") == {}  # the probe left nothing behind (each test has a store of its own)


def test_check_writable_of_an_unwritable_local_store_is_a_setting_error(tmp_path):
    from infra.store.preflight import StoreSettingError

    (tmp_path / "file").write_bytes(b"not a folder")
    with pytest.raises(StoreSettingError, match="refuses the probe write"):
        open_store(str(tmp_path / "file" / "store")).check_writable()


def test_errors_let_an_oserror_through(store):
    with pytest.raises(FileNotFoundError):
        with store.errors("a test read"):
            raise FileNotFoundError("gone")


def test_overlaps_only_for_a_local_directory_in_or_around_the_store(store, tmp_path):
    if isinstance(store, LocalStore):
        root = Path(store.root)
        assert store.overlaps(root) and store.overlaps(root / "run" / "work") and store.overlaps(root.parent)
        assert not store.overlaps(tmp_path / "elsewhere")
    else:
        assert not store.overlaps(tmp_path) and not store.overlaps(Path("/"))


def test_the_conditional_write_probe_passes_and_leaves_nothing(store):
    check_conditional_writes(store, store.key("run", "leases"))
    assert store.list("run") == {}
    if isinstance(store, LocalStore):
        assert not any(Path(store.root).rglob(".*.lock"))


class IgnoresModes(MemoryStore):
    """A store that writes whatever it is told, whatever the precondition: it would lose mutual exclusion."""

    def put(self, key, data, *, mode="overwrite", tag=None, deadline=None):
        return super().put(key, data, deadline=deadline)


def test_a_store_whose_put_ignores_its_mode_is_refused_by_the_probe():
    with IgnoresModes() as store:
        with pytest.raises(ConditionalWritesUnsupported, match="ignores conditional writes"):
            check_conditional_writes(store, store.key("run", "leases"))
        # A refusal is not remembered as a pass: the next check refuses again.
        with pytest.raises(ConditionalWritesUnsupported):
            check_conditional_writes(store, store.key("run", "leases"))


def test_memory_stores_are_apart_and_close_forgets():
    with MemoryStore() as one, MemoryStore() as two:
        one.put("k", b"1")
        assert two.get("k") is None and one.identity != two.identity
        one.close()
        assert one.get("k") is None


def test_open_store_picks_the_backend_by_scheme_and_takes_a_storage_section(tmp_path):
    assert BACKENDS == {"file": LocalStore, "s3": S3Store}
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    section = StorageSection(url=str(tmp_path / "s"), request_timeout_s=4)
    store = open_store(section)
    assert isinstance(store, LocalStore) and store.url == section.url
    assert store.timeouts == StoreTimeouts(connect_s=4, read_s=4)


def test_store_timeouts_from_settings_caps_the_connect_limit():
    assert StoreTimeouts.from_settings(StorageSection(request_timeout_s=60)) == StoreTimeouts(connect_s=10, read_s=60)
    assert StoreTimeouts.from_settings(StorageSection(request_timeout_s=3)) == StoreTimeouts(connect_s=3, read_s=3)
