"""Stored records are read through one strict model each: bytes written before the models still read, and
hostile bytes are refused with the error type their readers have always raised.

The fixture bytes below were written by the hand-written writers the models replaced (captured before the
change): the models must read them and, where they write, write the very same bytes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from infra.launch.launcher import _read_error_records
from infra.publication.commit import remote_dir
from infra.publication.finalizer import QueueEntry, earlier_waiters
from infra.publication.journal import Journal, JournalRecord, PublicationState, UploadedObject, mirror_path_for
from infra.publication.latest import LatestPointer, latest_path, parse_latest
from infra.publication.manifests import (
    CheckpointManifest,
    ManifestError,
    checkpoint_key,
    checkpoints_dir_key,
    journal_key,
    latest_key,
    parse_manifest,
    publications_dir_key,
    queue_dir_key,
    queue_key,
)
from infra.runs.run_lease import run_lease_path
from infra.runs.run_state import BundleManifest, parse_bundle_manifest
from infra.store import open_store
from infra.store.lease import Lease, LeaseHeldError, LeaseRecord, lease_key, read_lease
from trainer_core.run.manifest import verify_staged, write_manifest
from trainer_core.run.rank_process import ERRORS_DIR_ENV, RankErrorRecord, record_error

RUN = "tiny-sft-0123456789ab"

# trainer_core.run.manifest.write_manifest before CheckpointManifest: files model.safetensors (b"weights") and
# tok/tokenizer.json (b"{}"), the export's provenance.
MANIFEST_BYTES = (
    b'{\n  "base_model": "tiny",\n  "files": [\n    {\n      "path": "model.safetensors",\n      "sha256": '
    b'"9a129038d9a00aed0cf6a7ea059ca50a813449061ab87848cf1a13eafdf33b2c",\n      "size": 7\n    },\n    {\n'
    b'      "path": "tok/tokenizer.json",\n      "sha256": '
    b'"44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",\n      "size": 2\n    }\n  ],\n'
    b'  "format": "rankflow-checkpoint/2",\n  "logical_dp": 4,\n  "parent_checkpoint": null,\n  "plan_digest": '
    b'"dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd",\n  "run_id": "tiny-sft-0123456789ab",\n'
    b'  "step": 60,\n  "weights_sha256": "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee",\n'
    b'  "world_size": 2\n}'
)
PROVENANCE = {
    "run_id": RUN,
    "step": 60,
    "plan_digest": "d" * 64,
    "parent_checkpoint": None,
    "base_model": "tiny",
    "world_size": 2,
    "logical_dp": 4,
    "weights_sha256": "e" * 64,
}
DIGEST = "0" * 64


def _staged(directory: Path) -> Path:
    (directory / "tok").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / "tok" / "tokenizer.json").write_bytes(b"{}")
    return directory


# -- checkpoint manifest ------------------------------------------------------------


def test_the_manifest_writer_writes_the_bytes_of_the_hand_written_one(tmp_path):
    staged = _staged(tmp_path / "staged")
    written = write_manifest(staged, PROVENANCE)
    assert (staged / "MANIFEST.json").read_bytes() == MANIFEST_BYTES
    assert written == json.loads(MANIFEST_BYTES)
    assert verify_staged(staged) == json.loads(MANIFEST_BYTES)


def test_a_manifest_written_before_the_model_reads_with_its_provenance():
    manifest = parse_manifest(MANIFEST_BYTES, "m", run_id=RUN, step=60)
    assert isinstance(manifest, CheckpointManifest)
    assert [(e.path, e.size) for e in manifest.files] == [("model.safetensors", 7), ("tok/tokenizer.json", 2)]
    assert manifest.num_bytes == 9 and manifest.raw == json.loads(MANIFEST_BYTES)
    assert manifest.provenance["world_size"] == 2 and "files" not in manifest.provenance
    assert manifest.to_json().encode() == MANIFEST_BYTES


def test_a_format_1_manifest_without_run_id_reads_and_keeps_its_keys():
    raw = {"format": "rankflow-checkpoint/1", "step": 3, "files": []}
    manifest = parse_manifest(json.dumps(raw).encode(), "m", run_id=RUN, step=3)
    assert manifest.run_id is None and manifest.raw == raw


def _with(**changes) -> bytes:
    raw = json.loads(MANIFEST_BYTES)
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw).encode()


def _entry(**changes) -> bytes:
    raw = json.loads(MANIFEST_BYTES)
    raw["files"][1].update(changes)
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "data, message",
    [
        (b"{not json", "m: not valid JSON"),
        (b"[1, 2]", "m: not a JSON object"),
        (
            _with(format="rankflow-checkpoint/9"),
            (
                "m: unknown format 'rankflow-checkpoint/9'; this reader knows "
                "rankflow-checkpoint/1, rankflow-checkpoint/2 (a newer rankflow"
            ),
        ),
        (_with(format=KeyError), "m: unknown format None"),
        (_with(step=-1), "m: step -1 is not a non-negative integer"),
        (_with(step="60"), "m: step '60' is not a non-negative integer"),
        (_with(step=True), "m: step True is not a non-negative integer"),
        (_with(step=float("nan")), "m: step nan is not a non-negative integer"),
        (_with(step=61), "m: manifest of step 61 stored as step 60; refusing it"),
        (_with(run_id=7), "m: run_id 7 is not a string"),
        (_with(run_id="someone-else"), "m: manifest of run 'someone-else' stored under run 'tiny-sft-0123456789ab'"),
        (_with(run_id=KeyError), "m: a rankflow-checkpoint/2 manifest must name its run_id"),
        (_with(files={"a": 1}), "m: 'files' is not a list"),
        (_with(files=["model.safetensors"]), "m: files[0] is not an object"),
        (_entry(path="../../outside.txt"), "m: file path '../../outside.txt' leaves its checkpoint"),
        (_entry(path="/etc/passwd"), "m: file path '/etc/passwd' is absolute or not a POSIX relative path"),
        (_entry(path=""), "m: file path '' is not a non-empty string"),
        (_entry(path=3), "m: file path 3 is not a non-empty string"),
        (_entry(path="MANIFEST.json"), "m: the manifest lists itself"),
        (_entry(size=-1), "m: tok/tokenizer.json: size -1 is not a non-negative integer"),
        (_entry(size=2.0), "m: tok/tokenizer.json: size 2.0 is not a non-negative integer"),
        (_entry(size=float("nan")), "m: tok/tokenizer.json: size nan is not a non-negative integer"),
        (_entry(sha256="A" * 64), "m: tok/tokenizer.json: sha256 'AAAA"),
        (_entry(sha256=None), "m: tok/tokenizer.json: sha256 None is not 64 lowercase hex digits"),
        (_entry(path="model.safetensors"), "m: model.safetensors is listed twice or is both a file and a directory"),
        (_entry(path="model.safetensors/x"), "m: model.safetensors/x is listed twice or is both a file and"),
        (_entry(junk=1), "m: files[1] has an unknown key 'junk'"),
    ],
    ids=lambda value: None,
)
def test_a_hostile_manifest_is_refused_with_a_manifest_error(data, message):
    with pytest.raises(ManifestError) as refused:
        parse_manifest(data, "m", run_id=RUN, step=60)
    assert str(refused.value).startswith(message), str(refused.value)


def test_the_writer_refuses_a_manifest_the_readers_would_refuse(tmp_path):
    staged = _staged(tmp_path / "staged")
    with pytest.raises(ManifestError, match="step -1 is not a non-negative integer"):
        write_manifest(staged, {**PROVENANCE, "step": -1})
    with pytest.raises(ManifestError, match="must name its run_id"):
        write_manifest(staged, {"step": 1})
    assert not (staged / "MANIFEST.json").exists()


def test_a_staged_manifest_that_does_not_parse_never_verifies(tmp_path):
    staged = _staged(tmp_path / "staged")
    write_manifest(staged, PROVENANCE)
    (staged / "MANIFEST.json").write_bytes(_entry(size=-2))
    assert verify_staged(staged) is None


# -- run-state bundle manifest ------------------------------------------------------

# infra.runs.run_state.publish_bundle's manifest before BundleManifest (one file).
BUNDLE_BYTES = (
    b'{\n  "bundle": "segment-0000",\n  "files": [\n    {\n      "path": "segments/segment-0000.json",\n'
    b'      "sha256": "0000000000000000000000000000000000000000000000000000000000000000",\n      "size": 12\n'
    b'    }\n  ],\n  "format": "rankflow-run-state/1",\n  "run_id": "tiny-sft-0123456789ab"\n}'
)


def test_a_bundle_manifest_written_before_the_model_reads_and_writes_the_same_bytes():
    bundle = parse_bundle_manifest(BUNDLE_BYTES, "b", RUN, "segment-0000")
    assert bundle.entry("segments/segment-0000.json").size == 12
    assert (
        BundleManifest(
            format="rankflow-run-state/1", run_id=RUN, bundle="segment-0000", files=list(bundle.files)
        ).to_bytes()
        == BUNDLE_BYTES
    )


def _bundle(**changes) -> bytes:
    return json.dumps({**json.loads(BUNDLE_BYTES), **changes}).encode()


@pytest.mark.parametrize(
    "data, message",
    [
        (b"[]", "b: not a rankflow-run-state/1 manifest"),
        (_bundle(format="rankflow-run-state/2"), "b: not a rankflow-run-state/1 manifest (a newer rankflow"),
        (
            _bundle(run_id="another-run"),
            "b: manifest of 'another-run'/'segment-0000' stored as 'tiny-sft-0123456789ab'",
        ),
        (_bundle(bundle=5), "b: manifest of 'tiny-sft-0123456789ab'/5 stored as"),
        (_bundle(files=[{"path": "../escaped", "size": 1, "sha256": DIGEST}]), "b: file path '../escaped' leaves"),
        (_bundle(files=[{"path": "a", "size": -1, "sha256": DIGEST}]), "b: a: size -1 is not a non-negative"),
        (_bundle(extra="junk"), "b: extra"),
    ],
    ids=lambda value: None,
)
def test_a_hostile_bundle_manifest_is_refused_with_a_manifest_error(data, message):
    with pytest.raises(ManifestError) as refused:
        parse_bundle_manifest(data, "b", RUN, "segment-0000")
    assert str(refused.value).startswith(message), str(refused.value)


# -- publication journal ------------------------------------------------------------

# infra.publication.journal.JournalRecord.to_bytes before the model (a COMMITTED record with one upload and one event).
JOURNAL_BYTES = (
    b'{\n  "error": null,\n  "fingerprint": "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",\n'
    b'  "format": "rankflow-journal/1",\n  "history": [\n    {\n      "host": "node-1",\n      "note": "export '
    b'started (new publication)",\n      "pid": 4242,\n      "state": "PREPARING",\n      "time": 1764600000.25\n'
    b'    }\n  ],\n  "manifest_sha256": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",\n'
    b'  "num_bytes": 1234,\n  "num_files": 3,\n  "publication_id": "0123456789abcdef",\n  "run_id": '
    b'"tiny-sft-0123456789ab",\n  "state": "COMMITTED",\n  "step": 60,\n  "updated_at": 1764600001.5,\n'
    b'  "uploaded": {\n    "model.safetensors": {\n      "sha256": '
    b'"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",\n      "size": 1000\n    }\n  }\n}'
)


def test_a_journal_written_before_the_model_reads_and_writes_the_same_bytes():
    record = JournalRecord.from_bytes(JOURNAL_BYTES)
    assert record.state is PublicationState.COMMITTED and record.history[0].state is PublicationState.PREPARING
    assert record.uploaded["model.safetensors"].size == 1000
    assert record.to_bytes() == JOURNAL_BYTES


def test_the_journal_records_what_it_writes_as_models_and_reads_it_back(tmp_path):
    journal = Journal(tmp_path / "step-00000010.json", None, RUN, 10)
    journal.begin("f" * 64)
    journal.transition(PublicationState.PREPARED, manifest_sha256=DIGEST, num_files=2, num_bytes=9)
    journal.transition(PublicationState.COMMITTING)
    journal.record_upload("model.safetensors", 7, DIGEST)
    again = Journal(journal.path, None, RUN, 10).load().record
    assert (
        again is not None
        and again == journal.record
        and again.uploaded["model.safetensors"] == UploadedObject(size=7, sha256=DIGEST)
    )
    assert [event.state for event in again.history] == ["PREPARING", "PREPARED", "COMMITTING"]
    with pytest.raises(ValueError):
        journal.transition(PublicationState.COMMITTED, num_bytes=-1)  # every assignment is validated


def _journal(**changes) -> bytes:
    raw = json.loads(JOURNAL_BYTES)
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        _journal(format="rankflow-journal/2"),
        _journal(format=KeyError),
        _journal(state="DONE"),
        _journal(step=-1),
        _journal(step="60"),
        _journal(num_bytes=-5),
        _journal(updated_at=float("nan")),
        _journal(uploaded={"a": {"size": -1, "sha256": DIGEST}}),
        _journal(uploaded={"a": {"size": 1, "sha256": "x"}}),
        _journal(history=[{"state": "PREPARING", "time": float("inf"), "host": "h", "pid": 1, "note": ""}]),
        _journal(history=["PREPARING"]),
        _journal(manifest_sha256="not a digest"),
        _journal(junk=1),
    ],
    ids=lambda value: None,
)
def test_a_hostile_journal_is_refused_with_a_value_error(data):
    with pytest.raises(ValueError):  # what Journal.load and read_mirrors catch: an unreadable journal
        JournalRecord.from_bytes(data)


# -- lease ----------------------------------------------------------------------------

# infra.store.lease.LeaseRecord.to_bytes before the model.
LEASE_BYTES = (
    b'{"acquired_at": 1764600000.0, "expires_at": 1764600070.5, "generation": 3, "host": "node-1", '
    b'"owner": "node-1:4242", "pid": 4242, "process_start": "123456", "released": false, "renewed_at": '
    b'1764600010.5, "token": "cccccccccccccccccccccccccccccccc", "ttl_s": 60.0}'
)


def test_a_lease_written_before_the_model_reads_and_writes_the_same_bytes():
    record = LeaseRecord.from_bytes(LEASE_BYTES)
    assert (record.generation, record.pid, record.released) == (3, 4242, False)
    assert record.expired(1764600070.5) and not record.expired(1764600070.4)
    assert record.to_bytes() == LEASE_BYTES
    assert LeaseRecord.from_bytes(json.dumps({**json.loads(LEASE_BYTES), "ttl_s": 60}).encode()).ttl_s == 60


def _lease(**changes) -> bytes:
    raw = json.loads(LEASE_BYTES)
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"garbage",
        b"[]",
        _lease(owner=KeyError),
        _lease(generation="3"),
        _lease(generation=-1),
        _lease(generation=3.0),
        _lease(expires_at=float("nan")),
        _lease(expires_at=float("inf")),
        _lease(expires_at="soon"),
        _lease(pid="4242"),
        _lease(released="no"),
        _lease(token=None),
    ],
    ids=lambda value: None,
)
def test_a_hostile_lease_is_unreadable_and_taken_over(tmp_path, data):
    with pytest.raises(ValueError):
        LeaseRecord.from_bytes(data)
    store = open_store(str(tmp_path / "store"))
    path = store.path(RUN, "leases", "finalizer.json")
    store.put(store.key_of(path), data)
    assert read_lease(store, path) is None  # guards nothing
    lease = Lease(store, path, owner="me:1").acquire()
    assert lease.record is not None and read_lease(store, path) == lease.record and lease.record.generation == 1
    lease.release()


def test_a_lease_with_an_unknown_key_still_guards_its_holder(tmp_path):
    store = open_store(str(tmp_path / "store"))
    path = store.path(RUN, "leases", "finalizer.json")
    now = time.time()
    newer = {
        **json.loads(LEASE_BYTES),
        "host": "another-machine",
        "renewed_at": now,
        "expires_at": now + 600,
        "field_of_a_newer_rankflow": 1,
    }
    store.put(store.key_of(path), json.dumps(newer).encode())
    holder = read_lease(store, path)
    assert holder is not None and holder.owner == "node-1:4242"
    with pytest.raises(LeaseHeldError):
        Lease(store, path, owner="me:1").acquire()


# -- LATEST ---------------------------------------------------------------------------

LATEST_BYTES = b'{"checkpoint": "step-00000060", "step": 60}'
"""infra.publication.latest.advance_latest's record before LatestPointer."""


