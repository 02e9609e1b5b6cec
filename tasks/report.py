"""The report stage: the run's summary, its Prefect artifacts and the stored ledger."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra import ledger
from infra.objects import put_small
from infra.publication import CommitOutcome
from infra.storage import Deadline, storage_errors

from ._store import store_for
from .outcomes import PlannedRun, SegmentOutcome


def _artifact_key(run_id: str, what: str) -> str:
    # Artifact keys allow lowercase letters, digits and dashes only.
    return "".join(c if c.isalnum() else "-" for c in f"{run_id}-{what}".lower())


def publish_ledger_fn(planned: PlannedRun) -> str:
    """Upload the ledger beside the run's checkpoints, within the storage time limits; returns its location."""
    store = store_for(planned)
    data = (Path(planned.run_dir) / ledger.LEDGER_FILE).read_bytes()
    deadline = Deadline(planned.storage_timeout_s, f"upload of the ledger of run {planned.run_id}", store)
    with storage_errors(store, f"upload of the ledger of run {planned.run_id}"):
        put_small(store, store.path(planned.run_id, ledger.LEDGER_FILE), data, deadline)
    return store.url_of(planned.run_id, ledger.LEDGER_FILE)


@task(name="report", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[2, 5])
def report(planned: PlannedRun, segments: list[SegmentOutcome], commits: list[CommitOutcome]) -> str:
    create_table_artifact(
        key=_artifact_key(planned.run_id, "segments"),
        table=[
            {"segment": s.segment, "steps": f"{s.start_step}-{s.end_step - 1}", "first_loss": round(s.losses[0], 4),
             "last_loss": round(s.losses[-1], 4), "tokens": s.num_tokens, "tokens_per_s": round(s.tokens_per_s),
             "train_s": round(s.train_s, 2), "launch_wall_s": round(s.launch_wall_s, 2), "reused": s.reused}
            for s in segments
        ],
        description=f"Segment metrics of run {planned.run_id}",
    )
    if commits:
        lines = [f"| step {c.step} | `{c.checkpoint_url}` | {c.num_files_uploaded} uploaded, {c.num_files_skipped} skipped |" for c in commits]
        create_markdown_artifact(
            key=_artifact_key(planned.run_id, "checkpoint"),
            markdown="## Committed checkpoints\n\n| step | location | files |\n|---|---|---|\n" + "\n".join(lines),
            description=f"Newest checkpoint: {commits[-1].checkpoint_url}",
        )
    return publish_ledger_fn(planned)
