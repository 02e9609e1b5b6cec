"""Two gloo ranks: which checkpoints step, and with what settings, is agreed by every rank."""

from __future__ import annotations

import pytest

from tests.trainer.ranks import launch_two_ranks

pytestmark = pytest.mark.distributed


def test_every_rank_steps_the_same_checkpoints_with_the_same_settings():
    lines = launch_two_ranks("tests.trainer.optimizer_rank_worker")
    for rank in (0, 1):
        for what in (
            "no-gradient checkpoint did not step",
            "one-rank gradient stepped on every rank",
            "parameter without gradient on any rank left alone",
            "mismatched learning_rate refused",
            "mismatched checkpoints refused",
        ):
            assert any(f"OK rank {rank} {what}" in line for line in lines), (rank, what, "\n".join(lines[-40:]))
