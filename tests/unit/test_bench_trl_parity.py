"""`python -m bench.trl_parity`: the pure parts (the rows TRL trains, the timing of a command, the medians), and
its refusal without TRL. Neither side is launched here."""

from __future__ import annotations

import sys

import pytest
import torch

from bench import trl_parity


def test_the_rows_are_the_plan_s_unpadded_in_step_then_row_order_with_the_loss_mask():
    # Two segments; the first of 2 steps, the second of 1, each step 2 rows of length 4 with right padding.
    ids = torch.arange(24).reshape(3, 2, 4)
    attention = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool().expand(3, 2, 4)
    loss = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]).bool().expand(3, 2, 4)
    shards = {
        1: {"input_ids": ids[2:], "attention_mask": attention[2:], "loss_mask": loss[2:]},
        0: {"input_ids": ids[:2], "attention_mask": attention[:2], "loss_mask": loss[:2]},
    }
    rows = trl_parity.plan_rows(shards)
    assert rows["input_ids"] == [[0, 1, 2], [4, 5], [8, 9, 10], [12, 13], [16, 17, 18], [20, 21]]
    assert rows["completion_mask"] == [[0, 1, 1], [0, 1]] * 3


def test_a_command_is_timed_to_its_exit_and_to_its_last_line():
    script = "import time; print('first'); print('last', flush=True); time.sleep(0.5)"
    timed = trl_parity.run_timed([sys.executable, "-c", script], cwd=trl_parity.ROOT, env={"PATH": "/usr/bin:/bin"})
    assert timed["lines"] == ["first", "last"]
    assert timed["after_last_line_s"] >= 0.45 and timed["wall_s"] >= timed["after_last_line_s"]
    with pytest.raises(RuntimeError, match="exited 3"):
        trl_parity.run_timed([sys.executable, "-c", "raise SystemExit(3)"], cwd=trl_parity.ROOT, env={})


def test_medians_take_numbers_and_keep_the_rest():
    runs = [{"wall_s": 3.0, "status": "completed", "ok": True}, {"wall_s": 1.0, "status": "completed", "ok": True}]
    assert trl_parity.medians([*runs, {"wall_s": 2.0, "status": "x", "ok": False}]) == {
        "wall_s": 2.0,
        "status": "completed",
        "ok": True,
    }


def test_without_trl_the_bench_exits_2_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(trl_parity.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_:
        trl_parity.main(["--quick"])
    assert exit_.value.code == 2
    assert "TRL is not installed; install the bench extra: pip install -e '.[bench]'" in capsys.readouterr().err
