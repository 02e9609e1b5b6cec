"""`OrderedFolds` and `canonical_norm` (trainer_core/parallel/fsdp/, trainer_core/ranks/): the deterministic reduction and norm of a sharded model.

One torchrun launch per world size runs every check (tests/ranks/sharded_fold_worker.py):
L = 8 logical ranks round-robin over the processes, one of them empty, one turn
aborted after a backward and retried, then a turn whose graph reaches two units
only. References: plain autograd on the unsharded model per logical rank, folded
in logical order by `ordered_fold` (the unsharded trainer's fold); and the other
world sizes' gradients, bit for bit. The canonical norm of the folded shards is
checked against the same norm of the unsharded gradients (bitwise), a float64
oracle, and the other world sizes; a NaN in one process's shard must make it
NaN on every process.
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.sharded_ranks import bitwise, launch_results
from tests.trainer.sharded_ranks import each_rank as each_rank_of
from trainer_core.parallel.fsdp.fold import round_robin_logical_ranks

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2, 4]
WORKER = "tests.ranks.sharded_fold_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[int, dict], object]:
    out = tmp_path_factory.mktemp("folds")
    return {w: launch_results(WORKER, w, ["--out", str(out)]) for w in WORLD_SIZES}, out


def each_rank(runs, world_size: int, check: str) -> list[dict]:
    return each_rank_of(runs[0], world_size, check)  # `runs` is (results by world size, the output folder)


def test_round_robin_runs_every_logical_rank_once_in_turn_order():
    assert [round_robin_logical_ranks(p, 4, 8) for p in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert round_robin_logical_ranks(0, 1, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="logical_dp=6 is not a multiple of the 4 processes; set train.logical_dp"):
        round_robin_logical_ranks(0, 4, 6)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_fold_is_bitwise_the_unsharded_ordered_fold_with_an_empty_rank_and_an_aborted_turn(runs, world_size):
    for result in each_rank(runs, world_size, "fold"):
        assert result["bitwise"], result
        assert result["aborted"] and result["abort_left_gradients_unchanged"], result


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_fold_holds_one_shard_beyond_fsdps_own_buffers(runs, world_size):
    for result in each_rank(runs, world_size, "fold"):
        assert 0 < result["peak_own_bytes"] <= result["largest_shard_bytes"], result


def test_the_gradients_are_bitwise_the_same_at_every_world_size(runs):
    _, out = runs
    grads = {w: torch.load(out / f"W{w}.pt") for w in WORLD_SIZES}
    for w in WORLD_SIZES[1:]:
        assert grads[w].keys() == grads[1].keys()
        different = [name for name in grads[1] if not bitwise(grads[w][name], grads[1][name])]
        assert not different, (w, different)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_after_a_reset_a_partial_graph_folds_the_reached_units_and_adds_zero_to_the_rest(runs, world_size):
    for result in each_rank(runs, world_size, "partial_after_reset"):
        assert result["bitwise"] and result["untouched_are_zero"], result
        assert 0 < result["reached"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_turn_reaching_part_of_a_unit_after_a_full_one_folds_both(runs, world_size):
    for result in each_rank(runs, world_size, "part_of_a_unit"):
        assert result["bitwise"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_an_exception_inside_the_backward_is_aborted_and_the_retry_is_bitwise(runs, world_size):
    for result in each_rank(runs, world_size, "exception_inside_backward"):
        assert result["raised"] and result["resharded_after_abort"], result
        assert result["bitwise"], result


def test_a_missing_gradient_is_named_not_crashed_on():
    from trainer_core.ranks.canonical_norm import canonical_norm

    with pytest.raises(ValueError, match=r"canonical_norm got None at position\(s\) \[1\]: pass only gradients"):
        canonical_norm([torch.ones(2), None])  # type: ignore[list-item]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_backward_outside_a_turn_is_refused_where_a_fold_runs(runs, world_size):
    for result in each_rank(runs, world_size, "outside_a_turn"):
        assert result["refused"] == (world_size > 1), result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_canonical_norm_of_the_shards_is_the_unsharded_norm_to_the_bit_and_a_float64_oracles_to_1e7(
    runs, world_size
):
    results = each_rank(runs, world_size, "norm")
    for result in results:
        assert result["dtype"] == "torch.float32" and result["equals_unsharded"], result
        assert result["hex64"] == result["unsharded_hex64"], result  # float64 too: the sums' order is fixed
        assert result["wide_hex64"] == result["wide_unsharded_hex64"], result
        assert result["narrow_hex64"] == result["narrow_unsharded_hex64"], result  # empty shards at W > 1
        assert result["relative_to_oracle"] < 1e-7, result
        assert result["nan_anywhere_is_nan_everywhere"], result
    assert len({result["hex"] for result in results}) == 1


def test_the_canonical_norm_is_bitwise_the_same_at_every_world_size(runs):
    for key in ("hex", "hex64", "wide_hex64"):
        norms = {w: each_rank(runs, w, "norm")[0][key] for w in WORLD_SIZES}
        assert len(set(norms.values())) == 1, (key, norms)


# HSDP: the same checks over a 2-D mesh (replicas × shards), against the same references and the 1-D runs' bits.
HSDP_MESHES = [(1, 2), (2, 2)]


@pytest.fixture(scope="module")
def hsdp_runs(runs) -> dict[tuple[int, int], dict]:
    _, out = runs
    return {(r, s): launch_results(WORKER, r * s, ["--out", str(out), "--replicas", str(r)]) for r, s in HSDP_MESHES}


def each_hsdp_rank(hsdp_runs, mesh: tuple[int, int], check: str) -> list[dict]:
    return each_rank_of({mesh[0] * mesh[1]: hsdp_runs[mesh]}, mesh[0] * mesh[1], check)


@pytest.mark.parametrize("mesh", HSDP_MESHES)
def test_over_hsdp_the_fold_is_bitwise_the_unsharded_ordered_fold_and_holds_one_shard(hsdp_runs, mesh):
    for result in each_hsdp_rank(hsdp_runs, mesh, "fold"):
        assert result["bitwise"], result
        assert result["aborted"] and result["abort_left_gradients_unchanged"], result
        assert 0 < result["peak_own_bytes"] <= result["largest_shard_bytes"], result
    for check in ("partial_after_reset", "part_of_a_unit", "exception_inside_backward"):
        for result in each_hsdp_rank(hsdp_runs, mesh, check):
            assert result["bitwise"], (check, result)


@pytest.mark.parametrize("mesh", HSDP_MESHES)
def test_over_hsdp_the_gradients_and_the_canonical_norm_are_bitwise_the_1d_runs(runs, hsdp_runs, mesh):
    _, out = runs
    flat = torch.load(out / "W1.pt")
    hybrid = torch.load(out / f"W{mesh[0] * mesh[1]}R{mesh[0]}.pt")
    assert hybrid.keys() == flat.keys()
    assert not [name for name in flat if not bitwise(hybrid[name], flat[name])]
    expected = each_rank(runs, 1, "norm")[0]
    for result in each_hsdp_rank(hsdp_runs, mesh, "norm"):
        assert result["equals_unsharded"] and result["nan_anywhere_is_nan_everywhere"], result
        for key in ("hex", "hex64", "wide_hex64", "narrow_hex64"):
            assert result[key] == expected[key], (key, result)
