"""Experiment tracking with the real libraries and no network, read back with each one's own reader.

MLflow on a local `sqlite:` URI (read back through `mlflow.MlflowClient`), TensorBoard event files (read back with
TensorBoard's `EventAccumulator`), W&B offline (its run file present, with what was logged). A retried segment
logs no step twice; an unreachable server is a count and a warning, never an exception, and never holds the
segment past the sink's bound.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from pathlib import Path

import pytest

from infra.tracking import TrackingSink, missing_library, open_backend
from infra.tracking.backend import flat_params
from infra.tracking.sink import CHECKPOINT_URL_TAG, step_metrics
from tests.waits import GENEROUS_S

RUN_ID = "tiny-sft-0123456789ab"
PARAMS = {"run": {"name": "tiny-sft", "seed": 0}, "train": {"steps": 8, "learning_rate": 3e-3, "objective": None}}


def step_record(step: int, attempt: int = 0) -> dict:
    return {
        "event": "step",
        "step": step,
        "loss": 2.0 - 0.1 * step + attempt,  # a retried attempt's values differ: the first logged one must stay
        "grad_norm": 1.0 + step,
        "learning_rate": 1e-3 * step,
        "stepped": step != 2,
        "tokens": 100,
        "step_s": 0.5,
        "tokens_per_s": 200.0,
        "clip_fraction": None,  # an RL figure not measured at this step: left out
        "eval_loss": 1.5 + attempt if step == 4 else None,  # held-out rows evaluated after step 4 only
    }


def sink_for(backend: str, uri: str, warnings: list[str], timeout_s: float = 600.0) -> TrackingSink:
    return TrackingSink(
        lambda: open_backend(backend, uri, "rankflow-test", RUN_ID), lambda: PARAMS, warnings.append, timeout_s
    )


def train_twice(backend: str, uri: str) -> list[str]:
    """Steps 0-4, then a retried attempt of 3-7 (3 and 4 already logged), then a tag: what the flow does."""
    warnings: list[str] = []
    first = sink_for(backend, uri, warnings)
    first([{"event": "ready", "start_step": 0}, *[step_record(s) for s in range(5)]])
    assert first.close() == 0 and first.logged == 5
    retried = sink_for(backend, uri, warnings)
    retried([step_record(s, attempt=1) for s in range(3, 8)])
    assert retried.close() == 0 and retried.logged == 3
    tagger = sink_for(backend, uri, warnings)
    tagger.tag(CHECKPOINT_URL_TAG, "s3://bucket/runs/x/checkpoints/step-00000008")
    assert tagger.close() == 0
    return warnings


def expected_loss(step: int) -> float:
    return 2.0 - 0.1 * step + (1 if step >= 5 else 0)


def test_mlflow_holds_one_point_per_step_the_params_and_the_checkpoint(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert train_twice("mlflow", uri) == []
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rankflow-test").experiment_id])
    assert run.info.run_name == RUN_ID
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(8))
    assert [m.value for m in losses] == pytest.approx([expected_loss(s) for s in range(8)])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "skipped")] == [0, 0, 1, 0, 0, 0, 0, 0]
    assert {"learning_rate", "grad_norm", "tokens_per_s"} <= set(run.data.metrics)
    assert "clip_fraction" not in run.data.metrics
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [(4, 1.5)]
    assert run.data.params["train.steps"] == "8" and run.data.params["train.objective"] == ""
    assert run.data.tags[CHECKPOINT_URL_TAG] == "s3://bucket/runs/x/checkpoints/step-00000008"


def test_tensorboard_holds_one_point_per_step_and_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert train_twice("tensorboard", str(tmp_path / "tb")) == []
    events = EventAccumulator(str(tmp_path / "tb" / RUN_ID), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == list(range(8))
    assert [(e.step, e.value) for e in events.Scalars("eval_loss")] == [(4, 1.5)]
    assert [e.value for e in losses] == pytest.approx([expected_loss(s) for s in range(8)])
    texts = events.Tags()["tensors"]
    assert any(tag.startswith(CHECKPOINT_URL_TAG) for tag in texts) and any(t.startswith("params") for t in texts)


def test_wandb_offline_writes_its_run_file_once_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert train_twice("wandb", str(tmp_path)) == []
    import wandb

    # `finish` returns once W&B's service has the run's last record, not once its file is written; stopping the
    # service is what waits for that (CI once read a run file that still held only its header).
    wandb.teardown()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, list(tmp_path.rglob("*"))
    data = b"".join(p.read_bytes() for run in runs for p in run.glob("run-*.wandb"))
    assert b"s3://bucket/runs/x/checkpoints/step-00000008" in data and b"learning_rate" in data
    assert open_backend("wandb", str(tmp_path), "rankflow-test", RUN_ID).logged_through() == 7
    assert open_backend("wandb", str(tmp_path), "rankflow-test", "another-run").logged_through() is None


def test_an_unreachable_server_is_counted_and_never_raised(tmp_path, monkeypatch):
    """A server that refuses connections, with MLflow told not to retry: the record cannot be opened, every step is
    counted as not logged, a warning says so, and `close` returns at once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    warnings: list[str] = []
    sink = sink_for("mlflow", "http://127.0.0.1:9", warnings)
    sink([step_record(s) for s in range(4)])
    assert sink.close() == 5  # the run's record and four steps
    assert warnings and "not logged" in warnings[0] and "the training goes on" in warnings[0]


