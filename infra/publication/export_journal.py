"""The export half of a publication's journal: verify or repair, begin, abort, PREPARED.

The export stage (tasks/export.py) stages a step's checkpoint; these are the
journal transitions it makes, so that every transition of the state machine
(infra/publication/journal.py) is made here, in infra/publication/:

- a publication that already has its outcome (committed earlier: a re-run, a
  retried flow) of the same export (`fingerprint`) is not exported again
  while its checkpoint verifies in the store (the confirm check of
  infra/publication/checkpoints.py); one whose checkpoint does not (bytes
  changed, objects gone) is a lost outcome, and `begin` starts a new
  publication of the step that replaces it;
- PREPARING before the launch (`begin`), PREPARED once the staged manifest is
  there and parses (`prepared`), ABORTED with its temporaries removed when a rank fails
  (`abort`).

The journal is the one of this store (infra/runs/local_records.py): the same
work dir used with another `storage.url` exports the step for that store.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from infra.publication.checkpoints import verify_checkpoint
from infra.publication.cleanup import abort_publication
from infra.publication.commit import checkpoint_name
from infra.publication.journal import Journal, JournalRecord, PublicationState
from infra.publication.manifests import MANIFEST_FILE, CheckpointManifest, parse_manifest
from infra.store.base import ObjectStore


class ExportJournal:
    """The journal of one step's export to one store, identified by what decides its bytes (`fingerprint`)."""

    def __init__(self, staged_dir: Path, store: ObjectStore, run_id: str, step: int, fingerprint: str):
        self.staged_dir, self.store, self.fingerprint = staged_dir, store, fingerprint
        self.journal = Journal.for_staging(staged_dir, store, run_id, step)
        self.outcome_lost: str | None = None
        """Why a recorded outcome is no longer true (its checkpoint does not verify), once `verified_outcome` found it."""

    def verified_outcome(self) -> JournalRecord | None:
        """The record of this export's publication when it has its outcome and its checkpoint verifies in the store.

        None when there is work to do; a recorded outcome whose checkpoint does
        not verify sets `outcome_lost`, and `begin` replaces that publication.
        """
        record = self.journal.record
        if not (self.journal.has_outcome and record is not None and record.fingerprint in (self.fingerprint, None)):
            return None
        report = verify_checkpoint(self.store, self.journal.run_id, checkpoint_name(self.journal.step), confirm=True)
        if report.verified:
            return record
        self.outcome_lost = f"does not verify in the store ({'; '.join(report.problems)})"
        return None

    def begin(self) -> None:
        """PREPARING: the export launches (a new publication after an abort or a lost outcome)."""
        self.journal.begin(self.fingerprint, outcome_lost=self.outcome_lost)

    def abort(self, error: BaseException) -> None:
        """ABORTED: a rank failed; every rank has aborted, and the temporaries are removed."""
        abort_publication(
            self.staged_dir, self.store, self.journal.run_id, self.journal.step, reason=str(error).splitlines()[0]
        )

    def prepared(self, step: int) -> CheckpointManifest:
        """PREPARED: the staged manifest of `step` is there; returns it (parsed, checked against the run and step).

        A local act: a store that does not answer is mirrored at the next transition."""
        manifest_path = self.staged_dir / MANIFEST_FILE
        manifest_bytes = manifest_path.read_bytes()
        manifest = parse_manifest(manifest_bytes, str(manifest_path), run_id=self.journal.run_id, step=step)
        self.journal.transition(
            PublicationState.PREPARED,
            note="export staged",
            mirror_required=False,
            manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
            num_files=len(manifest.files),
            num_bytes=manifest.num_bytes,
        )
        return manifest
