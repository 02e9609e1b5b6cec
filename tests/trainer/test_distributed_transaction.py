"""Two gloo ranks: a failure on one rank aborts the backward on both, with no accumulator touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.launcher import launch

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def test_a_failing_rank_aborts_the_backward_on_every_rank():
    lines: list[str] = []
    result = launch("tests.trainer.rank_failure_worker", [], nproc_per_node=2, timeout_s=180,
                    env={"PYTHONPATH": str(ROOT)}, on_line=lines.append)
    assert result.returncode == 0, "\n".join(lines[-30:])
    assert any("OK rank 0 stepped=True revision=1" in line for line in lines)
    assert any("OK rank 1 stepped=True revision=1" in line for line in lines)
