"""`python -m bench.ddp_parity`'s pure parts: the phase clock's exclusive accounting and the report's ratios."""

from __future__ import annotations

import time
import types

import pytest

from bench import ddp_parity
from bench._phase_clock import PhaseClock


def test_a_phase_inside_another_is_charged_once_and_other_is_the_rest():
    calls = types.SimpleNamespace()
    calls.inner = lambda: time.sleep(0.02)

    def outer():
        time.sleep(0.03)
        calls.inner()

    calls.outer = outer
    clock = PhaseClock()
    clock.wrap(calls, "inner", "fold")
    clock.wrap(calls, "outer", "optimizer")
    clock.reset()
    started = time.perf_counter()
    calls.outer()
    time.sleep(0.01)
    total = time.perf_counter() - started
    phases = clock.phases(total)
    assert phases["fold"] == pytest.approx(0.02, abs=0.015)
    assert phases["optimizer"] == pytest.approx(0.03, abs=0.015)  # its own 30 ms, not the 20 ms of fold within
    assert phases["other"] == pytest.approx(0.01, abs=0.015)
    assert sum(phases.values()) == pytest.approx(total)
    clock.reset(enabled=False)
    calls.outer()
    assert clock.phases(0.0) == {"other": 0.0}  # a disabled clock charges nothing


def test_the_report_divides_ddp_s_median_step_by_each_reduction_s_and_takes_median_phases():
    phases = [
        {"forward_backward": 1.0, "fold": 0.2, "coordination": 0.01, "optimizer": 0.1, "other": 0.05},
        {"forward_backward": 3.0, "fold": 0.4, "optimizer": 0.3, "other": 0.15},
        {"forward_backward": 2.0, "fold": 0.3, "coordination": 0.03, "optimizer": 0.2, "other": 0.1},
    ]
    figures = {
        "sides": {
            "ddp": {"step_s": [1.0, 3.0, 2.0], "losses": [6.5, 6.0, 5.5], "phases_s": [{"optimizer": 0.5}] * 3},
            "fast": {"step_s": [2.0, 2.5, 9.0], "losses": [6.5, 6.0, 5.5], "phases_s": phases},
            "deterministic": {"step_s": [4.0, 4.0, 1.0], "losses": [6.5, 6.0, 5.5], "phases_s": phases},
        },
        "num_params": 10,
        "world_size": 2,
        "tokens_per_step": 4096,
        "threads_per_process": 1,
    }
    result = ddp_parity.report(figures, reps=3, quick=True)
    assert result["ratio"] == pytest.approx(2.0 / 2.5) and result["higher_is_better"]
    assert result["deterministic"]["ratio"] == pytest.approx(2.0 / 4.0)
    assert result["baseline"]["tokens_per_s"] == pytest.approx(4096 / 2.0)
    assert result["candidate"]["phases_s_median"] == {
        "forward_backward": 2.0,
        "fold": 0.3,
        "coordination": 0.01,  # the step that never entered it counts 0 s
        "optimizer": 0.2,
        "other": 0.1,
    }
    assert result["baseline"]["phases_s_median"]["optimizer"] == 0.5