def test_a_server_that_never_answers_costs_the_segment_at_most_the_bound(tmp_path):
    """A backend stuck in its first call (a hung server): `close` gives up after its bound and counts the rest."""

    answered = threading.Event()
    hang_over = threading.Event()

    class Hung:
        def start(self, params):
            hang_over.wait(600)  # hung until the test ends it
            answered.set()

    warnings: list[str] = []
    sink = TrackingSink(Hung, lambda: PARAMS, warnings.append, close_timeout_s=1)  # pyright: ignore[reportArgumentType]
    sink([step_record(s) for s in range(3)])
    try:
        assert sink.close() == 3
        assert not answered.is_set()  # close gave up while the backend still hung: it did not wait for the answer
    finally:
        hang_over.set()
    assert "did not answer within" in warnings[-1]


def test_a_missing_library_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert "pip install 'rankflow[wandb]'" in (missing_library("wandb") or "")
    assert missing_library("mlflow") is None and missing_library("none") is None


def test_step_metrics_and_params_take_the_backends_names():
    metrics = step_metrics({**step_record(2), "eval_loss": 1.5, "mean_importance_ratio": 1.01})
    assert metrics == {
        "loss": pytest.approx(1.8),
        "grad_norm": 3.0,
        "learning_rate": 2e-3,
        "tokens_per_s": 200.0,
        "skipped": 1.0,
        "eval_loss": 1.5,
        "mean_importance_ratio": 1.01,
    }
    assert flat_params(PARAMS) == {
        "run.name": "tiny-sft",
        "run.seed": "0",
        "train.steps": "8",
        "train.learning_rate": "0.003",
        "train.objective": "",
    }


def test_a_run_config_resolves_each_backends_default_location(tmp_path):
    from tests.conftest import tiny_tree
    from trainer_core.config import config_from_dict
    from trainer_core.run.plan import digest_view

    def config(**tracking):
        return config_from_dict(tiny_tree(tmp_path, tracking=tracking), config_dir=tmp_path)

    work_dir = Path(config().run.work_dir)
    assert config(backend="mlflow").tracking.uri == f"sqlite:///{work_dir}/mlflow.db"
    assert config(backend="tensorboard").tracking.uri == str(work_dir / "tensorboard")
    assert config(backend="wandb", uri="runs").tracking.uri == str(Path.cwd() / "runs")
    assert config(backend="mlflow").tracking.experiment == config().run.name
    assert digest_view(config(backend="mlflow")) == digest_view(config())  # where metrics go is not the run


