"""`python -m bench.launch`: the pure parts that turn a launch's timestamps into its breakdown (no launch here)."""

from __future__ import annotations

import os
import time

import pytest

from bench import launch
from trainer_core.run.launch_phases import LaunchPhases, process_start_time

LAUNCH = 1000.0
RECORDS = [
    {
        "event": "ready",
        "time": 1004.5,
        "phases": {
            "process_start": 1001.0,
            "imports_done": 1003.5,
            "process_group": 1003.75,
            "model_built": 1004.0,
            "state_loaded": 1004.25,
            "shard_loaded": 1004.4,
        },
    },
    {"event": "step", "time": 1005.0},
    {"event": "step", "time": 1006.0},
    {"event": "step", "time": 1007.5},
    {"event": "saving", "time": 1007.6},
    {"event": "saved", "time": 1008.0},
]


def test_a_launch_is_split_at_each_mark_and_the_pieces_sum_to_its_wall():
    pieces = launch.breakdown(launch.segment_marks(LAUNCH, 1010.0, RECORDS))
    assert pieces == {
        "torchrun_agent_s": 1.0,
        "interpreter_imports_s": 2.5,
        "process_group_s": 0.25,
        "model_build_s": 0.25,
        "state_load_s": 0.25,
        "shard_and_ready_s": 0.25,
        "first_step_s": 0.5,
        "later_steps_s": 2.5,
        "save_s": 0.5,
        "exit_s": 2.0,
        "to_first_step_s": 5.0,
        "wall_s": 10.0,
    }
    assert sum(v for k, v in pieces.items() if k not in ("to_first_step_s", "wall_s")) == pieces["wall_s"]


def test_a_ready_record_without_marks_merges_the_set_up_into_one_named_piece():
    """Code from before the marks (the `before` side of a comparison) still gets a breakdown that sums up."""
    records = [{**RECORDS[0], "phases": {}}, *RECORDS[1:]]
    pieces = launch.breakdown(launch.segment_marks(LAUNCH, 1010.0, records))
    merged = "torchrun_agent+interpreter_imports+process_group+model_build+state_load+shard_and_ready_s"
    assert pieces[merged] == 4.5 and "process_group_s" not in pieces
    assert sum(v for k, v in pieces.items() if k not in ("to_first_step_s", "wall_s")) == pieces["wall_s"] == 10.0


def test_the_floor_and_the_medians():
    floor = launch.floor_breakdown(LAUNCH, 1004.0, {"process_start": 1001.0, "imports_done": 1002.5, "ready": 1003.0})
    assert floor == {
        "torchrun_agent_s": 1.0,
        "interpreter_imports_s": 1.5,
        "process_group_s": 0.5,
        "exit_s": 1.0,
        "to_ready_s": 3.0,
        "wall_s": 4.0,
    }
    assert launch.medians([{"a": 1.0, "b": 5.0}, {"a": 3.0}, {"a": 2.0, "b": 1.0}]) == {"a": 2.0}


def test_import_costs_are_summed_per_package_from_importtime_output():
    stderr = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       500 |        500 |     torch._C",
            "import time:      1500 |       2000 |   torch",
            "import time:    250000 |     250000 |       transformers.models",
            "import time:     50000 |     302000 | trainer_core.model",
            "some other line",
        ]
    )
    assert launch.import_costs_by_package(stderr) == {"transformers": 0.25, "trainer_core": 0.05, "torch": 0.002}


def test_a_rank_s_marks_start_at_the_process_s_own_start_on_the_wall_clock():
    """A child forked at a known wall-clock time gives that time (btime + ticks, as psutil computes it, was up to a
    second early here: btime is whole seconds and the wall clock drifts from the boot clock)."""
    read_end, write_end = os.pipe()
    time.sleep(0.2)  # the child's start is not this process's
    forked_at = time.time()
    child = os.fork()
    if child == 0:  # the child: its first moment, then its own start as it computes it; then leave at once
        running_at = time.time()
        os.close(read_end)
        os.write(write_end, f"{running_at!r} {process_start_time()!r}".encode())
        os._exit(0)
    os.close(write_end)
    running_at, reported = (float(value) for value in os.read(read_end, 128).decode().split())
    os.close(read_end)
    os.waitpid(child, 0)
    # Between the fork's call and the child's first moment (a large process forks for tens of ms), to a tick.
    assert forked_at - 0.011 <= reported <= running_at + 0.011
    before = time.time()
    phases = LaunchPhases.starting()
    phases.mark("process_group")
    assert list(phases.marks) == ["process_start", "imports_done", "process_group"]
    assert phases.marks["process_start"] <= before <= phases.marks["imports_done"] <= phases.marks["process_group"]


def test_the_floor_takes_its_start_as_a_segment_s_rank_does():
    """The floor script (run by path, without rankflow) reads the rank's clock, so the two splits line up."""
    import runpy

    floor = runpy.run_path(str(launch.FLOOR_SCRIPT), run_name="floor")
    theirs, ours = floor["_process_start_time"](), process_start_time()
    assert theirs is not None and ours is not None
    assert abs(theirs - ours) <= 0.011  # the same process, the same clock, to a tick


def test_a_checkout_without_the_trainer_core_is_refused_with_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--code", str(tmp_path)])
    assert exit_.value.code == 2
    assert "holds no trainer_core/run/segment_main.py; pass a rankflow checkout" in capsys.readouterr().err
