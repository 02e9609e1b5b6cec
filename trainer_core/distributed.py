"""Process-group set-up for the ranks torchrun starts, and the rank topology.

A run declares `logical_dp` logical data-parallel ranks; each of the W physical
ranks runs `logical_dp / W` of them, in order. Every rank prints through `log`,
which names the rank, so the launcher can stream all ranks' lines as one log.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .rank_process import die_with_parent, dump_stacks_on, record_error, write_line


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    logical_dp: int

    def __post_init__(self) -> None:
        if self.logical_dp % self.world_size:
            raise ValueError(
                f"logical_dp={self.logical_dp} is not a multiple of world_size={self.world_size}; "
                "launch a number of ranks that divides train.logical_dp"
            )

    @property
    def logical_per_rank(self) -> int:
        return self.logical_dp // self.world_size

    @property
    def local_logical_ranks(self) -> range:
        """The logical ranks this physical rank runs, in logical order."""
        start = self.rank * self.logical_per_rank
        return range(start, start + self.logical_per_rank)


def log(message: str) -> None:
    """One line per call, prefixed with the rank, written whole (see rank_process.write_line)."""
    rank = os.environ.get("RANK", "0")
    for line in str(message).splitlines() or [""]:
        write_line(f"[rank {rank}] {line}")


def init_distributed(logical_dp: int, timeout_s: float) -> Topology:
    """Join torchrun's process group (gloo on CPU, NCCL on GPU), or run alone.

    `timeout_s` (train.collective_timeout_s) bounds every collective, set here
    explicitly rather than inherited from the backend's default (30 min for gloo).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # A bounded timeout turns a dead peer into an error instead of a hang.
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Topology(rank=rank, world_size=world_size, logical_dp=logical_dp)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum_(tensors: list[torch.Tensor]) -> None:
    """Sum tensors over ranks in place, as one flat message."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def run_rank_main(main) -> None:
    """Run a rank's main; on error record it, print it with the rank named and exit 1.

    torchrun then stops the other ranks, so one rank's failure fails the launch
    instead of leaving its peers blocked in a collective. The rank dies with
    torchrun, and prints its stacks on SIGUSR1 (asked by the stall watchdog).
    """
    die_with_parent()
    dump_stacks_on()
    os.dup2(1, 2)  # stderr (warnings, stack dumps) in order with stdout, in the rank's one log
    try:
        main()
    except BaseException as error:  # noqa: BLE001 - report anything, then fail the rank
        import traceback

        record_error(int(os.environ.get("RANK", "0")), error)
        log(f"ERROR {type(error).__name__}: {error}")
        log("".join(traceback.format_exception(error)).rstrip())
        raise SystemExit(1) from None
    finally:
        shutdown_distributed()
