"""Run under torchrun by test_coordinated_failure: one rank fails in each command; every rank must stop, promptly.

Mode `cases` (default): each case makes one rank fail in one command of the
rank-zero or the logical-DP facade, catches what every rank raises, checks it
(the failing rank's own error; elsewhere a RankFailure naming that rank and
its error), logs `OK rank R CASE ELAPSED`, and re-synchronises all ranks
(proving the process group is still consistent) before the next case.

Mode `--exit-on COMMAND`: rank 1 fails in COMMAND and nothing catches it:
the launch must end, every rank with it, in seconds.

Mode `--interrupt-in call|logical_rank`: rank 1 sends itself SIGINT inside a
rank-zero callback or inside a logical rank's block, and nothing catches the
KeyboardInterrupt: its peers must stop on a RankFailure naming rank 1 (not on
a lost connection), and rank 1 on its own KeyboardInterrupt.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from tests.ranks.loops import LOGICAL_DP, make_trainer, sft_batches, sft_loop
from trainer_core.ranks import LogicalDataParallel, RankFailure, exchange, pin_threads, run_rank_zero
from trainer_core.run.distributed import init_distributed, log, run_rank_process
from trainer_core.run.faults import COMMAND_FAULT_ENV

COLLECTIVE_TIMEOUT_S = 1800
"""Above every launch timeout of tests/ranks/test_coordinated_failure.py: a case that waited for a collective's timeout
instead of hearing of the failure is still waiting when its launch is killed, and the test fails."""
RANK_ZERO_COMMANDS = ("forward", "backward", "step", "save", "load", "export", "call")


def _echo(context, value):
    return (context.topology.rank, value)


def _break_on_rank(context, rank: int, where: str) -> None:
    """A real failure inside the trainer on one rank: its forward, its backward, or its optimizer update."""
    if context.topology.rank != rank:
        return
    trainer = context.trainer

    def broken(*args, **kwargs):
        raise RuntimeError(f"{where} broke on rank {rank}")

    if where == "forward":
        trainer.forward = broken
    elif where == "backward":
        trainer._differentiate = broken
    else:
        trainer.checkpoints["base"].apply = broken  # after the step's reduction collectives


def _interrupt_on_rank(context, rank: int) -> None:
    """A real Ctrl-C on one rank: SIGINT to itself, which Python turns into KeyboardInterrupt in this frame."""
    if context.topology.rank == rank:
        signal.raise_signal(signal.SIGINT)
        time.sleep(30)  # not reached: the handler raises as soon as the signal is handled


def _interruptible() -> None:
    """A launcher started in the background may hand its ranks SIGINT ignored; a terminal's Ctrl-C is not."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _raise_on_rank(context, rank: int) -> None:
    if context.topology.rank == rank:
        raise ValueError(f"callback refused its shard on rank {rank}")


def every_command(trainer, state_dir: Path) -> None:
    """A driver that uses each rank-zero command once."""
    batch = sft_batches((8,))[0]
    out = trainer.forward(batch["input_ids"], batch["attention_mask"])
    trainer.backward(-(out.logprobs * batch["loss_mask"][:, 1:]).sum() / batch["loss_mask"][:, 1:].sum())
    trainer.step()
    trainer.save(state_dir / "state", {"next_step": 1})
    trainer.load(state_dir / "state")
    trainer.export(state_dir / "export")
    assert [rank for rank, _ in trainer.call(_echo, "hello")] == list(range(trainer.topology.world_size))


def _expect(case: str, rank: int, failing: int, error: BaseException | None, *, cause: str, where: str | None) -> None:
    assert error is not None, f"{case}: rank {rank} finished although rank {failing} failed"
    if rank == failing:
        assert not isinstance(error, RankFailure) and cause in f"{type(error).__name__}: {error}", (case, repr(error))
        assert any("every rank stopped" in note for note in getattr(error, "__notes__", [])), (case, error.__notes__)
    else:
        assert isinstance(error, RankFailure), (case, repr(error))
        assert error.failed_ranks == [failing] and f"rank {failing}: {cause}" in str(error), (case, str(error))
        assert where is None or f"(in {where})" in str(error), (case, str(error))


def run_case(topology, case: str, failing: int, cause: str, body, where: str | None = None) -> None:
    started = time.monotonic()
    error = None
    try:
        body()
    except BaseException as raised:  # noqa: BLE001 - checked below (KeyboardInterrupt included)
        error = raised
    elapsed = time.monotonic() - started
    _expect(case, topology.rank, failing, error, cause=cause, where=where)
    exchange("resync", None)  # every rank is here, and the group still works
    log(f"OK rank {topology.rank} {case} {elapsed:.2f}s")


