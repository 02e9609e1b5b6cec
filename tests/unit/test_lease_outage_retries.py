"""A storage outage of a minute does not fail a run; one past five minutes does (issue 31, item 9).

Object stores have minute-long brownouts (connection resets, 503s). The
outage is injected where the store answers, under the lease read every fence
makes (`read_versioned`, a real local store behind it), on a fake clock that
the stage's pauses advance, so minutes of outage cost no wall-clock time.
Reference: the fake clock (how long the outage lasted when the stage gave up
or went on), and the lease record and the stage's result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

import infra.store.lease as lease_module
import tasks.export as export_module
import tasks.publish as publish
import tasks.report as report_module
import tasks.retry_policy as retry_policy
import tasks.segment as segment_module
import tasks.state_upload as state_upload_module
from infra.launch.failures import FailureClass, classify_exception, diagnose_launch
from infra.launch.launcher import LaunchError, LaunchResult
from infra.runs import ledger
from infra.runs.run_lease import RunLeaseLost, acquire_run_lease
from infra.store import open_store
from tasks.fencing import fence, fenced_monitor
from tasks.outcomes import ExportOutcome, PlannedRun
from tests.e2e.run_lease.runs import steal
from trainer_core.config import StorageSection, TrainSection

RUN = "outage-run-0123456789ab"
BUDGET_S = 300.0


@dataclass
class Outage:
    """A fake clock, and the store failing every lease read from `starts_at` for `lasts_s` of that clock."""

    starts_at: float = 0.0
    lasts_s: float = float("inf")
    now: float = 0.0
    reads_failed: int = 0
    sleeps: list[float] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def backoff(self) -> retry_policy.OutageBackoff:
        return retry_policy.OutageBackoff(budget_s=BUDGET_S, sleep=self.sleep, clock=self.clock)

    def on(self) -> bool:
        return self.starts_at <= self.now < self.starts_at + self.lasts_s


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run holding its run lease on a local store whose lease reads fail during an `Outage`."""
    store = open_store(str(tmp_path / "store"))
    lease = acquire_run_lease(store, RUN, ttl_s=3600, wait_s=0)
    lease.stop_heartbeat()  # the fake clock drives everything here; the ttl outlasts the test
    assert lease.record is not None
    planned = PlannedRun(
        run_id=RUN,
        digest="d" * 64,
        run_dir=str(tmp_path / "work" / RUN),
        segment_steps=[(0, 2), (2, 4)],
        train=TrainSection(segment_timeout_s=60),
        storage=StorageSection(url=store.url),
        lease_token=lease.record.token,
    )
    outage = Outage()
    real_read = lease_module.read_versioned

    def read_through_the_outage(store_, path):
        if outage.on():
            outage.reads_failed += 1
            raise ConnectionResetError(f"reading {path}: [Errno 104] Connection reset by peer")
        return real_read(store_, path)

    monkeypatch.setattr(lease_module, "read_versioned", read_through_the_outage)
    monkeypatch.setattr(retry_policy, "OUTAGE_BACKOFF", outage.backoff())
    return SimpleNamespace(store=store, planned=planned, outage=outage)


def test_the_backoff_grows_and_spans_five_minutes_before_an_outage_fails():
    outage = Outage()
    calls = []

    def never_answers():
        calls.append(outage.now)
        raise ConnectionRefusedError("object storage unreachable")

    with pytest.raises(ConnectionRefusedError):
        retry_policy.ride_out_outage(never_answers, "state-upload", outage.backoff(), warn=lambda _line: None)
    assert outage.sleeps[:6] == [2, 4, 8, 16, 32, 60] and set(outage.sleeps[6:]) == {60}
    assert calls[-1] - calls[0] >= BUDGET_S and sum(outage.sleeps) >= BUDGET_S  # the last try came 5 minutes in
    assert len(calls) == len(outage.sleeps) + 1 < 15  # a few tries, not a hammering


@pytest.mark.parametrize(
    "error",
    [ValueError("bad data"), PermissionError("403 AccessDenied"), RunLeaseLost("taken over")],
    ids=["bad_input", "refused", "lease_lost"],
)
def test_what_is_no_outage_fails_at_once(error):
    outage = Outage()

    def fails():
        raise error

    with pytest.raises(type(error)):
        retry_policy.ride_out_outage(fails, "segment", outage.backoff(), warn=lambda _line: None)
    assert outage.sleeps == []


