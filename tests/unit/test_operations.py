"""Pure pieces of run operations: progress records, the watchdog clock, failure classes, retries, figures, the loss curve."""

from __future__ import annotations

import math
import struct

from prefect.states import Failed

from flows.run_record import RunRecord
from infra.launch.failures import Failure, FailureClass, classify_exception, diagnose_launch
from infra.launch.launcher import LaunchError, LaunchResult, parse_rank_exits, parse_root_cause_rank
from infra.runs.loss_curve import write_loss_curve
from tasks.outcomes import SegmentOutcome
from tasks.retry_policy import retry_if_retriable
from tasks.watchdog import SETUP_GRACE_S, SegmentWatch
from trainer_core.data import DataError
from trainer_core.run.progress import ProgressReader, ProgressWriter


def test_progress_records_are_read_whole_and_a_restart_is_followed(tmp_path):
    path = tmp_path / "p.jsonl"
    writer = ProgressWriter(path, rank=0)
    reader = ProgressReader(path)
    writer.write("ready", start_step=0)
    with path.open("ab") as handle:
        handle.write(b'{"event": "step", "st')  # half a record: not returned yet
    assert [r["event"] for r in reader.new_records()] == ["ready"]
    with path.open("ab") as handle:
        handle.write(b'ep": 0}\n')
    assert reader.new_records() == [{"event": "step", "step": 0}]
    writer.close()
    ProgressWriter(path, rank=0).write("ready", start_step=3)  # a retried launch starts the file over
    assert [r["start_step"] for r in reader.new_records()] == [3]
    ProgressWriter(tmp_path / "other.jsonl", rank=1).write("ready")  # only rank 0 writes
    assert not (tmp_path / "other.jsonl").exists()


def test_watchdog_fires_only_after_stall_timeout_without_progress(tmp_path):
    now = [100.0]
    path = tmp_path / "p.jsonl"
    seen = []
    watch = SegmentWatch(path, stall_timeout_s=10, on_records=seen.extend, clock=lambda: now[0])
    now[0] = 100.0 + SETUP_GRACE_S - 1
    assert watch() is None  # setup gets at least SETUP_GRACE_S
    now[0] = 100.0 + SETUP_GRACE_S + 1
    assert "setup never finished" in watch()
    now[0] = 109.0
    watch = SegmentWatch(path, stall_timeout_s=10, on_records=seen.extend, clock=lambda: now[0])
    writer = ProgressWriter(path, rank=0)
    writer.write("ready", start_step=0)
    now[0] = 112.0
    assert watch() is None and [r["event"] for r in seen] == ["ready"]
    now[0] = 121.0
    assert watch() is None  # 9 s since the last record
    now[0] = 122.5
    assert "no progress for 10 s" in watch() and "last event: ready" in watch()
    writer.write("step", step=4, loss=1.0)
    assert watch() is None and watch.steps[-1]["step"] == 4
    now[0] = 140.0
    assert "last completed step 4" in watch()


def _result(**fields) -> LaunchResult:
    return LaunchResult(**{"returncode": 1, "wall_s": 1.0, "timed_out": False, "tail": ("t",), **fields})


