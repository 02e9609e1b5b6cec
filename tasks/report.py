"""The report stage: the run's loss curve, its Prefect artifacts and the stored ledger.

The loss curve (PNG) is written beside the ledger in the run directory and
uploaded with it beside the run's checkpoints; a markdown artifact links the
newest committed checkpoint, the ledger and the curve (and shows the curve
inline, so it is visible in the UI without access to the store). Artifacts
are kept by key, one per flow run (`tasks.live`); a failure report this flow
run still shows is marked settled, since the run completed after it.
"""

from __future__ import annotations

import base64
from pathlib import Path

from infra.publication.commit import CommitOutcome
from infra.runs import ledger
from infra.runs.loss_curve import LOSS_CURVE_FILE, write_loss_curve
from infra.store import open_store
from infra.store.base import Deadline
from infra.store.objects import put_small

from .live import (
    artifact_key,
    artifact_link,
    artifact_url,
    flow_run_artifact,
    upsert_markdown_artifact,
    upsert_table_artifact,
)
from .outcomes import PlannedRun, SegmentOutcome
from .retry_policy import retry_unless_fenced
from .stage import Stage, stage_task


def publish_run_files_fn(planned: PlannedRun) -> dict[str, str]:
    """Upload the ledger and the loss curve beside the run's checkpoints, within the storage time limits.

    Returns their locations.
    """
    store = open_store(planned.storage)
    run_dir = Path(planned.run_dir)
    what = f"upload of the ledger and loss curve of run {planned.run_id}"
    deadline = Deadline(planned.storage.timeout_s, what, store)
    locations = {}
    with store.errors(what):
        for name in (ledger.LEDGER_FILE, LOSS_CURVE_FILE):
            if (run_dir / name).is_file():
                data = (run_dir / name).read_bytes()
                if name == ledger.LEDGER_FILE:  # this worker's entries join the run's stored history
                    data = ledger.merge(_stored_bytes(store, store.path(planned.run_id, name)), data)
                put_small(store, store.path(planned.run_id, name), data, deadline)
                locations[name] = store.url_of(planned.run_id, name)
    return locations


def _stored_bytes(store, path: str) -> bytes:
    found = store.get(store.key_of(path))
    return b"" if found is None else found.data


def write_run_loss_curve(planned: PlannedRun, segments: list[SegmentOutcome]) -> Path:
    steps = [s.start_step + i for s in segments for i in range(len(s.losses))]
    losses = [loss for s in segments for loss in s.losses]
    rates = [rate for s in segments for rate in s.learning_rates]
    evaluated = [(step, loss) for s in segments for step, loss in zip(s.eval_steps, s.eval_losses)]
    return write_loss_curve(
        Path(planned.run_dir) / LOSS_CURVE_FILE,
        steps,
        losses,
        [s.start_step for s in segments],
        title=f"{planned.run_id}: loss per optimizer step",
        learning_rates=rates if len(rates) == len(steps) else None,  # a segment trained before rates were kept
        eval_points=evaluated,
    )


def summary_markdown(planned: PlannedRun, commits: list[CommitOutcome], locations: dict[str, str], curve: Path) -> str:
    checkpoint = artifact_link(commits[-1].checkpoint_url) if commits else "none committed"
    inline = base64.b64encode(curve.read_bytes()).decode()
    return (
        f"## Run {planned.run_id}\n\n"
        f"| what | where |\n|---|---|\n"
        f"| newest committed checkpoint (step {commits[-1].step if commits else '—'}) | {checkpoint} |\n"
        f"| ledger | {artifact_link(locations[ledger.LEDGER_FILE])} |\n"
        f"| loss curve | {artifact_link(locations[LOSS_CURVE_FILE])} |\n\n"
        f"![loss curve of {planned.run_id}](data:image/png;base64,{inline})\n"
    )


SETTLED = "## Settled: the run completed after this failure"


def settle_failure_report(planned: PlannedRun) -> bool:
    """Mark this flow run's failure report settled (the run completed after it); False when it has none.

    The report keeps its details (stage, rank, cause, attempt): only its title
    says that the failure is history now, and every failed attempt stays in the ledger.
    """
    key = artifact_key(planned.run_id, "failure")
    existing = flow_run_artifact(key)
    if existing is None:
        return False
    if not str(existing.data).startswith(SETTLED):
        upsert_markdown_artifact(
            key,
            f"{SETTLED}\n\nRun `{planned.run_id}` completed; the last failed attempt before it was:\n\n{existing.data}",
            f"Settled: run {planned.run_id} completed after a failed attempt ({existing.description})",
        )
    return True


@stage_task(
    "report",
    run_name="report-{planned.run_id}",
    retries=2,
    retry_delay_seconds=[2, 5],
    retry_condition_fn=retry_unless_fenced,
)
def report(planned: PlannedRun, segments: list[SegmentOutcome], commits: list[CommitOutcome]) -> dict[str, str]:
    upsert_table_artifact(
        artifact_key(planned.run_id, "segments"),
        [
            {
                "segment": s.segment,
                "steps": f"{s.start_step}-{s.end_step - 1}",
                "first_loss": round(s.losses[0], 4),
                "last_loss": round(s.losses[-1], 4),
                **({"eval_loss": round(s.eval_losses[-1], 4)} if s.eval_losses else {}),
                "tokens": s.num_tokens,
                "tokens_per_s": round(s.tokens_per_s),
                "train_s": round(s.train_s, 2),
                "launch_wall_s": round(s.launch_wall_s, 2),
                "reused": s.reused,
            }
            for s in segments
        ],
        f"Segment metrics of run {planned.run_id}",
    )
    Stage.enter(planned, "report", "report")  # the table above is an artifact; from here it writes the run's files
    curve = write_run_loss_curve(planned, segments)
    locations = publish_run_files_fn(planned)
    upsert_markdown_artifact(
        artifact_key(planned.run_id, "checkpoint"),
        summary_markdown(planned, commits, locations, curve),
        f"Newest checkpoint: {artifact_url(commits[-1].checkpoint_url)}" if commits else "No checkpoint committed",
    )
    settle_failure_report(planned)
    return locations
