"""Objects rewritten under a committed checkpoint on the real SeaweedFS, their metadata kept.

The sha256 rankflow records with an object at upload (`x-amz-meta-sha256`)
stays true only until someone rewrites the bytes: a rewrite that copies the
metadata keeps it. What the store computes from the bytes it holds (its
sha256 checksum, its ETag) changes. The quick check must refuse such an
object, the confirm check and a recommit must not trust it, and a multipart
part whose bytes change after they were hashed must be refused by the server.
The reference is the bytes actually in the store.
"""

from __future__ import annotations

import hashlib

import pytest

import infra.store.s3_uploads
from infra.publication.checkpoints import verify_checkpoint
from infra.publication.commit import StagedFileChanged, commit_checkpoint
from infra.publication.journal import journal_path_for
from infra.store import open_store
from infra.store.s3_uploads import multipart_etag
from infra.store.uploads import ETAG_METADATA_KEY
from tests.publication_helpers import RUN, random_files, stage

pytestmark = pytest.mark.s3

NAME = "step-00000010"


@pytest.fixture
def store(s3_env, s3_bucket_url):
    return open_store(s3_bucket_url)


@pytest.fixture
def small_parts(monkeypatch):
    """Multipart uploads for files over 6 MiB, in 5 MiB parts (S3's smallest), so a test file has three parts."""
    monkeypatch.setattr(infra.store.s3_uploads, "MULTIPART_THRESHOLD_BYTES", 6 * 2**20)
    monkeypatch.setattr(infra.store.s3_uploads, "PART_SIZE_BYTES", 5 * 2**20)


def object_key(store, path: str) -> tuple[str, str]:
    return store.bucket_and_key(store.path(RUN, "checkpoints", NAME, path))


def rewrite_keeping_metadata(store, path: str) -> bytes:
    """Flip one byte of a stored object (same size), rewriting it with the metadata it had; the original bytes."""
    bucket, key = object_key(store, path)
    original = store.fs.cat_file(f"{bucket}/{key}")
    metadata = store.fs.call_s3("head_object", Bucket=bucket, Key=key)["Metadata"]
    damaged = bytearray(original)
    damaged[len(damaged) // 3] ^= 0x01
    store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(damaged), Metadata=metadata)
    assert store.fs.call_s3("head_object", Bucket=bucket, Key=key)["Metadata"] == metadata
    assert hashlib.sha256(store.fs.cat_file(f"{bucket}/{key}")).hexdigest() != hashlib.sha256(original).hexdigest()
    return original


@pytest.mark.parametrize("layout", ["single-part", "multipart"])
def test_an_object_rewritten_with_its_metadata_kept_is_refused_and_a_recommit_repairs_it(
    store, tmp_path, layout, request
):
    if layout == "multipart":
        request.getfixturevalue("small_parts")
    files = random_files(2, 11 * 2**20 if layout == "multipart" else 300_000)
    staged = stage(tmp_path, 10, files)
    commit_checkpoint(staged, store, RUN)
    victim = sorted(files)[0]
    assert verify_checkpoint(store, RUN, NAME).verified
    original = rewrite_keeping_metadata(store, victim)
    assert original == files[victim]

    for depth in ({}, {"confirm": True}, {"full": True}):
        report = verify_checkpoint(store, RUN, NAME, **depth)
        assert not report.verified and report.problems[0].startswith(victim), (depth, report.problems)

    # A recommit without a journal (a fresh work dir): it must not skip the rewritten object.
    journal_path_for(staged, store).unlink()
    store.fs.rm_file(store.path(RUN, "publications", f"{NAME}.json"))
    again = commit_checkpoint(staged, store, RUN)
    assert again.uploaded == (victim,)  # the other object is confirmed by the store's own digest: not uploaded
    assert verify_checkpoint(store, RUN, NAME, full=True).verified
    bucket, key = object_key(store, victim)
    assert store.fs.cat_file(f"{bucket}/{key}") == files[victim]


def test_a_multipart_object_carries_the_etag_of_its_verified_parts(store, tmp_path, small_parts):
    files = random_files(1, 11 * 2**20)
    staged = stage(tmp_path, 10, files)
    commit_checkpoint(staged, store, RUN)
    ((name, data),) = files.items()
    bucket, key = object_key(store, name)
    head = store.fs.call_s3("head_object", Bucket=bucket, Key=key)
    parts = [hashlib.md5(data[i : i + 5 * 2**20]).digest() for i in range(0, len(data), 5 * 2**20)]
    assert len(parts) == 3 and head["ETag"].strip('"') == multipart_etag(parts) == head["Metadata"][ETAG_METADATA_KEY]


def test_a_part_whose_bytes_change_after_hashing_is_refused_by_the_server(store, tmp_path, small_parts, monkeypatch):
    files = random_files(1, 11 * 2**20)
    staged = stage(tmp_path, 10, files)
    ((name, _),) = files.items()
    real = infra.store.s3_uploads._part_digests

    def hash_then_spoil(local, entry):
        digests = real(local, entry)
        data = bytearray(local.read_bytes())
        data[-100] ^= 0xFF  # a stray writer, after the hash and before the send
        local.write_bytes(bytes(data))
        return digests

    monkeypatch.setattr(infra.store.s3_uploads, "_part_digests", hash_then_spoil)
    with pytest.raises(StagedFileChanged, match="no longer matches its manifest") as raised:
        commit_checkpoint(staged, store, RUN)
    assert "Content-Md5" in str(raised.value.__cause__)  # the server refused the part: it hashed the bytes it got
    assert not store.fs.exists(store.path(RUN, "checkpoints", NAME, name))
    assert not verify_checkpoint(store, RUN, NAME).verified
