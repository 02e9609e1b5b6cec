"""The whole pipeline under the Prefect test harness, on a local store and on real S3."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flows.cli import main
from flows.pipeline import RunFailed, train_flow
from infra.publication.checkpoints import download_checkpoint, latest_checkpoint, list_checkpoints
from infra.publication.journal import journal_path_for
from infra.publication.retention import is_retired
from infra.runs import ledger
from infra.runs.run_state import read_bundle_manifest, segment_bundle, stored_bundle
from infra.store import open_store
from tests.conftest import EXAMPLES, tiny_tree
from tests.e2e.flows.prefect_queries import artifacts_of, flow_runs_named, run_events, table_rows, task_runs_of
from tests.waits import wait_for
from trainer_core.config import config_from_dict
from trainer_core.model import build_trainer
from trainer_core.run.faults import EXPORT_FAULT_ENV, FAULT_ENV, FAULT_KIND_ENV
from trainer_core.run.plan import load_segment_shard, read_plan
from trainer_core.run.state import load_training_state, state_dir_for

pytestmark = [pytest.mark.flow, pytest.mark.distributed]


def run_flow(tmp_path: Path, **sections):
    config = config_from_dict(tiny_tree(tmp_path, **sections), config_dir=tmp_path)
    return config, train_flow(config)


def fetch_checkpoint(config, result, dest: Path) -> Path:
    store = open_store(config.storage.url)
    name = latest_checkpoint(store, result["run_id"])
    assert name is not None and result["checkpoint_url"].endswith(name)
    return download_checkpoint(store, result["run_id"], name, dest)


def exported_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(checkpoint_dir.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


def assert_logits_match_trainer(config, result, checkpoint_dir: Path) -> None:
    run_dir = Path(config.run.work_dir) / result["run_id"]
    plan = read_plan(run_dir)
    trainer = build_trainer(config)
    load_training_state(state_dir_for(run_dir, len(plan.segments) - 1), trainer.checkpoints, with_optimizer=False)
    trainer_model = trainer.model
    exported = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), local_files_only=True, dtype=torch.float32)
    shard = load_segment_shard(run_dir, plan.segments[0])
    input_ids, attention_mask = shard["input_ids"][0], shard["attention_mask"][0]
    trainer_model.eval(), exported.eval()
    with torch.no_grad():
        expected = trainer_model(input_ids=input_ids, attention_mask=attention_mask).logits
        actual = exported(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def local_run(prefect_harness, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("local-run")
    config, result = run_flow(tmp_path)
    return tmp_path, config, result


def test_local_run_commits_a_checkpoint_that_transformers_loads(local_run):
    tmp_path, config, result = local_run
    assert result["status"] == "completed" and result["steps"] == 6 and len(result["losses"]) == 6
    assert result["losses"][-1] < result["losses"][0] - 0.5
    checkpoint = fetch_checkpoint(config, result, tmp_path / "download")
    assert {"config.json", "model.safetensors", "tokenizer.json", "MANIFEST.json"} <= {
        p.name for p in checkpoint.iterdir()
    }
    assert_logits_match_trainer(config, result, checkpoint)
    run_dir = Path(config.run.work_dir) / result["run_id"]
    stages = {(e["stage"], e["status"]) for e in ledger.read(run_dir)}
    assert {
        ("plan", "completed"),
        ("segment", "completed"),
        ("export", "completed"),
        ("commit", "completed"),
        ("cleanup", "completed"),
    } <= stages
    # Cleanup removed the staging; only the publication's journal stays, recording its outcome in this store.
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["journals"]
    journal = journal_path_for(run_dir / "export" / f"step-{result['steps']:08d}", open_store(config.storage.url))
    assert sorted(p.name for p in journal.parent.iterdir()) == ["STORE.json", journal.name]
    assert json.loads(journal.read_text())["state"] == "CLEANED"
    assert Path(result["ledger_url"]).is_file()


def test_the_flow_run_shows_names_progress_metrics_checkpoint_and_events(local_run):
    tmp_path, config, result = local_run
    run_id = result["run_id"]
    flow_run = flow_runs_named(run_id)[-1]  # named after the run id once the plan is known
    tasks = {t.name: t for t in task_runs_of(flow_run.id)}
    assert {"segment-0 steps 0-2", "segment-1 steps 3-5"} <= set(tasks)
    waited_on = [ref.id for ref in tasks["segment-1 steps 3-5"].task_inputs["wait_for"]]
    assert waited_on == [tasks["segment-0 steps 0-2"].id]  # segments depend on one another in the run graph
    artifacts = artifacts_of(flow_run.id)
    progress = artifacts[f"{run_id}-progress"][0]
    assert progress.type == "progress" and float(progress.data) == 100.0
    rows = table_rows(artifacts[f"{run_id}-metrics"][0])
    assert [r["step"] for r in rows] == [5, 4, 3]  # the segment's steps, newest first, written while it ran
    assert rows[0]["loss"] == round(result["losses"][5], 4) and {"grad_norm", "learning_rate", "tokens_per_s"} <= set(
        rows[0]
    )
    summary = artifacts[f"{run_id}-checkpoint"][0].data
    store_dir = Path(config.storage.url) / run_id
    assert result["checkpoint_url"] in summary and str(store_dir / "ledger.jsonl") in summary
    assert str(store_dir / "loss_curve.png") in summary and "data:image/png;base64," in summary
    assert (store_dir / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert (Path(config.run.work_dir) / run_id / "loss_curve.png").is_file()  # beside the local ledger too
    events = run_events(run_id, {"rankflow.segment.completed": 2, "rankflow.checkpoint.committed": 1})
    completed = sorted((e for e in events if e.event == "rankflow.segment.completed"), key=lambda e: e.payload["step"])
    assert [e.payload["step"] for e in completed][:2] == [3, 6]
    assert completed[1].payload["loss"] == pytest.approx(result["losses"][5])
    assert completed[1].resource["rankflow.loss-finite"] == "true"
    committed = [e for e in events if e.event == "rankflow.checkpoint.committed"]
    assert committed[0].payload["url"] == result["checkpoint_url"] and committed[0].payload["step"] == 6


def test_each_state_upload_is_a_task_run_and_finishes_before_the_commit(local_run):
    tmp_path, config, result = local_run
    flow_run = flow_runs_named(result["run_id"])[-1]
    tasks = {t.name: t for t in task_runs_of(flow_run.id)}
    assert {"state-upload-0", "state-upload-1"} <= set(tasks)
    waited_on = [ref.id for ref in tasks["state-upload-1"].task_inputs["wait_for"]]
    assert waited_on == [tasks["state-upload-0"].id]  # one upload in flight: upload 1 waits for upload 0
    assert all(tasks[f"state-upload-{k}"].state.is_completed() for k in (0, 1))
    entries = ledger.read(Path(config.run.work_dir) / result["run_id"])
    stored = {
        e["segment"]: e["time"]
        for e in entries
        if (e["stage"], e["status"]) == ("run-state", "stored") and "segment" in e
    }
    committed = next(e["time"] for e in entries if (e["stage"], e["status"]) == ("commit", "completed"))
    assert sorted(stored) == [0, 1] and max(stored.values()) < committed  # nothing published before its upload
    assert result["upload_wait_s"] >= 0


def test_rerun_of_a_finished_run_reuses_its_segments_and_launches_nothing(local_run, prefect_harness):
    tmp_path, config, result = local_run
    again = train_flow(config)
    assert again["run_id"] == result["run_id"] and again["losses"] == result["losses"]
    assert again["launch_wall_s"] == 0 and again["export_wall_s"] == 0  # nothing trained, nothing exported
    assert again["checkpoint_url"] == result["checkpoint_url"]
    entries = ledger.read(Path(config.run.work_dir) / result["run_id"])
    assert sum(1 for e in entries if e["stage"] == "segment" and e["status"] == "reused") == 2
    assert (entries[-1]["stage"], entries[-1]["status"]) == ("export", "skipped")  # already committed and complete
    assert sum(1 for e in entries if e["stage"] == "export" and e["status"] == "completed") == 1
    newest = flow_runs_named(result["run_id"])[0]
    segments = [t for t in task_runs_of(newest.id) if t.name.startswith("segment-")]
    assert len(segments) == 2 and {t.state.name for t in segments} == {"Reused"}


@pytest.mark.s3
def test_s3_run_with_sharded_export(prefect_harness, s3_env, s3_bucket_url, local_run, tmp_path):
    _, local_config, local_result = local_run
    config, result = run_flow(tmp_path, storage={"url": s3_bucket_url}, export={"max_shard_size": "1MB"})
    assert result["checkpoint_url"].startswith(s3_bucket_url + "/")
    assert result["run_id"] == local_result["run_id"]  # storage does not enter the plan digest
    checkpoint = fetch_checkpoint(config, result, tmp_path / "download")
    assert (checkpoint / "model.safetensors.index.json").is_file()
    assert len(list(checkpoint.glob("model-*.safetensors"))) >= 2
    assert_logits_match_trainer(config, result, checkpoint)
    local_weights = exported_weights(fetch_checkpoint(local_config, local_result, tmp_path / "local"))
    s3_weights = exported_weights(checkpoint)
    assert local_weights.keys() == s3_weights.keys()
    assert all(torch.equal(local_weights[k], s3_weights[k]) for k in local_weights)


def test_failed_segment_is_retried_and_resumes_bitwise(prefect_harness, local_run, tmp_path, monkeypatch):
    _, local_config, local_result = local_run
    marker = tmp_path / "fault-happened"
    monkeypatch.setenv(FAULT_ENV, f"4:1:{marker}")  # step 4 is inside the second segment, on rank 1
    monkeypatch.setenv(FAULT_KIND_ENV, "kill")  # SIGKILL, as the OOM killer would
    held_out = {"eval_path": str(EXAMPLES / "tiny" / "eval.jsonl")}  # evaluating changes no training result
    config, result = run_flow(tmp_path, tracking={"backend": "mlflow"}, data=held_out, train={"eval_every": 2})
    assert marker.is_file()
    entries = ledger.read(Path(config.run.work_dir) / result["run_id"])
    failures = [e for e in entries if e["stage"] == "segment" and e["status"] == "failed"]
    assert len(failures) == 1 and failures[0]["segment"] == 1 and "rank 1" in failures[0]["error"]
    assert failures[0]["failure"]["cause"] == "rank_died" and failures[0]["failure"]["rank"] == 1
    flow_run = flow_runs_named(result["run_id"])[0]
    segment = next(t for t in task_runs_of(flow_run.id) if t.name == "segment-1 steps 3-5")
    assert segment.run_count == 2 and segment.state.is_completed()  # Prefect retried it
    report = artifacts_of(flow_run.id)[f"{result['run_id']}-failure"][0]
    assert "rank_died" in report.data and "| 1 |" in report.data and "attempt 1 of 3" in report.data
    assert result["losses"] == local_result["losses"]
    resumed = exported_weights(fetch_checkpoint(config, result, tmp_path / "resumed"))
    baseline = exported_weights(fetch_checkpoint(local_config, local_result, tmp_path / "baseline"))
    assert all(torch.equal(resumed[k], baseline[k]) for k in baseline)
    # MLflow holds one point per step (the killed attempt logged step 3, its retry skipped it), the run's
    # losses and rates, its params and the committed checkpoint.
    from mlflow import MlflowClient

    assert config.tracking.uri is not None and result["tracking_failures"] == 0
    client = MlflowClient(tracking_uri=config.tracking.uri)
    (tracked,) = client.search_runs([client.get_experiment_by_name(config.run.name).experiment_id])
    losses = client.get_metric_history(tracked.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(len(result["losses"])))
    assert [m.value for m in losses] == pytest.approx(result["losses"], rel=1e-6)
    rates = client.get_metric_history(tracked.info.run_id, "learning_rate")
    assert [m.value for m in rates] == pytest.approx(result["learning_rates"], rel=1e-6)
    # The held-out loss after every second step and each segment's last, once each (the killed attempt's step 3
    # included: its retry did not log it again), as the run's summary has it.
    assert list(result["eval_losses"]) == ["1", "2", "3", "5"]
    evaluated = client.get_metric_history(tracked.info.run_id, "eval_loss")
    assert [m.step for m in evaluated] == [1, 2, 3, 5]
    assert [m.value for m in evaluated] == pytest.approx(list(result["eval_losses"].values()), rel=1e-6)
    assert tracked.data.params["train.steps"] == str(config.train.steps)
    assert tracked.data.tags["checkpoint_url"] == result["checkpoint_url"]
    assert tracked.info.status == "FINISHED"  # the run ended (issue 31): no record stays RUNNING


def test_bad_data_exits_2_and_writes_nothing(prefect_harness, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    data.write_text(good + "\n" + json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n")
    tree = tiny_tree(tmp_path, data={"path": str(data)})
    config_file = tmp_path / "run.toml"
    config_file.write_text(
        "\n".join(
            f"[{section}]\n" + "\n".join(f"{key} = {json.dumps(value)}" for key, value in values.items())
            for section, values in tree.items()
        )
    )
    assert main(["run", str(config_file)]) == 2
    assert f"{data}:2: field messages.0.role" in capsys.readouterr().err
    assert not (tmp_path / "work").exists() and not (tmp_path / "store").exists()
    assert list_checkpoints(open_store(str(tmp_path / "store")), "anything") == []


def test_failed_export_is_retried_without_retraining(prefect_harness, tmp_path, monkeypatch):
    marker = tmp_path / "export-fault-happened"
    monkeypatch.setenv(EXPORT_FAULT_ENV, f"1:{marker}")  # rank 1 fails the first export launch
    config, result = run_flow(tmp_path)
    assert marker.is_file() and result["status"] == "completed"
    entries = ledger.read(Path(config.run.work_dir) / result["run_id"])
    exports = [(e["status"], e.get("error", "")) for e in entries if e["stage"] == "export"]
    assert [s for s, _ in exports] == ["failed", "completed"] and "rank 1" in exports[0][1]
    trained = [e["segment"] for e in entries if e["stage"] == "segment" and e["status"] == "completed"]
    assert trained == [0, 1]  # each segment trained once: the retry redid only the export
    assert latest_checkpoint(open_store(config.storage.url), result["run_id"]) is not None


def write_toml(tmp_path: Path, tree: dict) -> Path:
    config_file = tmp_path / "run.toml"
    config_file.write_text(
        "\n".join(
            f"[{section}]\n" + "\n".join(f"{key} = {json.dumps(value)}" for key, value in values.items())
            for section, values in tree.items()
        )
    )
    return config_file


def test_a_code_error_is_not_retried_and_the_summary_keeps_the_run(
    prefect_harness, local_run, tmp_path, monkeypatch, capsys
):
    _, _, local_result = local_run
    marker = tmp_path / "fault-happened"
    monkeypatch.setenv(FAULT_ENV, f"4:1:{marker}")
    monkeypatch.setenv(FAULT_KIND_ENV, "code")  # a TypeError: a retry would fail the same way
    assert main(["run", str(write_toml(tmp_path, tiny_tree(tmp_path)))]) == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["status"] == "failed" and summary["run_id"] == local_result["run_id"]
    assert summary["steps"] == 3 and summary["losses"] == local_result["losses"][:3]  # the first segment's figures
    assert (summary["failed_stage"], summary["failure_cause"], summary["failed_rank"]) == ("segment", "code_error", 1)
    assert summary["launch_overhead_s"] >= 0
    entries = ledger.read(tmp_path / "work" / summary["run_id"])
    assert [e["failure"]["cause"] for e in entries if e["status"] == "failed"] == ["code_error"]  # one attempt only
    events = run_events(summary["run_id"], {"rankflow.run.failed": 1})
    failed = [e for e in events if e.event == "rankflow.run.failed" and e.payload["cause"] == "code_error"]
    assert failed and failed[-1].payload["step"] == 3 and failed[-1].payload["rank"] == 1
    assert failed[-1].resource["rankflow.cause"] == "code_error"


def test_an_unreachable_store_stops_the_run_before_anything_is_written(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing answers
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-never-shown")
    config = config_from_dict(tiny_tree(tmp_path, storage={"url": "s3://bucket/runs"}), config_dir=tmp_path)
    with pytest.raises(RunFailed) as raised:
        train_flow(config)
    summary = raised.value.summary
    assert summary["failed_stage"] == "storage-check" and summary["failure_cause"] == "storage_outage"
    assert "http://127.0.0.1:9" in str(raised.value) and "secret-never-shown" not in str(raised.value)
    assert not (tmp_path / "work").exists()  # checked first: no plan, no run directory


@pytest.mark.s3
def test_a_refused_store_setting_is_bad_input_exit_2(
    prefect_harness, s3_env, s3_bucket_url, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-never-shown")
    config_file = write_toml(tmp_path, tiny_tree(tmp_path, storage={"url": s3_bucket_url}))
    assert main(["run", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rankflow: bad input: storage.url=") and s3_env.endpoint_url in err
    assert "wrong-secret-never-shown" not in err and "Traceback" not in err
    assert not (tmp_path / "work" / "test-").exists() and not list((tmp_path / "work").glob("test-*"))


def test_a_work_dir_deleted_mid_run_and_a_fresh_worker_resume_from_the_store(
    prefect_harness, local_run, tmp_path, monkeypatch
):
    import tasks.segment
    from tasks import upload_hold

    _, local_config, local_result = local_run
    real_fetch = tasks.segment.fetch_segment_inputs

    def delete_the_run_dir_first(planned, segment_index):
        if segment_index == 1:  # the whole run directory is gone when segment 1 starts
            # Once segment 0's state is stored: its upload runs beside segment 1, and a state lost from the only
            # disk that held it before it was stored is trained again, not resumed (a loaded machine got here first).
            # The upload waits for segment 1's first step (tasks/upload_hold.py): let it go, as that step would.
            upload_hold.release(planned.run_dir, 0)
            store = open_store(planned.storage)
            wait_for(
                lambda: read_bundle_manifest(store, planned.run_id, segment_bundle(0)) is not None, "segment 0 stored"
            )
            shutil.rmtree(planned.run_dir)
        real_fetch(planned, segment_index)

    monkeypatch.setattr(tasks.segment, "fetch_segment_inputs", delete_the_run_dir_first)
    held_out = {"eval_path": str(EXAMPLES / "tiny" / "eval.jsonl")}  # its rows come back from the store too
    config, result = run_flow(tmp_path, data=held_out)
    assert result["losses"] == local_result["losses"] and result["segments_trained"] == 2
    assert list(result["eval_losses"]) == ["2", "5"]  # segment 1 evaluated the held-out rows fetched from the store
    resumed = exported_weights(fetch_checkpoint(config, result, tmp_path / "resumed"))
    baseline = exported_weights(fetch_checkpoint(local_config, local_result, tmp_path / "baseline"))
    assert resumed.keys() == baseline.keys() and all(torch.equal(resumed[k], baseline[k]) for k in baseline)
    # A fresh worker: another, empty work dir on the same store finds everything there.
    fresh_tree = tiny_tree(tmp_path / "fresh", storage={"url": config.storage.url}, data=held_out)
    fresh = config_from_dict(fresh_tree, config_dir=tmp_path)
    again = train_flow(fresh)
    assert again["run_id"] == result["run_id"] and again["losses"] == result["losses"]
    assert again["launch_wall_s"] == 0 and again["export_wall_s"] == 0 and again["segments_reused"] == 2
    assert again["checkpoint_url"] == result["checkpoint_url"]
    stored_ledger = Path(config.storage.url) / result["run_id"] / ledger.LEDGER_FILE
    segment_entries = [
        (e["status"], e.get("segment"))
        for e in map(json.loads, stored_ledger.read_text().splitlines())
        if e["stage"] == "segment"
    ]
    assert ("completed", 1) in segment_entries  # the first worker's history is kept beside the fresh worker's
    assert [entry for entry in segment_entries if entry[0] == "reused"] == [("reused", 0), ("reused", 1)]


def test_retention_in_the_flow_keeps_the_newest_checkpoint_and_a_rerun_publishes_nothing(
    prefect_harness, local_run, tmp_path
):
    """A checkpoint after each segment, storage.keep_last = 1: step 3's checkpoint and segment 0's state go once
    step 6 commits; the results are the local run's (the same run id: retention is not in the digest), and a rerun on
    a fresh work dir trains nothing and does not publish the removed step again."""
    _, local_config, local_result = local_run
    sections = {"export": {"every_n_segments": 1}, "storage": {"keep_last": 1}}
    config, result = run_flow(tmp_path, **sections)
    assert result["run_id"] == local_result["run_id"] and result["losses"] == local_result["losses"]
    store, run_id = open_store(config.storage.url), result["run_id"]
    assert list_checkpoints(store, run_id) == ["step-00000006"] and is_retired(store, run_id, 3)
    for segment, has_state in ((0, False), (1, True)):
        manifest = stored_bundle(store, run_id, segment_bundle(segment))  # the result stays: the segment is done
        assert manifest is not None and any(e.path.startswith("state/") for e in manifest.files) == has_state
    assert not (Path(config.run.work_dir) / run_id / "state" / "segment-0000").exists()
    removed = [e for e in ledger.read(Path(config.run.work_dir) / run_id) if e["stage"] == "retention"]
    assert [(e["step"], e["removed"], e["states_removed"]) for e in removed] == [
        (3, [], []),
        (6, ["step-00000003"], [0]),
    ]
    weights = exported_weights(fetch_checkpoint(config, result, tmp_path / "pulled"))
    baseline = exported_weights(fetch_checkpoint(local_config, local_result, tmp_path / "baseline"))
    assert weights.keys() == baseline.keys() and all(torch.equal(weights[k], baseline[k]) for k in baseline)
    sections["storage"]["url"] = config.storage.url
    again = train_flow(config_from_dict(tiny_tree(tmp_path / "fresh", **sections), config_dir=tmp_path))
    assert again["run_id"] == run_id and again["losses"] == result["losses"] and again["segments_reused"] == 2
    assert again["launch_wall_s"] == 0 and again["export_wall_s"] == 0
