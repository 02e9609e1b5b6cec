"""Which failures a rank reports to its peers before raising them (W = 1: the exchange is this process's own).

An exchanged failure carries the note `COMMAND failed, every rank stopped
(rank R: …)`; one that is not exchanged leaves the block bare. The real
multi-rank run (a SIGINT on rank 1 of two) is in test_coordinated_failure.
"""

from __future__ import annotations

import pytest

from trainer_core.ranks import coordinated


def _notes(error: BaseException) -> list[str]:
    return getattr(error, "__notes__", [])


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_a_command_is_exchanged_then_raised_as_itself(interrupt):
    with pytest.raises(interrupt) as raised:
        with coordinated("forward", where="logical rank 1"):
            raise interrupt()
    expected = f"forward failed, every rank stopped (rank 0: {interrupt.__name__} (in logical rank 1))"
    assert _notes(raised.value) == [expected]


def test_an_interrupt_in_work_that_holds_collectives_is_not_exchanged():
    """Peers may wait in the step's next collective, not at the exchange: the rank leaves instead."""
    with pytest.raises(KeyboardInterrupt) as raised:
        with coordinated("step", collectives=True):
            raise KeyboardInterrupt
    assert _notes(raised.value) == []
    with pytest.raises(ValueError) as failed:  # an ordinary error there is still exchanged, as before
        with coordinated("step", collectives=True):
            raise ValueError("bad step")
    assert _notes(failed.value) == ["step failed, every rank stopped (rank 0: ValueError: bad step)"]


def test_closing_an_abandoned_command_runs_no_exchange():
    command = coordinated("forward")
    command.__enter__()
    closing = GeneratorExit()
    assert command.__exit__(GeneratorExit, closing, None) is False  # not suppressed: it propagates, unexchanged
    assert _notes(closing) == []