def test_latest_written_before_the_model_reads_and_writes_the_same_bytes():
    assert parse_latest(LATEST_BYTES) == (LatestPointer(checkpoint="step-00000060", step=60), None)
    assert LatestPointer.at(60).to_bytes() == LATEST_BYTES
    assert parse_latest(b'{"step": 7}')[0] == LatestPointer.at(7)  # the name is derived when absent, as before


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"not json", "not a LATEST record (JSONDecodeError: "),
        (b"[]", "not a LATEST record ("),
        (b"{}", "not a LATEST record (step: "),
        (b'{"checkpoint": "step-x", "step": "ten"}', "step 'ten' is not a non-negative integer"),
        (b'{"checkpoint": "step-00000060", "step": -60}', "step -60 is not a non-negative integer"),
        (b'{"checkpoint": "step-00000060", "step": 60.0}', "step 60.0 is not a non-negative integer"),
        (b'{"checkpoint": "step-00000060", "step": NaN}', "step nan is not a non-negative integer"),
        (b'{"checkpoint": "step-00000060", "step": true}', "step True is not a non-negative integer"),
        (b'{"checkpoint": "step-00000061", "step": 60}', "checkpoint 'step-00000061' does not match step 60"),
        (b'{"checkpoint": "../other-run", "step": 60}', "checkpoint '../other-run' does not match step 60"),
        (b'{"checkpoint": 60, "step": 60}', "not a LATEST record (checkpoint: "),
        (b'{"checkpoint": "step-00000060", "step": 60, "junk": 1}', "not a LATEST record (junk: "),
    ],
    ids=lambda value: None,
)
def test_a_hostile_latest_is_untrustworthy_and_says_why(data, problem):
    pointer, found = parse_latest(data)
    assert pointer is None and found is not None and found.startswith(problem), found


