"""Coordinated failure: an error on any rank, in any command, fails every rank at once, naming the rank and why.

Every command of the facades (a logical rank's forward and backward, the
step, save, export, a callback) ends in a *status exchange*: each rank says
whether it failed (one small all-gather). A rank that raised still joins the
exchange — it catches its error, reports it and only then raises — so its
peers never wait in a collective for a rank that left. After the exchange
every rank knows the outcome: the failing rank re-raises its own exception
(its type still says what went wrong, with a note naming the command), every
other rank raises `RankFailure` naming the failing rank(s) and their errors.
That holds for any exception, KeyboardInterrupt and SystemExit included: a
Ctrl-C on one rank stops its peers with a RankFailure naming it, never with a
lost connection.

A command whose own work contains collectives (the step's reduction, the
export's weight check) exchanges once before them, so no rank enters a
collective that a failed peer will never join. An error that escapes a
collective itself (a peer died) is not exchanged: the rank exits and torchrun
stops the others; the collective timeout (`train.collective_timeout_s`)
bounds the wait of a rank blocked on a silent peer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

_COORDINATED = "_rankflow_coordinated"
_MAX_STATUS_CHARS = 2000


class RankFailure(RuntimeError):
    """A command failed on another rank; this rank stopped with it. `failures` lists (rank, "Type: message")."""

    def __init__(self, command: str, failures: list[tuple[int, str]]):
        self.command = command
        self.failures = failures
        ranks = ", ".join(str(rank) for rank, _ in failures)
        causes = "; ".join(f"rank {rank}: {status}" for rank, status in failures)
        super().__init__(f"{command} failed on rank {ranks} ({causes}); every rank stopped")

    @property
    def failed_ranks(self) -> list[int]:
        return [rank for rank, _ in self.failures]


def describe(error: BaseException) -> str:
    """One line for the other ranks: the type and the message (the type alone when it has none), bounded."""
    message = str(error)
    return (f"{type(error).__name__}: {message}" if message else type(error).__name__)[:_MAX_STATUS_CHARS]


def is_coordinated(error: BaseException) -> bool:
    """Whether every rank already raised this failure together (no exchange needed)."""
    return bool(getattr(error, _COORDINATED, False))


def raised_together(error: BaseException) -> BaseException:
    """Mark `error` as raised on every rank at once (each decided it from values all ranks exchanged)."""
    setattr(error, _COORDINATED, True)
    return error


def coordinated_error(command: str, error: BaseException | None, failures: list[tuple[int, str]]) -> BaseException:
    """What this rank raises once every rank knows `failures`: its own error if it failed, else RankFailure."""
    if error is not None and is_coordinated(error):
        return error  # already raised on every rank (an earlier exchange of the same command)
    if error is not None and not isinstance(error, RankFailure):
        causes = "; ".join(f"rank {rank}: {status}" for rank, status in failures)
        error.add_note(f"{command} failed, every rank stopped ({causes})")
        raised = error
    else:
        raised = error if isinstance(error, RankFailure) else RankFailure(command, failures)
    setattr(raised, _COORDINATED, True)
    return raised


def primary_failures(failures: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The failures that are causes: a rank that only stopped because another failed (RankFailure) is an effect."""
    causes = [(rank, status) for rank, status in failures if not status.startswith(f"{RankFailure.__name__}: ")]
    return causes or failures


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def exchange(command: str, error: BaseException | None, payload: Any = None, *, where: str | None = None) -> list[Any]:
    """Every rank reports its outcome (and a small payload); raise on every rank if any failed.

    Returns every rank's payload, by rank, when all succeeded. `where` names,
    in this rank's status, what it was doing (e.g. its logical rank).
    """
    status = None if error is None else describe(error) + (f" (in {where})" if where else "")
    if _world_size() == 1:
        gathered: list = [(status, payload)]
    else:
        gathered = [None] * _world_size()
        dist.all_gather_object(gathered, (status, payload))
    failures = [(rank, rank_status) for rank, (rank_status, _) in enumerate(gathered) if rank_status is not None]
    if failures:
        raise coordinated_error(command, error, failures)
    return [rank_payload for _, rank_payload in gathered]


def reportable(error: BaseException, *, collectives: bool = False) -> bool:
    """Whether a rank reports `error` to its peers before raising it.

    A KeyboardInterrupt (Ctrl-C, SIGINT) or SystemExit on one rank is a
    failure like any other: were it let through, its peers would wait in the
    exchange for a rank that left and stop on a lost connection, with no word
    of which rank stopped or why. Two exceptions to that:

    - GeneratorExit is not a failure of the work: it closes an abandoned
      command (garbage collection), where no collective may run;
    - in work that holds collectives (`collectives=True`: the step's
      reduction), an interrupt can land between two of them, while the peers
      wait in the next one and not at the exchange: the exchange would be
      matched against the wrong collective. The rank leaves instead, and its
      peers fail on the lost connection (the launch names the interrupted
      rank from its error record).
    """
    if isinstance(error, GeneratorExit):
        return False
    return isinstance(error, Exception) or not collectives


@contextlib.contextmanager
def coordinated(
    command: str, *, where: str | None = None, collectives: bool = False, lockstep: bool = False
) -> Iterator[None]:
    """Run the body as one command: whatever it raises, this rank joins the status exchange first.

    The failing rank's own exception — a KeyboardInterrupt included — is
    raised again once every rank knows of it (with a note naming the command).
    `collectives`: the body runs collectives of its own (see `reportable`).
    `lockstep`: the body is a chain of collectives every rank runs with no
    exchange before them (a sharded model's forward and backward: FSDP's
    all-gathers and reduce-scatters). A rank that fails anywhere in it may
    leave its peers inside a collective it never joins, where an exchange
    would be matched against the wrong collective (gloo aborts the process on
    the size mismatch, and no rank says why). So a failure is not exchanged:
    the rank leaves with its error (recorded by `run_rank_main`), its peers
    fail on the lost connection, and the launch names this rank and its cause
    from its error record (`infra.launch.failures.diagnose_launch`).
    """
    error: BaseException | None = None
    try:
        yield
    except BaseException as failure:  # noqa: BLE001 - reported to every rank, then raised
        if is_coordinated(failure) or lockstep or not reportable(failure, collectives=collectives):
            raise  # every rank raised it together (nobody waits in an exchange), or it cannot be exchanged here
        error = failure
    exchange(command, error, where=where)
