"""The durable journal of one checkpoint publication, and its state machine.

    PREPARING → PREPARED → COMMITTING → COMMITTED → CLEANED      or → ABORTED

The journal is kept beside the staged files, in a directory per store
(`export/journals/<store key>/step-N.json`, atomic replace + fsync; see
infra/runs/local_records.py): it records what happened in *one* store, so the same
work dir used with another `storage.url` starts that store's publication from
nothing instead of believing the first store's outcome. It is mirrored under
the run in the store (`RUN_ID/publications/step-N.json`), so a retry on
another machine, the FIFO order of finalizers and `rankflow checkpoints` see
it too; without a local journal for the store, the mirror is read.

Transitions are checked (`ALLOWED`): a publication that was aborted never
finishes, a committed one is never aborted, nothing leaves CLEANED or
ABORTED. A retry resumes from the recorded state: a staging that no longer
matches its manifest sends it back to PREPARING (re-export), a failed commit
stays COMMITTING and is resumed, a publication that has its outcome
(COMMITTED, CLEANED) is never serialized or uploaded again — unless its
checkpoint no longer verifies in the store, when `begin(..., outcome_lost=…)`
starts a new publication of the step that replaces it (the outcome recorded
is no longer true, so it is not kept as if it were).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, Strict, ValidationError

from infra.publication.manifests import Sha256, checkpoint_name, journal_key, publications_dir_key
from infra.runs.local_records import note_store, records_dir
from infra.store.base import ObjectStore
from infra.store.durable import write_durable

JOURNAL_FORMAT = "rankflow-journal/1"


class PublicationState(str, Enum):
    PREPARING = "PREPARING"
    PREPARED = "PREPARED"
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"
    CLEANED = "CLEANED"
    ABORTED = "ABORTED"


S = PublicationState
ALLOWED: dict[PublicationState | None, frozenset[PublicationState]] = {
    None: frozenset({S.PREPARING, S.PREPARED}),  # PREPARED directly: a staging made outside the export stage
    S.PREPARING: frozenset({S.PREPARING, S.PREPARED, S.ABORTED}),
    S.PREPARED: frozenset({S.PREPARING, S.PREPARED, S.COMMITTING, S.ABORTED}),
    S.COMMITTING: frozenset({S.PREPARING, S.COMMITTING, S.COMMITTED, S.ABORTED}),
    S.COMMITTED: frozenset({S.CLEANED}),
    S.CLEANED: frozenset(),
    S.ABORTED: frozenset(),
}
TERMINAL = frozenset({S.CLEANED, S.ABORTED})
HAS_OUTCOME = frozenset({S.COMMITTED, S.CLEANED})


class TransitionError(RuntimeError):
    """A transition the state machine forbids; the message says why and what to do instead."""


def _why(current: PublicationState | None, target: PublicationState, name: str, error: str | None) -> str:
    if current is S.ABORTED:
        return (
            f"publication {name} was ABORTED ({error or 'no reason recorded'}); it cannot become {target.value} — "
            "an aborted publication never finishes: export the step again to publish it"
        )
    if current is not None and current in HAS_OUTCOME and target is S.ABORTED:
        return (
            f"publication {name} is {current.value}; it cannot be aborted — a committed checkpoint is never "
            "rolled back (remove it with `rankflow checkpoints` tooling if you really must)"
        )
    if current is not None and current in TERMINAL:
        return f"publication {name} is {current.value}, a final state; it cannot become {target.value}"
    if current is not None and current in HAS_OUTCOME:
        return (
            f"publication {name} is already {current.value}; it cannot become {target.value} — its outcome "
            "is recorded, only cleanup is left"
        )
    shown = current.value if current else "not started"
    return (
        f"publication {name} is {shown}; it cannot become {target.value} (allowed: "
        f"{', '.join(sorted(s.value for s in ALLOWED[current])) or 'none'})"
    )


# Stored as its name ("COMMITTED"); read from that name (strict mode would want the enum object itself).
StateName = Annotated[PublicationState, Strict(False), PlainSerializer(lambda state: state.value)]
Seconds = Annotated[float, Field(allow_inf_nan=False)]


class UploadedObject(BaseModel):
    """One object a publication uploaded, as the upload returned."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    size: int = Field(ge=0)
    sha256: Sha256