# -- finalizer queue entry ---------------------------------------------------------------

QUEUE_BYTES = b'{"waiting_at": 1764600000.5, "owner": "node-1:4242"}'
"""infra.publication.finalizer's queue entry before QueueEntry."""


def test_a_queue_entry_written_before_the_model_reads_and_writes_the_same_bytes():
    entry = QueueEntry.model_validate(json.loads(QUEUE_BYTES))
    assert entry == QueueEntry(waiting_at=1764600000.5, owner="node-1:4242") and entry.to_bytes() == QUEUE_BYTES


@pytest.mark.parametrize(
    "changes, alive",
    [
        ({}, True),
        ({"waiting_at": "now"}, False),
        ({"waiting_at": float("nan")}, False),
        ({"waiting_at": KeyError}, False),
        ({"owner": 7}, False),
        ({"junk": 1}, False),
    ],
    ids=lambda value: None,
)
def test_an_unreadable_queue_entry_is_no_live_waiter(tmp_path, changes, alive):
    store = open_store(str(tmp_path / "store"))
    raw = {"waiting_at": time.time(), "owner": "node-1:4242"}
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    store.put(store.key(RUN, "finalizer-queue", "step-00000010.json"), json.dumps(raw).encode())
    assert earlier_waiters(store, RUN, 20, fresh_s=60) == ([10] if alive else [])