def test_diagnosis_names_the_killed_rank_not_the_peer_that_lost_it():
    lost_peer = {
        "rank": 0,
        "time": 1.0,
        "type": "RuntimeError",
        "message": "[pair.cc:553] Connection closed by peer [127.0.0.1]:1",
    }
    killed = diagnose_launch(_result(rank_exits={0: -15, 1: -9}, error_records=(lost_peer,)), "segment")
    assert (killed.cause, killed.rank, killed.retriable) == (FailureClass.RANK_DIED, 1, True)
    preempted = diagnose_launch(_result(rank_exits={0: -15, 1: -15}, error_records=(lost_peer,)), "segment")
    assert (preempted.cause, preempted.rank) == (FailureClass.PREEMPTED, 1)
    # The peer was ended by torchrun before its collective failed: no record, the same signal; the root cause tells.
    both_ended = diagnose_launch(_result(rank_exits={0: -15, 1: -15}, root_cause_rank=1), "segment")
    assert (both_ended.cause, both_ended.rank) == (FailureClass.PREEMPTED, 1)
    both_killed = diagnose_launch(_result(rank_exits={0: -9, 1: -9}, root_cause_rank=1), "segment")
    assert (both_killed.cause, both_killed.rank) == (FailureClass.RANK_DIED, 1)
    bug = {"rank": 1, "time": 2.0, "type": "TypeError", "message": "unsupported operand"}
    code = diagnose_launch(_result(rank_exits={0: -15, 1: 1}, error_records=(lost_peer, bug)), "segment")
    assert (code.cause, code.rank, code.retriable) == (FailureClass.CODE_ERROR, 1, False)
    timeout = {"rank": 0, "time": 1.0, "type": "RuntimeError", "message": "Timed out waiting 8000ms for recv operation"}
    hung = diagnose_launch(_result(rank_exits={0: 1, 1: -15}, error_records=(timeout,)), "segment")
    assert (hung.cause, hung.rank) == (FailureClass.COLLECTIVE_TIMEOUT, 1)
    escalated = diagnose_launch(_result(rank_exits={0: 1, 1: -9}, error_records=(timeout,)), "segment")
    assert (escalated.cause, escalated.rank) == (
        FailureClass.COLLECTIVE_TIMEOUT,
        1,
    )  # torchrun's SIGKILL after its grace
    stopped = diagnose_launch(_result(stalled="no progress for 12 s", stopped_ranks=(1,)), "segment")
    assert (stopped.cause, stopped.rank) == (FailureClass.RANK_STALLED, 1)
    stacks = {
        0: ('  File "/x/torch/distributed/distributed_c10d.py", line 1 in all_reduce',),
        1: ('  File "/x/trainer_core/run/faults.py", line 9 in _fail_once',),
    }
    hung_in_step = diagnose_launch(_result(stalled="no progress", rank_tails=stacks), "segment")
    assert (hung_in_step.cause, hung_in_step.rank) == (FailureClass.RANK_STALLED, 1)


def test_torchrun_failure_summary_is_parsed():
    lines = [
        "Failures:",
        "[1]:",
        "  time      : x",
        "  host      : vm",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : -15 (pid: 9)",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -9 (pid: 8)",
    ]
    assert parse_rank_exits(lines) == {0: -15, 1: -9}
    assert parse_root_cause_rank(lines) == 1
    assert parse_root_cause_rank(lines[:6]) is None  # no summary section: no root cause claimed


def test_retry_condition_follows_the_failure_class():
    def decide(error: BaseException) -> bool:
        return retry_if_retriable(None, None, Failed(data=error))

    assert decide(ConnectionError("store unreachable")) and decide(TimeoutError())
    assert not decide(TypeError("bug")) and not decide(DataError("bad record")) and not decide(ValueError("bad"))
    dead = LaunchError("x", _result(), Failure("segment", FailureClass.RANK_DIED, 1, "killed"))
    bug = LaunchError("x", _result(), Failure("segment", FailureClass.CODE_ERROR, 1, "TypeError"))
    assert decide(dead) and not decide(bug)
    assert classify_exception(OSError("s3 503")) is FailureClass.STORAGE_OUTAGE


def _segment(index: int, reused: bool, train_s: float, launch_wall_s: float) -> SegmentOutcome:
    return SegmentOutcome(
        segment=index,
        start_step=3 * index,
        end_step=3 * index + 3,
        losses=[1.0, 0.9, 0.8],
        num_tokens=900,
        tokens_per_s=900 / train_s,
        train_s=train_s,
        launch_wall_s=launch_wall_s,
        reused=reused,
    )