def rank_zero_cases(topology, workdir: Path) -> None:
    for command in RANK_ZERO_COMMANDS:
        os.environ[COMMAND_FAULT_ENV] = f"{command}:1"
        run_case(
            topology,
            f"rank-zero {command}",
            1,
            f"InjectedFault: injected fault in {command} on rank 1",
            lambda: run_rank_zero(make_trainer(), topology, lambda t: every_command(t, workdir)),
        )
        del os.environ[COMMAND_FAULT_ENV]
    os.environ[COMMAND_FAULT_ENV] = "step:0"
    run_case(
        topology,
        "rank-zero step on rank 0",
        0,
        "InjectedFault: injected fault in step on rank 0",
        lambda: run_rank_zero(make_trainer(), topology, lambda t: every_command(t, workdir)),
    )
    del os.environ[COMMAND_FAULT_ENV]
    for where in ("forward", "backward", "step"):

        def broken_loop(trainer, where=where):
            trainer.call(_break_on_rank, 1, where)
            sft_loop(trainer, sft_batches((8, 8)))

        run_case(
            topology,
            f"rank-zero {where} inside the trainer",
            1,
            f"RuntimeError: {where} broke on rank 1",
            lambda: run_rank_zero(make_trainer(), topology, broken_loop),
        )
    run_case(
        topology,
        "rank-zero callback",
        1,
        "ValueError: callback refused its shard on rank 1",
        lambda: run_rank_zero(make_trainer(), topology, lambda t: t.call(_raise_on_rank, 1)),
    )

    for rank in (1, 0):  # a peer interrupted inside a command, and rank 0 (the driver's own rank)
        run_case(
            topology,
            f"rank-zero interrupt on rank {rank}",
            rank,
            "KeyboardInterrupt",
            lambda: run_rank_zero(make_trainer(), topology, lambda t: t.call(_interrupt_on_rank, rank)),
        )

    def driver_bug(trainer):
        trainer.forward(*[sft_batches((4,))[0][k] for k in ("input_ids", "attention_mask")])
        raise KeyError("the driver's own bug")

    run_case(
        topology,
        "rank-zero driver",
        0,
        'KeyError: "the driver\'s own bug"',
        lambda: run_rank_zero(make_trainer(), topology, driver_bug),
    )


def logical_dp_cases(topology) -> None:
    batch = sft_batches((8,))[0]

    def spmd(where: str):
        trainer = make_trainer()
        ldp = LogicalDataParallel(trainer, topology)
        if topology.rank == 1 and where in ("forward", "backward"):
            _break_on_rank(type("Context", (), {"topology": topology, "trainer": trainer}), 1, where)
        for shard in ldp.forward_batches(batch, step=0):
            with shard:
                out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"])
                trainer.backward(-(out.logprobs * shard.rows["loss_mask"][:, 1:]).sum())
        ldp.step()
        with ldp.command("save"):
            pass

    for where, fault in (
        ("forward", None),
        ("backward", None),
        ("step", "step:1"),
        ("save", "save:1"),
        ("logical rank", "logical_rank:1"),
    ):
        if fault:
            os.environ[COMMAND_FAULT_ENV] = fault
        cause = (
            f"RuntimeError: {where} broke on rank 1"
            if fault is None
            else f"InjectedFault: injected fault in {fault.split(':')[0]} on rank 1"
        )
        in_shard = where in ("forward", "backward", "logical rank")  # the failing logical rank is named
        run_case(
            topology,
            f"logical-dp {where}",
            1,
            cause,
            lambda: spmd(where),
            where=f"logical rank {topology.logical_per_rank}" if in_shard else None,
        )
        os.environ.pop(COMMAND_FAULT_ENV, None)

    def interrupted_shard():
        trainer = make_trainer()
        for shard in LogicalDataParallel(trainer, topology).forward_batches(batch, step=0):
            with shard:
                _interrupt_on_rank(type("Context", (), {"topology": topology}), 1)

    run_case(
        topology,
        "logical-dp interrupt",
        1,
        "KeyboardInterrupt",
        interrupted_shard,
        where=f"logical rank {topology.logical_per_rank}",
    )


def interrupted(topology, where: str) -> None:
    """Rank 1 is interrupted in a callback or a logical rank's block; nothing here catches it."""
    if where == "call":
        run_rank_zero(make_trainer(), topology, lambda t: t.call(_interrupt_on_rank, 1))
    else:
        trainer = make_trainer()
        for shard in LogicalDataParallel(trainer, topology).forward_batches(sft_batches((8,))[0], step=0):
            with shard:
                _interrupt_on_rank(type("Context", (), {"topology": topology}), 1)
    raise AssertionError(f"the {where} finished although rank 1 was interrupted")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit-on", default=None)
    parser.add_argument("--interrupt-in", choices=("call", "logical_rank"), default=None)
    args = parser.parse_args()
    pin_threads(1)
    _interruptible()
    topology = init_distributed(logical_dp=LOGICAL_DP, timeout_s=COLLECTIVE_TIMEOUT_S)
    if args.interrupt_in:
        log(f"interrupting rank 1 in {args.interrupt_in} at {time.time():.3f}")
        interrupted(topology, args.interrupt_in)
    with tempfile.TemporaryDirectory() as workdir:
        if args.exit_on:
            os.environ[COMMAND_FAULT_ENV] = f"{args.exit_on}:1"
            log(f"failing in {args.exit_on} at {time.time():.3f}")
            run_rank_zero(make_trainer(), topology, lambda t: every_command(t, Path(workdir)))
            raise AssertionError("every_command finished although rank 1 failed")
        rank_zero_cases(topology, Path(workdir))
        logical_dp_cases(topology)
    log(f"OK rank {topology.rank} all cases")


if __name__ == "__main__":
    run_rank_process(main)