def test_a_sink_given_up_on_logs_nothing_more_when_its_server_answers_late(tmp_path):
    """Sink A's server hangs in step 1; `close` gives up and counts steps 1-4 (the one in flight included). The
    retried segment's sink B logs 1-4. When A's call finally returns, A must not log 2-4 again: only the call that
    was already on the wire (step 1) can land late, once."""
    from mlflow import MlflowClient

    from infra.tracking.mlflow_backend import MlflowBackend

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    release = threading.Event()
    on_the_wire = threading.Event()

    class HangsAtStepOne(MlflowBackend):
        def log(self, step, metrics):
            if step == 1:
                on_the_wire.set()
                release.wait(600)  # until the test releases it, however loaded the machine
            super().log(step, metrics)

    warnings: list[str] = []
    # The close waits out its timeout while step 1 hangs (it hangs until released): a short one proves the same.
    first = TrackingSink(
        lambda: HangsAtStepOne(uri, "rankflow-test", RUN_ID), lambda: PARAMS, warnings.append, close_timeout_s=1
    )
    first([step_record(s) for s in range(5)])
    assert on_the_wire.wait(GENEROUS_S)  # step 0 is in; step 1 hangs
    assert first.logged == 1
    assert first.close() == 4 and "4 item(s) were not logged" in warnings[-1]
    retried = sink_for("mlflow", uri, warnings)
    retried([step_record(s) for s in range(5)])
    assert retried.close() == 0 and retried.logged == 4
    release.set()
    first._thread.join(600)  # pyright: ignore[reportPrivateUsage] - the late answer has come back
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rankflow-test").experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 1, 2, 3, 4]


def _mlflow_record(uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rankflow-test").experiment_id])
    return run.info


def test_an_mlflow_record_ends_with_the_runs_status_and_runs_again_when_resumed(tmp_path):
    """MLflow's own status of the record: FAILED once the run failed, RUNNING again while a resumed run trains
    (its first sink reopens the record), FINISHED once it completed; the end time is set at each end."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    warnings: list[str] = []
    first = sink_for("mlflow", uri, warnings)
    first([step_record(s) for s in range(3)])
    assert first.close() == 0 and _mlflow_record(uri).status == "RUNNING"
    ending = sink_for("mlflow", uri, warnings)
    ending.end("FAILED")
    assert ending.close() == 0
    failed = _mlflow_record(uri)
    assert (failed.status, failed.end_time is not None) == ("FAILED", True)
    resumed = sink_for("mlflow", uri, warnings)
    resumed([step_record(s) for s in range(2, 6)])
    assert resumed.close() == 0 and resumed.logged == 3
    assert _mlflow_record(uri).status == "RUNNING"
    ending = sink_for("mlflow", uri, warnings)
    ending.end("FINISHED")
    assert ending.close() == 0 and warnings == []
    finished = _mlflow_record(uri)
    assert finished.status == "FINISHED" and finished.end_time >= failed.end_time


def _tracked_planned(tmp_path: Path, config):
    from tasks.outcomes import PlannedRun
    from trainer_core.config import TrackingSection

    return PlannedRun(
        run_id=RUN_ID,
        digest="d" * 64,
        run_dir=str(tmp_path / "run"),
        segment_steps=[(0, 3)],
        storage=config.storage,
        tracking=TrackingSection(
            backend="mlflow", uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="rankflow-test"
        ),
    )


@pytest.mark.parametrize(
    ("raised", "status"), [(None, "FINISHED"), (KeyboardInterrupt, "KILLED"), (ConnectionError, "FAILED")]
)
def test_the_flow_ends_the_runs_record_as_the_run_ended(tmp_path, tiny_config, raised, status):
    """The flow's way out (`RunRecord.failures_reported`) sets the record's terminal status: completed, stopped
    (Ctrl-C) or failed; the record was made by a segment's sink, as in a run."""
    from flows.run_record import RunFailed, RunRecord

    planned = _tracked_planned(tmp_path, tiny_config)
    uri = planned.tracking.uri
    assert uri is not None
    segment = sink_for("mlflow", uri, [])
    segment([step_record(0)])
    assert segment.close() == 0 and _mlflow_record(uri).status == "RUNNING"
    run = RunRecord(tiny_config)
    with pytest.raises(RunFailed if raised is ConnectionError else KeyboardInterrupt) if raised else nullcontext():
        with run.failures_reported():
            run.planned(planned)
            if raised is not None:
                raise raised("stopped in a segment")
    assert _mlflow_record(uri).status == status


def test_ending_a_run_opens_no_backend_whose_record_has_no_status(tmp_path, tiny_config):
    """TensorBoard has no run status: the run's end writes no new events file (opening it would make one)."""
    from infra.tracking.sink import end_tracked_run
    from trainer_core.config import TrackingSection

    logs = tmp_path / "tb"
    planned = _tracked_planned(tmp_path, tiny_config)
    planned = planned.model_copy(
        update={"tracking": TrackingSection(backend="tensorboard", uri=str(logs), experiment="x")}
    )
    assert end_tracked_run(planned, "FINISHED", lambda line: None) == 0
    assert not logs.exists() or not any(logs.rglob("*tfevents*"))
