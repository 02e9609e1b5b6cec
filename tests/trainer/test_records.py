"""The records across the process boundary (trainer_core/run/records.py): the bytes of today's files, read both ways.

Each fixture is a file as the dict-building writers before these models wrote
it (`json.dumps(result, indent=2)`; `meta.json` with sorted keys): the models
read it and write the same bytes again, NaN included.
"""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from trainer_core.run.records import ExportResult, SegmentResult, StateMeta, export_result_path

OLD_SEGMENT = {
    "segment": 1,
    "start_step": 3,
    "end_step": 6,
    "losses": [2.5, float("nan"), 2.25],
    "grad_norms": [1.0, float("inf"), 0.5],
    "skipped_steps": [4],
    "num_skipped_steps": 1,
    "num_stale_trajectories": 2,
    "num_tokens": 960,
    "tokens_per_s": 1234.5,
    "setup_s": 1.25,
    "train_s": 0.75,
    "save_s": 0.125,
    "peak_saved_bytes": 4096,
    "planner_misses": 3,
    "planner": {
        "choices": {"retain": 5, "offload": 1},
        "num_misses": 3,
        "miss_reports": ["segment-0001-rank-0-miss-001.json"],
        "budget_bytes": None,
        "forward_s_per_token": 2.5e-06,
        "pack_s_per_byte": None,
        "restore_s_per_byte": None,
    },
    "world_size": 2,
    "logical_dp": 4,
    "reduction": "deterministic",
    "threads_per_process": 1,
    "state_dir": "/work/run/state/segment-0001",
    "state_bytes": 123456,
}
OLD_EXPORT = {
    "segment": 1,
    "step": 6,
    "out_dir": "/work/run/export/step-00000006",
    "reused": False,
    "weights_sha256": "ab" * 32,
    "export_s": 3.5,
}
OLD_META = {"next_step": 6, "segment": 1, "plan_digest": "cd" * 32}


def test_a_segment_result_reads_and_rewrites_today_s_bytes_nan_included():
    old = json.dumps(OLD_SEGMENT, indent=2)
    assert "NaN" in old and "Infinity" in old
    result = SegmentResult.from_json(old)
    assert math.isnan(result.losses[1]) and result.planner.choices == {"retain": 5, "offload": 1}
    # A file from before the padding cut has no num_token_slots: it reads as 0, and today's bytes add it in place;
    # one from before the learning-rate schedules has no learning_rates: it reads as []; one from before
    # evaluation has no eval_steps or eval_losses: both read as [].
    assert result.num_token_slots == 0 and result.learning_rates == []
    assert result.eval_steps == [] and result.eval_losses == []
    today = {}
    for key, value in OLD_SEGMENT.items():
        today[key] = value
        if key == "num_tokens":
            today["num_token_slots"] = 0
        if key == "grad_norms":
            today |= {"learning_rates": [], "eval_steps": [], "eval_losses": []}
    assert result.to_json() == json.dumps(today, indent=2)
    today["num_token_slots"] = 1024
    assert SegmentResult.from_json(json.dumps(today, indent=2)).to_json() == json.dumps(today, indent=2)


def test_an_export_result_and_a_state_meta_read_and_rewrite_today_s_bytes(tmp_path):
    old = json.dumps(OLD_EXPORT, indent=2)
    assert ExportResult.from_json(old).to_json() == old
    out_dir = tmp_path / "export" / "step-00000006"
    ExportResult.from_json(old).write(export_result_path(out_dir))
    assert (tmp_path / "export" / "step-00000006.result.json").read_text() == old
    meta = StateMeta.model_validate(json.loads(json.dumps(OLD_META, indent=2, sort_keys=True)))
    assert json.dumps(meta.model_dump(), indent=2, sort_keys=True) == json.dumps(OLD_META, indent=2, sort_keys=True)


def test_a_result_written_before_the_memory_planner_still_reads():
    older = {k: v for k, v in OLD_SEGMENT.items() if k not in ("planner_misses", "planner")}
    result = SegmentResult.model_validate(older)
    assert result.planner_misses == 0 and result.planner is None


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_tokens": True}, "num_tokens"),  # strict: a bool is not a count
        ({"num_tokens": 9.5}, "num_tokens"),
        ({"losses": "2.5"}, "losses"),
        ({"renamed_field": 1}, "renamed_field"),  # a key one side renamed is refused, not ignored
        ({"planner": {**OLD_SEGMENT["planner"], "num_misses": "3"}}, "planner.num_misses"),
    ],
)
def test_a_result_of_another_shape_is_refused_naming_the_field(change, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        SegmentResult.model_validate({**OLD_SEGMENT, **change})


def test_a_result_missing_a_field_is_refused():
    with pytest.raises(ValidationError, match="state_bytes"):
        SegmentResult.model_validate({k: v for k, v in OLD_SEGMENT.items() if k != "state_bytes"})
    with pytest.raises(ValidationError, match="weights_sha256"):
        ExportResult.model_validate({k: v for k, v in OLD_EXPORT.items() if k != "weights_sha256"})
