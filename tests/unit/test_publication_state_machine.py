"""A Hypothesis stateful test of the publication protocol, on a LocalStore and on a MemoryStore.

Random sequences of prepare (export), commit, abort, cleanup, a crash at any
point inside a commit or a cleanup, a staged file spoiled after its export,
and retries of all of these, over a few steps of one run. After every step:

- the journal's history only ever took allowed transitions;
- every checkpoint a reader lists verifies byte for byte (never a partial one),
  and a publication whose journal says COMMITTED or CLEANED is listed with
  exactly its own bytes (a retry never publishes stale bytes of equal size);
- a step that was never committed is not visible;
- LATEST never moves back and always names a checkpoint that verifies.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from infra.publication.checkpoints import list_checkpoints, verify_checkpoint
from infra.publication.cleanup import abort_publication, cleanup_staging
from infra.publication.commit import PublishSettings, StagedFileChanged, commit_checkpoint
from infra.publication.journal import ALLOWED, Journal, PublicationState, TransitionError, journal_path_for
from infra.publication.latest import read_latest
from infra.publication.manifests import checkpoint_name
from infra.store import MemoryStore, open_store
from trainer_core.run.manifest import write_manifest

RUN = "run-sm"
STEPS = (10, 20, 30)
COMMIT_EVENTS = 9  # lease, up to 3 uploads, manifest, manifest-written, latest-read, latest, committed
PAST_THE_MANIFEST = {"manifest-written", "latest-read", "latest", "committed"}
CLEANUP_EVENTS = 3
S = PublicationState


class SimulatedCrash(BaseException):
    """A crash at an injected point: BaseException, so no `except Exception` in the code absorbs it."""


def crash_at(index: int | None):
    count = [0]

    def observe(event: str) -> None:
        if index is not None:
            count[0] += 1
            if count[0] == index:
                raise SimulatedCrash(event)

    return observe


class PublicationMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="rankflow-sm-"))
        self.store = self.open_store()
        self.settings = PublishSettings(concurrency=1)
        self.contents: dict[int, dict[str, bytes]] = {}  # the bytes of each step's current staging
        self.published: dict[int, list[dict[str, bytes]]] = {}  # contents whose manifest reached the store
        self.latest_seen = -1

    def open_store(self):
        return open_store(str(self.root / "store"))

    def teardown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def staged(self, step: int) -> Path:
        return self.root / "work" / checkpoint_name(step)

    def journal(self, step: int) -> Journal:
        return Journal.for_staging(self.staged(step), self.store, RUN, step)

    # -- rules ------------------------------------------------------------------

    @rule(step=st.sampled_from(STEPS), seed=st.integers(0, 2**32 - 1), crash=st.booleans())
    def prepare(self, step, seed, crash):
        """The export stage: journal PREPARING, files, manifest, PREPARED (or a crash in between)."""
        journal = self.journal(step)
        if journal.has_outcome:
            return  # the export stage skips a publication that has its outcome
        journal.begin(fingerprint=f"fp-{seed}")
        rng = random.Random(seed)
        # Same names and sizes every time, other bytes: only digests tell publications apart.
        files = {f"shard-{i}.bin": rng.randbytes(64 + 16 * i) for i in range(3)}
        staged = self.staged(step)
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        for name, data in files.items():
            (staged / name).write_bytes(data)
        if crash:
            return  # died mid-export: PREPARING, with a staging that has no manifest
        write_manifest(staged, {"run_id": RUN, "step": step})
        journal.transition(S.PREPARED, mirror_required=False)
        self.contents[step] = files

    @rule(step=st.sampled_from(STEPS), crash=st.one_of(st.none(), st.integers(1, COMMIT_EVENTS)))
    def commit(self, step, crash):
        before = self.journal(step).state
        try:
            outcome = commit_checkpoint(
                self.staged(step), self.store, RUN, settings=self.settings, observer=crash_at(crash)
            )
        except SimulatedCrash as crash_event:
            # Before the lease's COMMITTING it is still what it was (PREPARED, or COMMITTING for the retry of a
            # crashed commit); after the journal's COMMITTED, committed.
            expected = {"lease": (S.PREPARED, before), "committed": (S.COMMITTED,)}.get(
                str(crash_event), (S.COMMITTING,)
            )
            assert self.journal(step).state in expected, (str(crash_event), self.journal(step).state)
            if str(crash_event) in PAST_THE_MANIFEST:  # the commit point was passed: readers may see it
                self.published.setdefault(step, []).append(self.contents[step])
            return
        except TransitionError:
            assert before in (S.ABORTED, S.PREPARING)
            return
        except FileNotFoundError:
            assert before is None or before is S.PREPARING  # nothing (complete) staged
            return
        except StagedFileChanged:
            assert self.journal(step).state is S.PREPARING
            return
        else:
            assert outcome.already_committed == (before in (S.COMMITTED, S.CLEANED))
        if not outcome.already_committed:
            self.published.setdefault(step, []).append(self.contents[step])

    @rule(step=st.sampled_from(STEPS))
    def abort(self, step):
        before = self.journal(step).state
        try:
            abort_publication(self.staged(step), self.store, RUN, step, reason="test abort")
        except TransitionError:
            assert (
                before not in (S.PREPARING, S.PREPARED)
                and before is not S.COMMITTING
                or self.visible_manifest_is_staged(step)
            )
            return
        except FileNotFoundError:
            assert before is S.COMMITTING  # comparing with a staging that is gone
            return
        assert before in (S.PREPARING, S.PREPARED, S.COMMITTING)
        assert self.journal(step).state is S.ABORTED

    def visible_manifest_is_staged(self, step: int) -> bool:
        remote = self.store.get(self.store.key(RUN, "checkpoints", checkpoint_name(step), "MANIFEST.json"))
        local = self.staged(step) / "MANIFEST.json"
        return remote is not None and local.is_file() and remote.data == local.read_bytes()

    @rule(step=st.sampled_from(STEPS), crash=st.one_of(st.none(), st.integers(1, CLEANUP_EVENTS)))
    def cleanup(self, step, crash):
        before = self.journal(step).state
        try:
            cleanup_staging(self.staged(step), self.store, RUN, settings=self.settings, observer=crash_at(crash))
        except SimulatedCrash:
            assert self.journal(step).state in (S.COMMITTED, S.CLEANED)
            return
        except TransitionError:
            assert before in (S.PREPARING, S.PREPARED, S.COMMITTING, None)
            return
        if before in (S.COMMITTED, S.CLEANED):
            assert self.journal(step).state is S.CLEANED and not self.staged(step).exists()

    @rule(step=st.sampled_from(STEPS), index=st.integers(0, 2))
    def spoil_a_staged_file(self, step, index):
        """A disk fault after the export: same size, other bytes."""
        path = self.staged(step) / f"shard-{index}.bin"
        if path.is_file():
            data = bytearray(path.read_bytes())
            data[0] ^= 0x5A
            path.write_bytes(bytes(data))

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def transitions_were_allowed(self):
        for step in STEPS:
            path = journal_path_for(self.staged(step), self.store)
            if not path.is_file():
                continue
            history = json.loads(path.read_text())["history"]
            states = [None] + [S(h["state"]) for h in history]
            for before, after in zip(states, states[1:]):
                allowed = ALLOWED[before] | ({S.PREPARING} if before in (S.ABORTED, S.COMMITTED, S.CLEANED) else set())
                assert after in allowed, (step, before, after)

    @invariant()
    def readers_see_whole_checkpoints_with_the_committed_bytes(self):
        listed = list_checkpoints(self.store, RUN)
        for name in listed:
            assert verify_checkpoint(self.store, RUN, name, full=True).verified  # never a partial checkpoint
        for step in STEPS:
            name = checkpoint_name(step)
            if name not in listed:
                # A publication that says it is committed is always visible.
                assert self.journal(step).state not in (S.COMMITTED, S.CLEANED), (step, self.journal(step).state)
                continue
            base = self.store.key(RUN, "checkpoints", name)
            found = {
                child: self.store.get(self.store.key(base, child)).data
                for child in self.store.children(base)
                if child != "MANIFEST.json"
            }
            # Only bytes whose commit passed the manifest are ever visible ...
            assert found in self.published.get(step, []), step
            # ... and a committed publication shows its own bytes.
            if self.journal(step).state in (S.COMMITTED, S.CLEANED):
                assert found == self.published[step][-1]

    @invariant()
    def latest_only_moves_forward(self):
        latest = read_latest(self.store, RUN)
        step = -1 if latest is None else latest["step"]
        assert step >= self.latest_seen
        self.latest_seen = step
        if latest is not None:
            assert verify_checkpoint(self.store, RUN, latest["checkpoint"], full=True).verified


TestPublicationMachine = PublicationMachine.TestCase
TestPublicationMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class MemoryPublicationMachine(PublicationMachine):
    """The same rules and invariants on a MemoryStore: the protocol holds on any backend, not only on a disk."""

    def open_store(self):
        return MemoryStore()

    def teardown(self):
        self.store.close()
        super().teardown()


TestMemoryPublicationMachine = MemoryPublicationMachine.TestCase
TestMemoryPublicationMachine.settings = TestPublicationMachine.settings
