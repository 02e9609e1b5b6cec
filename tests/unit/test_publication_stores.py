"""Local publication records are per store, and a recorded outcome is checked against the store (MemoryStore, LocalStore).

- a work dir's journal of a step committed to store A says nothing about store
  B: committing the same staging to B uploads everything to B;
- a journal that says COMMITTED or CLEANED is not taken for the truth: if the
  checkpoint in the store no longer verifies (a byte flipped, a file gone),
  the commit says so (CheckpointDoesNotVerify, one of EXPORT_AGAIN) instead of
  reporting the damaged checkpoint committed;
- the commit and cleanup stages retry what a retry can change, never what it cannot.
"""

from __future__ import annotations

import contextlib

import pytest
from prefect.states import Failed

from infra.publication.checkpoints import verify_checkpoint
from infra.publication.cleanup import cleanup_staging
from infra.publication.commit import EXPORT_AGAIN, CheckpointDoesNotVerify, commit_checkpoint
from infra.publication.journal import Journal, PublicationState, journal_path_for
from infra.publication.manifests import ManifestError
from infra.runs.local_records import store_key
from infra.runs.run_lease import RunLeaseLost
from infra.store import MemoryStore, open_store
from infra.store.base import StorageTimeoutError
from infra.store.lease import LeaseLostError
from tasks.retry_policy import retry_unless_final
from tests.publication_helpers import RUN, random_files, stage

NAME = "step-00000010"


def stored(store, path: str) -> bytes | None:
    found = store.get(store.key(RUN, "checkpoints", NAME, path))
    return None if found is None else found.data


@pytest.fixture(params=["memory", "local"])
def new_store(request, tmp_path):
    """Makes fresh stores of one backend (these tests use a store through its protocol only)."""
    with contextlib.ExitStack() as stack:

        def make(name: str):
            if request.param == "memory":
                return stack.enter_context(MemoryStore())
            return open_store(str(tmp_path / name))

        yield make


def test_a_journal_of_one_store_is_not_another_stores(new_store, tmp_path):
    files = random_files(2, 5000)
    first, second = new_store("a"), new_store("b")
    assert store_key(first) != store_key(second)
    staged = stage(tmp_path, 10, files)
    commit_checkpoint(staged, first, RUN)
    assert Journal.for_staging(staged, first, RUN, 10).state is PublicationState.COMMITTED
    assert Journal.for_staging(staged, second, RUN, 10).state is None  # nothing is known of the other store
    outcome = commit_checkpoint(staged, second, RUN)
    assert not outcome.already_committed and outcome.num_files_uploaded == len(files)
    assert verify_checkpoint(second, RUN, NAME, full=True).verified
    assert all(stored(second, name) == data for name, data in files.items())
    assert cleanup_staging(staged, second, RUN).state == "CLEANED"
    assert Journal.for_staging(staged, first, RUN, 10).state is PublicationState.COMMITTED  # its own record kept
    assert journal_path_for(staged, first) != journal_path_for(staged, second)


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_recorded_outcome_whose_checkpoint_does_not_verify_is_not_reported_committed(new_store, tmp_path, damage):
    store = new_store("store")
    files = random_files(2, 5000)
    staged = stage(tmp_path, 10, files)
    commit_checkpoint(staged, store, RUN)
    victim = sorted(files)[0]
    victim_key = store.key(RUN, "checkpoints", NAME, victim)
    if damage == "flip":
        data = bytearray(stored(store, victim))
        data[7] ^= 0x01
        store.put(victim_key, bytes(data))
    else:
        store.remove([victim_key])
    assert Journal.for_staging(staged, store, RUN, 10).has_outcome
    with pytest.raises(CheckpointDoesNotVerify, match=f"{victim}.*exported again") as raised:
        commit_checkpoint(staged, store, RUN)
    assert isinstance(raised.value, EXPORT_AGAIN)
    # The publication that replaces it (what the export stage starts) commits the right bytes again.
    journal = Journal.for_staging(staged, store, RUN, 10)
    journal.begin(None, outcome_lost="does not verify")
    journal.transition(PublicationState.PREPARED, mirror_required=False)
    again = commit_checkpoint(staged, store, RUN)
    assert again.uploaded == (victim,)
    assert verify_checkpoint(store, RUN, NAME, full=True).verified and stored(store, victim) == files[victim]
    history = [h.state for h in Journal.for_staging(staged, store, RUN, 10).record.history]
    assert history == ["PREPARING", "PREPARED", "COMMITTING", "COMMITTED"]  # a new publication, not a revived one


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (ManifestError("MANIFEST.json: refused"), False),
        (FileNotFoundError("gone"), False),
        (RunLeaseLost("another run holds the run lease"), False),
        (ConnectionError("the store is unreachable"), True),
        (StorageTimeoutError("no answer"), True),
        (CheckpointDoesNotVerify("the store lost bytes"), True),
        (LeaseLostError("the finalizer lease of run x is not held by me"), True),
    ],
)
def test_publication_stages_retry_only_what_a_retry_can_change(error, retried):
    assert retry_unless_final(None, None, Failed(data=error)) is retried
