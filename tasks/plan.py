"""The plan stage: validate, tokenize and shard (pure), then write the plan; reuse a plan already on disk.

Computing the plan writes nothing for the run (only the shared data cache), so
the flow can learn the run id (the plan's digest) and take the run lease
(infra/runs/run_lease.py) before the first byte lands in the run directory. Once
written, the plan is also stored with the run, so a segment on another worker
(an empty work dir) resumes from the store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.runs import ledger
from trainer_core.config import RunConfig
from trainer_core.run.parent_record import run_parent
from trainer_core.run.plan import Plan, build_plan, read_plan, run_dir_for, write_plan
from trainer_core.run.plan_shards import StagedShards

from .outcomes import PlannedRun
from .retry_policy import retry_if_retriable
from .run_state import publish_plan
from .stage import stage_task


@dataclass(frozen=True)
class ComputedPlan:
    """A plan in memory, not yet written: its run id is known, its run directory untouched."""

    plan: Plan
    shards: StagedShards
    """Laid out and staged under `run.work_dir/cache`, one file a segment; `write_plan` puts them in the run dir."""
    compute_s: float

    @property
    def run_id(self) -> str:
        return self.plan.run_id


def _planned(plan: Plan, run_dir: Path, config: RunConfig, lease_token: str | None) -> PlannedRun:
    return PlannedRun(
        run_id=plan.run_id,
        digest=plan.digest,
        run_dir=str(run_dir),
        segment_steps=[(s.start_step, s.end_step) for s in plan.segments],
        lease_token=lease_token,
        train=config.train,
        export=config.export,
        storage=config.storage,
        tracking=config.tracking,
    )


def compute_plan_fn(config: RunConfig) -> ComputedPlan:
    """Build the plan in memory; bad input raises here, and nothing of the run is written."""
    started = time.perf_counter()
    plan, shards = build_plan(config)
    return ComputedPlan(plan=plan, shards=shards, compute_s=time.perf_counter() - started)


def write_plan_fn(config: RunConfig, computed: ComputedPlan, lease_token: str | None = None) -> PlannedRun:
    """Write the plan unless the same plan (same digest) is already on disk; record it in the ledger.

    The caller holds the run lease (`lease_token`) when there is one.
    """
    started = time.perf_counter()
    plan = computed.plan
    run_dir = run_dir_for(config, plan.run_id)
    # The same digest means the same shards; rewriting plan.json refreshes what
    # the digest leaves out (storage, timeouts), so a re-run resumes this run.
    reused = (run_dir / "plan.json").is_file() and read_plan(run_dir).digest == plan.digest
    write_plan(plan, computed.shards, run_dir)
    ledger.record(
        run_dir,
        "plan",
        "reused" if reused else "completed",
        run_id=plan.run_id,
        digest=plan.digest,
        num_conversations=plan.num_conversations,
        num_tokens=plan.num_tokens,
        num_truncated=plan.num_truncated,
        num_dropped=plan.num_dropped,
        num_segments=len(plan.segments),
        data_kind=plan.data_kind,
        packed=plan.packed,
        num_flat_groups=plan.num_flat_groups,
        num_eval_conversations=plan.num_eval_conversations,
        eval_loss_tokens=plan.eval_loss_tokens,
        stage_digests=plan.stage_digests,
        parent=run_parent(config),  # the committed checkpoint model.path named (None: a plain model)
        wall_s=computed.compute_s + time.perf_counter() - started,
    )
    planned = _planned(plan, run_dir, config, lease_token)
    publish_plan(planned)  # a segment on another worker (an empty work dir) resumes from the store
    return planned


def plan_run_fn(config: RunConfig) -> PlannedRun:
    """Compute and write the plan without a run lease (tests and benchmarks that drive stages directly)."""
    return write_plan_fn(config, compute_plan_fn(config))


compute_plan = task(name="plan", task_run_name="plan-{config.run.name}", cache_policy=NO_CACHE)(compute_plan_fn)
# Writing the plan is idempotent (the same digest, the same bytes; stored objects are skipped when they
# verify), so a storage hiccup during its upload is retried like any other stage's.
write_plan_task = stage_task(
    "plan-write",
    run_name="plan-write-{computed.run_id}",
    retries=2,
    retry_delay_seconds=[2, 5],
    retry_condition_fn=retry_if_retriable,
    rides_out=False,
)(write_plan_fn)
