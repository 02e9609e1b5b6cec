"""`save_sharded_checkpoint` / `restore_sharded_checkpoint` (DCP): saved at W = 2, restored at W = 1 and 4.

The reference is the saving run's own weights and AdamW moments, gathered
whole (tests/trainer/sharded_state_worker.py); every restore must reproduce
them bit for bit, resharded, and into an unsharded model too.
"""

from __future__ import annotations

import pytest

from tests.trainer.sharded_ranks import each_rank, launch_results

pytestmark = pytest.mark.distributed

WORKER = "tests.trainer.sharded_state_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    directory = tmp_path_factory.mktemp("sharded_state")
    saved = launch_results(WORKER, 2, ["--save", str(directory)])
    return {2: saved, **{w: launch_results(WORKER, w, ["--load", str(directory)]) for w in (1, 4)}}


def test_every_rank_writes_its_own_shards_and_the_coordinator_the_metadata(runs):
    for result in each_rank(runs, 2, "saved"):
        assert result["sharded"], result
        assert result["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"], result


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_state_saved_at_two_processes_restores_bitwise_at_another_world_size(runs, world_size):
    for result in each_rank(runs, world_size, "restored_sharded"):
        assert result["bitwise"] and result["changed"], result
        assert result["keys"] > 0 and result["revision"] == 2, result
        assert result["new_identity"] and result["no_gradient"], result


def test_a_sharded_state_restores_bitwise_into_an_unsharded_model(runs):
    (result,) = each_rank(runs, 1, "restored_unsharded")
    assert result["bitwise"], result


def test_a_weights_only_restore_leaves_the_optimizer_fresh(runs):
    (result,) = each_rank(runs, 1, "restored_weights_only")
    assert result["bitwise"] and result["optimizer_empty"], result


def test_a_truncated_shard_file_is_named_as_damaged_not_raised_as_a_base_exception(runs):
    (result,) = each_rank(runs, 1, "damaged")
    assert result["raised"], result
    assert "cannot be read" in result["message"] and "resume from the stored run-state bundle" in result["message"]


def test_a_rank_zero_failure_in_the_sharded_save_fails_every_rank_at_once_naming_it(runs):
    """Not a peer waiting in the next barrier until the collective timeout, with the cause hidden."""
    for result in each_rank(runs, 2, "rank_zero_failure"):
        expected = "OSError" if result["rank"] == 0 else "RankFailure"
        assert result["raised"] == expected, result
        assert "injected: the disk refused meta.json" in result["message"], result
        # Every rank names rank 0's OSError: a peer that waited in the next barrier would raise the collective's
        # timeout instead, whatever the time it took.
        assert not result["in_place"], result
