"""Two gloo ranks preparing an export: one rank's failure in any phase aborts it on both, naming the
rank, with no temporary files left; a clean preparation splits the verification over the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.launch.launcher import launch

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def test_one_failing_rank_aborts_export_preparation_on_every_rank(tmp_path):
    lines: list[str] = []
    result = launch(
        "tests.trainer.export_failure_worker",
        [str(tmp_path)],
        nproc_per_node=2,
        timeout_s=240,
        env={"PYTHONPATH": str(ROOT)},
        on_line=lines.append,
    )
    assert result.returncode == 0, "\n".join(lines[-40:])
    for phase in ("weights", "write", "verify", "manifest"):
        for rank in (0, 1):
            assert any(f"ABORTED {phase} rank {rank}" in line for line in lines), phase
    assert any("OK rank 0" in line for line in lines) and any("OK rank 1" in line for line in lines)