def test_a_launch_fence_rides_out_a_60_s_outage_and_the_launch_goes_on(run):
    run.outage.starts_at, run.outage.lasts_s = 10.0, 60.0
    polls, lines = [], []
    watch = fenced_monitor(
        run.planned,
        "segment 1",
        lambda: polls.append(1),
        clock=run.outage.clock,
        backoff=run.outage.backoff(),
        warn=lines.append,
    )
    for second in range(1, 101):  # the launcher polls its monitor; the fence checks every 2 s
        run.outage.now = float(second)
        assert watch() is None  # before: ConnectionResetError at 10 s, which killed the launch
    assert len(polls) == 100 and run.outage.reads_failed >= 3
    assert run.outage.reads_failed <= 6 and len(lines) == run.outage.reads_failed  # checks spaced out, each told
    assert "segment 1: the run lease check: object storage outage" in lines[0]
    steal(run.store, RUN)  # a takeover seen once the store answers again still ends the launch
    run.outage.now = 103.0
    with pytest.raises(RunLeaseLost, match="taken over"):
        watch()


def test_a_launch_fence_ends_the_launch_once_the_outage_outlasts_five_minutes(run):
    run.outage.starts_at = 10.0
    watch = fenced_monitor(
        run.planned, "segment 1", None, clock=run.outage.clock, backoff=run.outage.backoff(), warn=lambda _line: None
    )
    with pytest.raises(ConnectionResetError):
        for second in range(1, 1000):
            run.outage.now = float(second)
            watch()
    assert BUDGET_S <= run.outage.now - 10.0 <= BUDGET_S + 60 + 2


def test_an_outage_a_launch_fence_rode_out_is_not_waited_out_again_by_its_segment(run, monkeypatch):
    run.outage.starts_at = 10.0

    def launch(planned, _segment_index, **_kwargs):
        watch = fenced_monitor(
            planned, "segment 1", None, clock=run.outage.clock, backoff=run.outage.backoff(), warn=lambda _line: None
        )
        while True:  # the launcher polling its monitor, once a second, until the monitor ends the launch
            run.outage.now += 1.0
            watch()

    monkeypatch.setattr(segment_module, "rank_line_logger", lambda: print)
    monkeypatch.setattr(segment_module, "train_segment_fn", launch)
    with pytest.raises(ConnectionResetError):
        segment_module.train_segment.fn(run.planned, 1)
    assert run.outage.sleeps == []  # the stage did not wait another 5 minutes before failing
    assert BUDGET_S <= run.outage.now - 10.0 <= BUDGET_S + 60 + 2


def _through_fence(stage: str, result):
    """A stage function whose store work is its fence (the first thing every stage does), then `result`."""

    def stage_fn(planned, *_args, **_kwargs):
        fence(planned, stage)
        return result

    return stage_fn


class _Outcome:
    def to_dict(self) -> dict:
        return {"step": 2}


@pytest.mark.parametrize("stage", ["segment", "state-upload", "export", "commit", "report"])
def test_each_stage_rides_out_a_60_s_outage_within_one_attempt(run, stage, monkeypatch):
    run.outage.lasts_s = 60.0
    planned, done = run.planned, SimpleNamespace(reused=False)  # a trained segment's outcome, to the segment task
    for module in (segment_module, export_module):  # their task functions log the ranks' lines to the task run
        monkeypatch.setattr(module, "rank_line_logger", lambda: print)
    if stage == "segment":
        monkeypatch.setattr(segment_module, "train_segment_fn", _through_fence(stage, done))
        call = lambda: segment_module.train_segment.fn(planned, 1)  # noqa: E731
    elif stage == "state-upload":
        monkeypatch.setattr(state_upload_module, "upload_state_fn", _through_fence(stage, done))
        call = lambda: state_upload_module.upload_state.fn(planned, 0)  # noqa: E731
    elif stage == "export":
        monkeypatch.setattr(export_module, "export_segment_fn", _through_fence(stage, done))
        call = lambda: export_module.export_segment.fn(planned, 1)  # noqa: E731
    elif stage == "report":
        for name in ("upsert_table_artifact", "upsert_markdown_artifact", "write_run_loss_curve"):
            monkeypatch.setattr(report_module, name, lambda *_args, **_kwargs: None)
        monkeypatch.setattr(report_module, "summary_markdown", lambda *_args: "")
        monkeypatch.setattr(report_module, "settle_failure_report", lambda _planned: False)
        monkeypatch.setattr(report_module, "publish_run_files_fn", lambda _planned: done)
        call = lambda: report_module.report.fn(planned, [], [])  # noqa: E731
    else:
        done = _Outcome()
        monkeypatch.setattr(publish, "commit_checkpoint", lambda *_args, **_kwargs: done)
        exported = ExportOutcome(
            segment=1,
            step=2,
            staged_dir=str(planned.run_dir),
            reused=False,
            num_files=1,
            num_bytes=1,
            launch_wall_s=0.0,
        )
        call = lambda: publish.commit.fn(planned, exported)  # noqa: E731
    assert call() is done  # before: the outage's ConnectionResetError, after 3 Prefect attempts within ~20 s
    assert run.outage.now >= 60.0 and run.outage.reads_failed >= 3
    assert sum(run.outage.sleeps) < 60.0 + 60.0  # tried again within a pause of the store's return


