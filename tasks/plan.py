"""The plan stage: validate, tokenize and shard; reuse a plan already on disk."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import ledger
from trainer_core.config import RunConfig
from trainer_core.plan import Plan, build_plan, read_plan, run_dir_for, write_plan

from .outcomes import PlannedRun


def _planned(plan: Plan, run_dir: Path, config: RunConfig) -> PlannedRun:
    return PlannedRun(
        run_id=plan.run_id, digest=plan.digest, run_dir=str(run_dir), num_segments=len(plan.segments),
        segment_steps=[(s.start_step, s.end_step) for s in plan.segments],
        nproc_per_node=config.train.nproc_per_node, segment_timeout_s=config.train.segment_timeout_s,
        storage_url=config.storage.url, stall_timeout_s=config.train.stall_timeout_s,
        export_timeout_s=config.export.timeout_s, storage_timeout_s=config.storage.timeout_s,
        storage_request_timeout_s=config.storage.request_timeout_s,
        nnodes=config.train.nnodes, rdzv_endpoint=config.train.rdzv_endpoint,
        node_deployment=config.train.node_deployment,
    )


def plan_run_fn(config: RunConfig) -> PlannedRun:
    """Build the plan; write it unless the same plan (same digest) is already on disk."""
    started = time.perf_counter()
    plan, shards = build_plan(config)  # bad input raises here, before anything is written
    run_dir = run_dir_for(config, plan.run_id)
    # The same digest means the same shards; rewriting plan.json refreshes what
    # the digest leaves out (storage, timeouts), so a re-run resumes this run.
    reused = (run_dir / "plan.json").is_file() and read_plan(run_dir).digest == plan.digest
    write_plan(plan, shards, run_dir)
    ledger.record(
        run_dir, "plan", "reused" if reused else "completed", run_id=plan.run_id, digest=plan.digest,
        num_conversations=plan.num_conversations, num_tokens=plan.num_tokens, num_truncated=plan.num_truncated,
        num_dropped=plan.num_dropped, num_segments=len(plan.segments), data_kind=plan.data_kind, packed=plan.packed,
        num_flat_groups=plan.num_flat_groups, stage_digests=plan.stage_digests, wall_s=time.perf_counter() - started,
    )
    return _planned(plan, run_dir, config)


plan_run = task(name="plan", cache_policy=NO_CACHE)(plan_run_fn)
