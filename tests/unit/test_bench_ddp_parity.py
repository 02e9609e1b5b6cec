"""`python -m bench.ddp_parity`'s pure parts: the phase clock's exclusive accounting and the report's ratios."""

from __future__ import annotations

import types

import pytest

from bench import ddp_parity
from bench._phase_clock import PhaseClock


def test_a_phase_inside_another_is_charged_once_and_other_is_the_rest():
    now = [0.0]
    calls = types.SimpleNamespace()

    def inner():
        now[0] += 0.02

    def outer():
        now[0] += 0.03
        calls.inner()

    calls.inner, calls.outer = inner, outer
    clock = PhaseClock(now=lambda: now[0])
    clock.wrap(calls, "inner", "fold")
    clock.wrap(calls, "outer", "optimizer")
    clock.reset()
    calls.outer()
    phases = clock.phases(0.06)  # 10 ms of the step outside both
    assert phases == pytest.approx({"fold": 0.02, "optimizer": 0.03, "other": 0.01})  # not 50 ms of optimizer
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
            "ddp": {
                "step_s": [1.0, 3.0, 2.0],
                "cpu_s": [1.0, 1.0, 1.0],
                "losses": [6.5, 6.0, 5.5],
                "phases_s": [{"optimizer": 0.5}] * 3,
            },
            "fast": {
                "step_s": [2.0, 2.5, 9.0],
                "cpu_s": [2.0, 2.0, 2.0],
                "losses": [6.5, 6.0, 5.5],
                "phases_s": phases,
            },
            "deterministic": {
                "step_s": [4.0, 4.0, 1.0],
                "cpu_s": [1.0, 1.0, 1.0],
                "losses": [6.5, 6.0, 5.5],
                "phases_s": phases,
            },
        },
        "num_params": 10,
        "world_size": 2,
        "tokens_per_step": 4096,
        "threads_per_process": 1,
    }
    result = ddp_parity.report(figures, reps=3, quick=True)
    assert result["ratio"] == pytest.approx(2.0 / 2.5) and result["higher_is_better"]
    assert result["deterministic"]["ratio"] == pytest.approx(2.0 / 4.0)
    assert result["paired_ratio"] == pytest.approx(0.5)  # rounds: 1/2, 3/2.5, 2/9
    assert result["deterministic"]["paired_ratio"] == pytest.approx(0.75)  # 1/4, 3/4, 2/1
    assert result["cpu_ratio"] == pytest.approx(0.5) and result["deterministic"]["cpu_ratio"] == pytest.approx(1.0)
    assert result["baseline"]["tokens_per_s"] == pytest.approx(4096 / 2.0)
    assert result["candidate"]["phases_s_median"] == {
        "forward_backward": 2.0,
        "fold": 0.3,
        "coordination": 0.01,  # the step that never entered it counts 0 s
        "optimizer": 0.2,
        "other": 0.1,
    }
    assert result["baseline"]["phases_s_median"]["optimizer"] == 0.5
