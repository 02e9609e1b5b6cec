"""`rankflow run` before its flow starts and after it: the memory table comes first, wall_s counts from the start.

In process, with the flow replaced by one that records what the command had
already written when the run began, and the start of Prefect's temporary
server recorded instead of made (the real `validate_inputs`, store check and
memory model run first). The references: the kernel's record of this
process's start (`process_start_time`), and a start set 1000 s back.
"""

from __future__ import annotations

import json
import time

import flows.cli.parser
import flows.pipeline
import flows.temporary_server
from flows.cli import main
from tests.conftest import EXAMPLES
from trainer_core.run.launch_phases import process_start_time

STARTED_AGO_S = 1000.0


def test_the_command_starts_when_its_process_did_and_a_call_from_python_when_called():
    before = time.time()
    as_command = flows.cli.parser.command_started_s(None)
    kernel = process_start_time()
    assert kernel is not None and abs(as_command - kernel) <= 0.011  # the same clock, to a tick
    assert as_command < before  # this process started before this test ran
    assert before <= flows.cli.parser.command_started_s(["run", "x.toml"]) <= time.time()


def test_the_memory_table_is_shown_before_the_flow_and_wall_s_counts_from_the_command_s_start(
    tmp_path, capsys, monkeypatch
):
    seen = {}

    def seen_err() -> str:
        seen["before"] = seen.get("before", "") + capsys.readouterr().err
        return seen["before"]

    def flow(config):
        seen["stderr"] = seen_err()  # what the command had shown when the run began
        return {
            "run_id": "r",
            "status": "completed",
            "checkpoint_url": None,
            "steps": 0,
            "losses": [],
            "launch_wall_s": 0.0,
            "export_wall_s": 0.0,
            "train_s": 0.0,
        }

    monkeypatch.setattr(flows.pipeline, "train_flow", flow)
    # Prefect's temporary server is not needed by this flow: the command's call to start it is recorded instead.
    monkeypatch.setattr(flows.temporary_server, "start_temporary_server", lambda: seen.setdefault("server", seen_err()))
    # The command's process started STARTED_AGO_S ago (its interpreter, imports, config checks)
    monkeypatch.setattr(flows.cli.parser, "command_started_s", lambda argv: time.time() - STARTED_AGO_S)
    monkeypatch.chdir(tmp_path)
    argv = ["run", str(EXAMPLES / "tiny_sft.toml"), "--set", f"run.work_dir={tmp_path}/work"]
    code = main([*argv, "--set", f"storage.url={tmp_path}/store", "--set", 'tracking.backend="none"'])
    out, err = capsys.readouterr()
    assert code == 0, err
    table = seen["server"].splitlines()  # before Prefect's server starts, and so before the flow
    assert table and table[0].startswith("memory per rank (") and table[-1].startswith("  ("), seen["server"]
    assert seen["stderr"] == seen["server"]
    assert "memory per rank" not in err  # shown once, before the run
    assert json.loads(out.splitlines()[-1])["wall_s"] >= STARTED_AGO_S