# -- rank error record ---------------------------------------------------------------------

RANK_ERROR_BYTES = (
    b'{"rank": 1, "time": 1796146043.1132898, "type": "ValueError", "message": "boom\\nsecond line", '
    b'"traceback": "Traceback (most recent call last):\\n  File \\"<string>\\", line 5, in <module>\\n'
    b'ValueError: boom\\nsecond line\\n"}'
)
"""trainer_core.run.rank_process.record_error's file before RankErrorRecord."""


def test_a_rank_error_written_before_the_model_reads_and_writes_the_same_bytes(tmp_path):
    path = tmp_path / "rank-1.error.json"
    path.write_bytes(RANK_ERROR_BYTES)
    record = RankErrorRecord.read(path)
    assert (record.rank, record.type) == (1, "ValueError") and record.to_json().encode() == RANK_ERROR_BYTES


def test_record_error_writes_what_the_launcher_reads_and_a_torn_or_hostile_record_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv(ERRORS_DIR_ENV, str(tmp_path))
    try:
        raise KeyError("missing")
    except KeyError as error:
        record_error(2, error)
    good = json.loads((tmp_path / "rank-2.error.json").read_text())
    (tmp_path / "rank-0.error.json").write_bytes(RANK_ERROR_BYTES[:40])  # killed mid-write
    (tmp_path / "rank-3.error.json").write_text(json.dumps({**good, "rank": 3, "time": float("nan")}))
    (tmp_path / "rank-4.error.json").write_text(json.dumps({**good, "rank": "4"}))
    (tmp_path / "rank-5.error.json").write_text(json.dumps({**good, "rank": 5, "junk": 1}))
    (tmp_path / "rank-6.error.json").write_text(json.dumps({**good, "rank": -6}))
    records = _read_error_records(tmp_path)
    assert records == (good,) and good["type"] == "KeyError" and "KeyError: 'missing'" in good["traceback"]