def _rank_disk_error() -> LaunchError:
    """What the launcher raises when rank 1 died of an EIO from its local disk (its diagnosis: storage_outage)."""
    record = {"rank": 1, "time": 1.0, "type": "OSError", "message": "[Errno 5] Input/output error: '/local/state'"}
    result = LaunchResult(
        returncode=1,
        wall_s=1.0,
        timed_out=False,
        tail=("[rank 1] ERROR OSError: [Errno 5] Input/output error",),
        rank_exits={1: 1},
        root_cause_rank=1,
        error_records=(record,),
    )
    return LaunchError("segment failed on rank 1", result, diagnose_launch(result, "segment", 60))


def test_a_failed_launch_ends_the_attempt_at_once_and_is_recorded_whatever_its_ranks_died_of(run, monkeypatch):
    launches = []

    def launch(_planned, _segment_index, **_kwargs):
        launches.append(run.outage.now)
        raise _rank_disk_error()

    monkeypatch.setattr(segment_module, "rank_line_logger", lambda: print)
    monkeypatch.setattr(segment_module, "train_segment_fn", launch)
    assert classify_exception(_rank_disk_error()) is FailureClass.STORAGE_OUTAGE  # the rank's OSError, as diagnosed
    with pytest.raises(LaunchError):
        segment_module.train_segment.fn(run.planned, 1)
    # Before: relaunched (retraining) for 5 minutes as an "object storage outage", only the last launch recorded.
    assert launches == [0.0] and run.outage.sleeps == []
    failed = [e for e in ledger.read(Path(run.planned.run_dir)) if e["status"] == "failed"]
    assert [(e["stage"], e["failure"]["cause"], e["failure"]["rank"]) for e in failed] == [
        ("segment", "storage_outage", 1)
    ]


def test_an_outage_after_the_store_answered_for_minutes_is_a_new_outage(run):
    """A 30 s blip, 10 minutes of work, a 2 s reset: the second outage is ridden out too (5 minutes from ITS start)."""
    run.outage.lasts_s = 30.0
    tries, lines = [], []

    def stage():
        tries.append(run.outage.now)
        fence(run.planned, "export of segment 1")  # fails through the blip
        if len(tries) == 5:  # the store answered: 10 minutes of work, then a reset of its own
            run.outage.starts_at, run.outage.lasts_s = run.outage.now + 600.0, 2.0
            run.outage.now += 600.0
            fence(run.planned, "export of segment 1")
        return "done"

    result = retry_policy.ride_out_outage(stage, "export", run.outage.backoff(), warn=lines.append)
    assert result == "done"  # before: the reset counted as a 630 s outage, over the budget, and failed the stage
    assert run.outage.sleeps == [2, 4, 8, 16, 2]  # the new outage's pauses start again
    assert "(0 s of up to 300 s ridden out)" in lines[-1]


def test_a_store_that_answers_lease_checks_but_fails_each_try_still_fails_after_five_minutes(run):
    run.outage.lasts_s = 0.0  # lease reads are answered; the stage's upload is reset on every try

    def stage():
        fence(run.planned, "commit of step 2")  # answered
        raise ConnectionResetError("uploading model.safetensors: [Errno 104] Connection reset by peer")

    with pytest.raises(ConnectionResetError):
        retry_policy.ride_out_outage(stage, "commit", run.outage.backoff(), warn=lambda _line: None)
    assert BUDGET_S <= run.outage.now <= BUDGET_S + 60


def test_a_replaced_outage_backoff_reaches_a_launch_lease_check_and_every_ride_out(run, monkeypatch):
    run.outage.starts_at = 10.0
    watch = fenced_monitor(run.planned, "segment 1", None, warn=lambda _line: None)  # OUTAGE_BACKOFF's clock, budget
    run.outage.now = 12.0
    assert watch() is None  # ridden out, on the replaced backoff's clock
    monkeypatch.setattr(retry_policy, "OUTAGE_BACKOFF", retry_policy.OutageBackoff(budget_s=0, clock=run.outage.clock))
    watch = fenced_monitor(run.planned, "segment 1", None, warn=lambda _line: None)
    run.outage.now = 14.0
    with pytest.raises(ConnectionResetError):  # before: the import-time 5 minutes were ridden out
        watch()

    outage, answers = Outage(), []
    monkeypatch.setattr(retry_policy, "OUTAGE_BACKOFF", outage.backoff())

    def answers_the_second_time():
        answers.append(1)
        if len(answers) == 1:
            raise ConnectionRefusedError("object storage unreachable")
        return "answered"

    assert retry_policy.ride_out_outage(answers_the_second_time, "report", warn=lambda _line: None) == "answered"
    assert outage.sleeps == [2]  # before: a real 2 s sleep, the default bound at import
