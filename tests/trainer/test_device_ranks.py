"""Two ranks on CPU (gloo): data-parallel steps in every backward mode equal one process running both logical ranks.

`bench.gpu_suite` runs the same worker on two GPUs over NCCL when the machine has them.
"""

from __future__ import annotations

import pytest

from tests.trainer.ranks import launch_two_ranks

pytestmark = pytest.mark.distributed


def test_two_gloo_ranks_equal_one_process_running_both_logical_ranks():
    lines = launch_two_ranks("tests.trainer.device_rank_worker", ["cpu"])
    for rank in (0, 1):
        assert any(f"OK rank {rank} cpu data-parallel steps equal one process" in line for line in lines), "\n".join(
            lines[-40:]
        )
