"""PlannedRun carries the config's own sections: the limits a task reads are the config's, not copied defaults."""

from __future__ import annotations

from infra.publication.commit import PublishSettings
from infra.runs.run_state import StateSettings
from tasks.fencing import fenced_settings
from tasks.outcomes import PlannedRun
from tasks.plan import _planned
from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.run.plan import Plan, SegmentPlan


def _plan_like(steps: list[tuple[int, int]]) -> Plan:
    segments = [
        SegmentPlan(
            index=i, start_step=start, end_step=end, shard_file=f"plan/segment-{i:04d}.safetensors", num_loss_tokens=1
        )
        for i, (start, end) in enumerate(steps)
    ]
    return Plan(
        run_id="tiny-0123456789ab",
        digest="d" * 64,
        config={},
        num_conversations=1,
        num_truncated=0,
        num_dropped=0,
        num_tokens=1,
        segments=segments,
    )


def _config(tmp_path, **sections):
    return config_from_dict(tiny_tree(tmp_path, **sections), config_dir=tmp_path)


def test_every_limit_a_task_reads_is_the_configs(tmp_path):
    config = _config(
        tmp_path,
        storage={"timeout_s": 7, "request_timeout_s": 3},
        train={"stall_timeout_s": 11, "segment_timeout_s": 13, "nproc_per_node": 1},
        export={"timeout_s": 17},
    )
    planned = _planned(_plan_like([(0, 2), (2, 4), (4, 5)]), tmp_path / "run", config, "token-1")
    assert (planned.storage.timeout_s, planned.storage.request_timeout_s) == (7, 3)
    assert (planned.train.stall_timeout_s, planned.train.segment_timeout_s, planned.export.timeout_s) == (11, 13, 17)
    assert planned.storage.url == config.storage.url
    assert (planned.num_segments, planned.total_steps) == (3, 5)
    published, stated = fenced_settings(planned, PublishSettings), fenced_settings(planned, StateSettings)
    assert isinstance(published, PublishSettings) and isinstance(stated, StateSettings)
    for settings in (published, stated):
        assert settings.timeout_s == 7 and settings.finalizer.run_lease_token == "token-1"


def test_a_planned_run_survives_the_json_a_deployed_node_run_gets(tmp_path):
    # tasks/nodes/work_pool.py sends model_dump(mode="json"); flows/node.py validates it back.
    config = _config(
        tmp_path,
        train={
            "nnodes": 2,
            "nproc_per_node": 1,
            "logical_dp": 2,
            "rdzv_endpoint": "127.0.0.1:29400",
            "node_deployment": "rankflow-node/tiny",
            "stall_timeout_s": 42,
        },
    )
    planned = _planned(_plan_like([(0, 3)]), tmp_path / "run", config, None)
    back = PlannedRun.model_validate(planned.model_dump(mode="json"))
    assert back == planned
    assert back.train.rdzv_endpoint == "127.0.0.1:29400" and back.train.stall_timeout_s == 42
    assert back.train.objective == config.train.objective  # defaulted from data.kind, kept across the boundary


def test_the_node_flows_parameter_schema_accepts_a_planned_runs_json(tmp_path):
    # What a deployment with an enforced parameter schema checks before a worker starts the node run.
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from flows.node import node_flow

    config = _config(
        tmp_path,
        train={
            "nnodes": 2,
            "nproc_per_node": 1,
            "logical_dp": 2,
            "rdzv_endpoint": "127.0.0.1:29400",
            "node_deployment": "rankflow-node/tiny",
        },
    )
    planned = _planned(_plan_like([(0, 3)]), tmp_path / "run", config, "token-1")
    schema = parameter_schema(node_flow.fn).model_dump_for_openapi()
    parameters = {
        "planned": planned.model_dump(mode="json"),
        "segment_index": 0,
        "node_rank": 1,
        "rdzv_id": "r",
        "attempt": "a",
    }
    validate(parameters, schema, raise_on_error=True, ignore_required=False)
    assert {"TrainSection", "StorageSection", "ExportSection"} <= set(schema["definitions"])
