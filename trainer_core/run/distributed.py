"""Process-group set-up for the ranks torchrun starts.

A run declares `logical_dp` logical data-parallel ranks; each of the W physical
ranks runs `logical_dp / W` of them (`trainer_core.ranks.Topology`): a
contiguous block in logical order, or round-robin where the segment asks for it
(a sharded model under the deterministic reduction, `sharded_facade`).
The topology is checked before the process group is created, so a bad one
fails at once on every rank. Every rank prints through `log`, which names the
rank, so the launcher can stream all ranks' lines as one log.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer_core.ranks.coordination import RankFailure
from trainer_core.ranks.topology import Assignment, Topology, check_topology
from trainer_core.run.process_boot import die_with_parent
from trainer_core.run.rank_process import dump_stacks_on, leave_now, record_error, write_line

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Topology", "init_distributed", "log", "run_rank_main", "run_rank_process", "shutdown_distributed"]


def log(message: str) -> None:
    """One line per call, prefixed with the rank, written whole (see rank_process.write_line)."""
    rank = os.environ.get("RANK", "0")
    for line in str(message).splitlines() or [""]:
        write_line(f"[rank {rank}] {line}")


def init_distributed(
    logical_dp: int, timeout_s: float, global_batch_size: int | None = None, *, assignment: Assignment = "contiguous"
) -> Topology:
    """Check the topology, then join torchrun's process group (gloo on CPU, NCCL on GPU), or run alone.

    A world size that does not divide `logical_dp` (or a `logical_dp` that does
    not divide `global_batch_size`) raises ValueError before any process group
    exists. `timeout_s` (train.collective_timeout_s) bounds every collective,
    set here explicitly rather than inherited from the backend's default (30 min for gloo).
    `assignment`: how logical ranks map to processes (`Topology.assignment`); rows, seeds and the fold order
    depend on the logical rank alone, so it decides only which process runs which logical rank.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    check_topology(world_size, logical_dp, global_batch_size)
    topology = Topology(rank=rank, world_size=world_size, logical_dp=logical_dp, assignment=assignment)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # A bounded timeout turns a dead peer into an error instead of a hang.
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return topology


def training_mesh(topology: Topology) -> DeviceMesh:
    """The 1-D mesh of the training processes FSDP shards over (`train.sharding = "fsdp"`; collective).

    A run of one process has no process group (init_distributed runs it alone): FSDP still needs one, so a
    single-process group over an in-memory store is made, and shut down with the others.
    """
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage] - public, missing from __all__
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    return init_device_mesh(device, (topology.world_size,))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run_rank_main(main) -> None:
    """Run a rank's main; on error record it, print it with the rank named and exit 1.

    torchrun then stops the other ranks, so one rank's failure fails the launch
    instead of leaving its peers blocked in a collective. A `RankFailure` (a
    peer failed and this rank stopped with it, see `trainer_core.ranks`) is
    printed but not recorded: the failing rank recorded its own error, and the
    launcher names the first failing rank from the records. The rank dies with
    torchrun, the parent the launch named (armed already when the launcher
    started it through `trainer_core.run.process_boot`; a rank started otherwise
    arms here), and prints its stacks on SIGUSR1 (asked by the stall watchdog).
    """
    die_with_parent()
    dump_stacks_on()
    os.dup2(1, 2)  # stderr (warnings, stack dumps) in order with stdout, in the rank's one log
    try:
        main()
    except BaseException as error:  # noqa: BLE001 - report anything, then fail the rank
        import traceback

        if not isinstance(error, RankFailure):
            record_error(int(os.environ.get("RANK", "0")), error)
        log(f"ERROR {type(error).__name__}: {error}")
        log("".join(traceback.format_exception(error)).rstrip())
        raise SystemExit(1) from None
    finally:
        shutdown_distributed()


def run_rank_process(main) -> None:
    """`run_rank_main` for the rank process itself (its `__main__`): then leave at once with `leave_now`.

    A rank that returns into the interpreter's teardown can die there after its work is done: C++ threads of
    torch's process-group and checkpoint machinery still joinable when their statics are destroyed abort the
    process ("terminate called without an active exception", SIGABRT), and torchrun fails the whole launch.
    Seen in about 1 launch in 5 of a two-rank FSDP worker on CPU; a rank that skips the teardown cannot.
    """
    run_rank_main(main)
    leave_now(0)