# -- store keys ------------------------------------------------------------------------


def test_the_store_keys_spell_the_layout_every_stored_run_has():
    assert checkpoints_dir_key(RUN) == f"{RUN}/checkpoints"
    assert checkpoint_key(RUN, "step-00000060") == f"{RUN}/checkpoints/step-00000060"
    assert checkpoint_key(RUN, "step-00000060", "MANIFEST.json") == f"{RUN}/checkpoints/step-00000060/MANIFEST.json"
    assert latest_key(RUN) == f"{RUN}/LATEST"
    assert (publications_dir_key(RUN), journal_key(RUN, 60)) == (
        f"{RUN}/publications",
        f"{RUN}/publications/step-00000060.json",
    )
    assert (queue_dir_key(RUN), queue_key(RUN, 60)) == (
        f"{RUN}/finalizer-queue",
        f"{RUN}/finalizer-queue/step-00000060.json",
    )
    assert lease_key(RUN, "finalizer") == f"{RUN}/leases/finalizer.json"


def test_every_writer_uses_the_store_keys(tmp_path):
    store = open_store(str(tmp_path / "store"))
    assert run_lease_path(store, RUN) == store.path(f"{RUN}/leases/run.json")
    assert Lease.for_run(store, RUN, "finalizer").path == store.path(f"{RUN}/leases/finalizer.json")
    assert mirror_path_for(store, RUN, 60) == store.path(f"{RUN}/publications/step-00000060.json")
    assert latest_path(store, RUN) == store.path(f"{RUN}/LATEST")
    assert remote_dir(store, RUN, 60) == store.path(f"{RUN}/checkpoints/step-00000060")