class JournalEvent(BaseModel):
    """One transition: the state entered, when, by which process, and why."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    state: StateName
    time: Seconds
    host: str
    pid: int
    note: str


class JournalRecord(BaseModel):
    """The journal's content. Mutable (the journal moves it along), every assignment validated."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    run_id: str
    step: int = Field(ge=0)
    publication_id: str
    state: StateName
    fingerprint: str | None = None
    """What was exported (plan digest, step, export settings): a different one is a new publication."""
    manifest_sha256: Sha256 | None = None
    num_files: int = Field(default=0, ge=0)
    num_bytes: int = Field(default=0, ge=0)
    uploaded: dict[str, UploadedObject] = Field(default_factory=dict)
    """path → {size, sha256} of each object this publication uploaded, recorded as each upload returned."""
    error: str | None = None
    history: list[JournalEvent] = Field(default_factory=list)
    updated_at: Seconds = 0.0
    format: Literal["rankflow-journal/1"]
    """Required when read: a record without it is no journal of this version."""

    @classmethod
    def new(cls, run_id: str, step: int, state: PublicationState, fingerprint: str | None = None) -> JournalRecord:
        """A new publication's record (a fresh publication id)."""
        return cls(
            run_id=run_id,
            step=step,
            publication_id=secrets.token_hex(8),
            state=state,
            fingerprint=fingerprint,
            format=JOURNAL_FORMAT,
        )

    def to_bytes(self) -> bytes:
        # The bytes of every journal written before this model (sorted keys, indented).
        return json.dumps(self.model_dump(), indent=2, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> JournalRecord:
        """The record in `data`; ValueError (what the readers catch) naming the first problem otherwise."""
        try:
            return cls.model_validate(json.loads(data))
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(map(str, first["loc"])) or "record"
            raise ValueError(f"not a {JOURNAL_FORMAT} record: {where}: {first['msg']}") from None


JOURNALS_DIR = "journals"
"""Beside the stagings: one directory of journals per store."""


def journal_path_for(staged_dir: Path, store: ObjectStore) -> Path:
    """The local journal of the publication staged at `staged_dir`, in `store`."""
    return records_dir(staged_dir.parent / JOURNALS_DIR, store) / f"{staged_dir.name}.json"


def mirror_path_for(store: ObjectStore, run_id: str, step: int) -> str:
    return store.path(journal_key(run_id, step))


class Journal:
    """One publication's journal: a durable local file, mirrored in the store.

    `store` None: a local file only (tests of the state machine without a store)."""

    def __init__(self, path: Path, store: ObjectStore | None, run_id: str, step: int):
        self.path, self.store, self.run_id, self.step = path, store, run_id, step
        self.name = f"{checkpoint_name(step)} of run {run_id}"
        self.record: JournalRecord | None = None
        self.mirror_error: str | None = None
        self.from_mirror = False
        """Whether the record came from the store's mirror (no local journal: another machine's)."""

    @classmethod
    def for_staging(cls, staged_dir: Path, store: ObjectStore, run_id: str, step: int) -> "Journal":
        return cls(journal_path_for(staged_dir, store), store, run_id, step).load()

    @property
    def mirror_path(self) -> str | None:
        return None if self.store is None else mirror_path_for(self.store, self.run_id, self.step)

    @property
    def state(self) -> PublicationState | None:
        return None if self.record is None else self.record.state

    @property
    def has_outcome(self) -> bool:
        return self.state in HAS_OUTCOME

    def load(self) -> "Journal":
        """Read the local journal; without one (a fresh machine), the store's mirror."""
        self.record, self.from_mirror = None, False
        if self.path.is_file():
            try:
                self.record = JournalRecord.from_bytes(self.path.read_bytes())
                return self
            except (ValueError, KeyError, TypeError):
                pass  # written atomically, so only tampering gets here: fall back to the mirror
        mirror_path = self.mirror_path
        if self.store is not None and mirror_path is not None:  # a mirror path is the store's
            try:
                with self.store.errors(f"read of the journal of {self.name}"):
                    mirror = self.store.get(self.store.key_of(mirror_path))
                if mirror is None:
                    return self
                data = mirror.data
            except OSError as error:
                # Unreachable store: start from nothing, which is safe (the commit
                # compares digests before it uploads anything).
                self.mirror_error = f"{type(error).__name__}: {error}"
                return self
            try:
                self.record, self.from_mirror = JournalRecord.from_bytes(data), True
            except (ValueError, KeyError, TypeError):
                self.record = None
        return self

    def forget(self) -> None:
        """Start a new publication: the loaded record (another publication's mirror) does not apply."""
        self.record, self.from_mirror = None, False

    # -- transitions -------------------------------------------------------

    def begin(
        self, fingerprint: str | None = None, note: str = "export started", *, outcome_lost: str | None = None
    ) -> None:
        """Start (or restart) preparing: a new publication after an abort, after a finished one of other bytes,
        or after a finished one whose checkpoint no longer verifies in the store (`outcome_lost`: why).

        A publication with its outcome and the same `fingerprint` is not
        prepared again (TransitionError) unless its outcome is lost: check
        `has_outcome` first.
        """
        current = self.state
        replaced = (
            current in HAS_OUTCOME
            and self.record is not None
            and (self.record.fingerprint != fingerprint or outcome_lost is not None)
        )
        if current is None or current is S.ABORTED or replaced:
            previous = self.record.publication_id if self.record else None
            why = f", whose checkpoint {outcome_lost}" if outcome_lost and current in HAS_OUTCOME else ""
            self.record = JournalRecord.new(self.run_id, self.step, S.PREPARING, fingerprint)
            self.from_mirror = False
            self._append(S.PREPARING, f"{note} (new publication{'; replaces ' + previous + why if previous else ''})")
            self._persist(mirror_required=False)
            return
        self.transition(S.PREPARING, note=note, fingerprint=fingerprint)

    def transition(
        self, target: PublicationState, *, note: str = "", mirror_required: bool = True, mirror: bool = True, **fields
    ) -> None:
        """Move to `target` if the state machine allows it; persist locally (durably), then mirror.

        `mirror=False` skips the store (a state the next transition supersedes at once)."""
        current = self.state
        if target not in ALLOWED[current]:
            raise TransitionError(_why(current, target, self.name, self.record.error if self.record else None))
        if self.record is None:
            self.record = JournalRecord.new(self.run_id, self.step, target)
        self.record.state = target
        for key, value in fields.items():
            setattr(self.record, key, value)
        if target is S.PREPARING:
            self.record.uploaded = {}  # a new export: earlier uploads are re-checked against the new manifest
        self._append(target, note)
        self._persist(mirror_required=mirror_required, mirror=mirror)

    def record_upload(self, path: str, size: int, sha256: str) -> None:
        """Note one finished upload (local journal only: the mirror gets it with the next transition)."""
        assert self.record is not None and self.record.state is S.COMMITTING
        self.record.uploaded[path] = UploadedObject(size=size, sha256=sha256)
        self.record.updated_at = time.time()
        self._write_local(self.record.to_bytes())

    def _append(self, state: PublicationState, note: str) -> None:
        assert self.record is not None  # a transition made or loaded it
        now = time.time()
        self.record.updated_at = now
        self.record.history.append(
            JournalEvent(state=state, time=now, host=socket.gethostname(), pid=os.getpid(), note=note)
        )

    def _write_local(self, data: bytes) -> None:
        write_durable(self.path, data)
        if self.store is not None:
            note_store(self.path.parent, self.store)

    def _persist(self, *, mirror_required: bool, mirror: bool = True) -> None:
        assert self.record is not None  # a transition made or loaded it
        data = self.record.to_bytes()
        self._write_local(data)
        mirror_path = self.mirror_path
        if self.store is None or mirror_path is None or not mirror:  # a mirror path is the store's
            return
        try:
            with self.store.errors(f"mirror of the journal of {self.name}"):
                self.store.put(self.store.key_of(mirror_path), data)  # overwrite: atomic on every backend
            self.mirror_error = None
        except OSError as error:
            # Preparing and aborting are local acts: an unreachable store must
            # not fail them; the next transition that needs the store mirrors.
            if mirror_required:
                raise
            self.mirror_error = f"{type(error).__name__}: {error}"


def read_mirrors(store: ObjectStore, run_id: str) -> tuple[list[JournalRecord], list[str]]:
    """Every publication journal mirrored under the run, and the ones that could not be read."""
    prefix = publications_dir_key(run_id)
    with store.errors(f"listing of the publications of run {run_id}"):
        keys = [store.key(prefix, name) for name in store.children(prefix) if name.endswith(".json")]
        contents = {key: store.get(key) for key in keys}
    records, problems = [], []
    for key in sorted(keys):
        found = contents[key]
        if found is None:  # removed between the listing and the read
            problems.append(f"{store.path(key)}: unreadable journal (it vanished after the listing)")
            continue
        try:
            records.append(JournalRecord.from_bytes(found.data))
        except (ValueError, KeyError, TypeError) as error:
            problems.append(f"{store.path(key)}: unreadable journal ({error})")
    return records, problems