def test_a_resumed_run_reports_its_own_figures(tiny_config):
    record = RunRecord(tiny_config)
    record.segments = [
        _segment(0, True, train_s=50.0, launch_wall_s=0.0),
        _segment(1, False, train_s=2.0, launch_wall_s=9.0),
    ]
    summary = record.summary("completed")
    assert summary["tokens"] == 900 and summary["tokens_per_s"] == 450.0  # the reused segment took no time now
    assert summary["launch_wall_s"] - summary["train_s"] == 7.0  # launch overhead of this run, never negative
    assert summary["losses"] == [1.0, 0.9, 0.8] * 2 and summary["steps"] == 6
    assert (summary["segments_trained"], summary["segments_reused"]) == (1, 1)


def test_loss_curve_is_a_png_of_the_expected_size(tmp_path):
    path = write_loss_curve(tmp_path / "curve.png", [0, 1, 2, 3], [2.0, 1.5, math.nan, 1.0], [0, 2], "run")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (640, 360) and len(data) > 5000


def test_the_loss_curve_draws_the_learning_rate_on_its_own_axis(tmp_path):
    """The rate's dashed orange line (matplotlib's tab:orange) is in the picture only when rates are given."""
    from matplotlib.image import imread

    steps, losses = [0, 1, 2, 3], [2.0, 1.5, 1.2, 1.0]
    plain = imread(write_loss_curve(tmp_path / "plain.png", steps, losses, [0], "run"))
    rated = imread(write_loss_curve(tmp_path / "rated.png", steps, losses, [0], "run", [0.0, 1e-3, 5e-4, 1e-4]))

    def orange_pixels(image) -> int:
        red, green, blue = image[..., 0], image[..., 1], image[..., 2]
        return int(((red > 0.9) & (abs(green - 0.5) < 0.08) & (blue < 0.2)).sum())

    assert orange_pixels(plain) == 0 and orange_pixels(rated) > 100


def test_the_loss_curve_draws_the_eval_loss_where_it_was_measured(tmp_path):
    """The held-out loss is a green line (matplotlib's tab:green) only when eval points are given."""
    from matplotlib.image import imread

    steps, losses = [0, 1, 2, 3], [2.0, 1.5, 1.2, 1.0]
    plain = imread(write_loss_curve(tmp_path / "plain.png", steps, losses, [0], "run"))
    evaluated = imread(write_loss_curve(tmp_path / "eval.png", steps, losses, [0], "run", None, [(1, 1.8), (3, 1.4)]))

    def green_pixels(image) -> int:  # tab:green is (0.17, 0.63, 0.17)
        red, green, blue = image[..., 0], image[..., 1], image[..., 2]
        return int(((abs(red - 0.17) < 0.08) & (abs(green - 0.63) < 0.08) & (abs(blue - 0.17) < 0.08)).sum())

    assert green_pixels(plain) == 0 and green_pixels(evaluated) > 100


def test_the_live_table_shows_the_eval_loss_at_the_steps_that_have_one():
    from tasks.live import metrics_row

    record = {"step": 3, "loss": 1.0, "grad_norm": 0.5, "learning_rate": 1e-3, "stepped": True}
    record |= {"tokens_per_s": 10.0, "step_s": 0.1}
    assert "eval_loss" not in metrics_row(record)
    assert metrics_row({**record, "eval_loss": 1.234567})["eval_loss"] == 1.2346


def test_a_prefect_api_error_does_not_stop_the_live_view(prefect_harness):
    from uuid import uuid4

    from prefect import task

    from tasks.live import LiveArtifacts, LivePublisher

    @task
    def publish_to_missing_artifacts() -> bool:
        live = LiveArtifacts(run_id="r", progress_id=uuid4(), metrics_id=uuid4(), total_steps=4)
        publisher = LivePublisher(live, 0, min_interval_s=0)
        publisher(
            [
                {
                    "event": "step",
                    "step": 0,
                    "loss": 1.0,
                    "grad_norm": 1.0,
                    "learning_rate": 1e-3,
                    "stepped": True,
                    "tokens_per_s": 1.0,
                    "step_s": 0.1,
                }
            ]
        )  # the API answers 404: logged, kept for the next poll
        return publisher._pending

    assert publish_to_missing_artifacts() is True
