"""The planner's rule over the registry decides exactly as the rule that named each mode did.

`_frozen_choose` is a copy of `MemoryPlanner.choose` as it was before the
backward modes became registered classes (issue 15), kept here unchanged: the
new rule must give the same mode, reason, costs, predicted peak and offload
target on every case, ties and budget boundaries included.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from trainer_core.training.memory import BACKWARD_STATES, MemoryPlanner
from trainer_core.training.memory.estimates import GraphShape


def _frozen_choose(
    planner, shape, resident_bytes, *, replay_bytes, offload_target, offload_frees, retained_inputs_bytes=0
):
    """Today's rule (before issue 15), returning the decision's fields as a tuple."""

    def decide(mode, reason, graph_bytes, estimate=None, offload_s=None, replay_s=None, measured=False):
        predicted = None if graph_bytes is None else resident_bytes + graph_bytes
        planner.choices[mode] += 1
        target = (offload_target if offload_frees else "disk") if mode == "offload" else None
        return (
            mode,
            reason,
            resident_bytes,
            planner.budget_bytes,
            estimate,
            offload_s,
            replay_s,
            measured,
            predicted,
            target,
        )

    if planner.budget_bytes is None:
        return decide("retain", "no budget", None)
    replay_fits = resident_bytes + replay_bytes <= planner.budget_bytes
    to_disk = "" if offload_frees else f"; {offload_target} offload frees no device memory here: offload to disk"
    estimate = planner.saved.estimate(shape)
    if estimate is None:
        if offload_frees:
            return decide("offload", "no evidence yet: offload keeps nothing and measures the bytes", 0.0)
        if replay_fits:
            return decide(
                "replay", "no evidence yet: replay keeps only the inputs and measures the bytes", replay_bytes
            )
        return decide("offload", "no evidence yet: replay's input copies do not fit the budget" + to_disk, 0.0)
    retained_bytes = estimate * (1 + planner.estimate_headroom) + retained_inputs_bytes
    if resident_bytes + retained_bytes <= planner.budget_bytes:
        return decide("retain", "fits the budget", estimate + retained_inputs_bytes, estimate)
    per_byte, measured = planner.offload_s_per_byte(offload_target if offload_frees else "disk")
    offload_s = estimate * per_byte
    replay_s = planner.forward_s_per_token * shape.padded_tokens if planner.forward_s_per_token else math.inf
    costs = dict(estimate=estimate, offload_s=offload_s, replay_s=replay_s, measured=measured)
    if not offload_frees and replay_fits:
        return decide(
            "replay", f"over the budget; {offload_target} offload frees no device memory here", replay_bytes, **costs
        )
    if not replay_fits:
        return decide("offload", "over the budget; replay's input copies do not fit it either" + to_disk, 0.0, **costs)
    if offload_s < replay_s:
        return decide("offload", "over the budget; offload is cheaper", 0.0, **costs)
    return decide("replay", "over the budget; replay is cheaper", replay_bytes, **costs)


class _FixedEstimate:
    """A saved-bytes model that answers one estimate (None: no evidence) and holds no observations."""

    def __init__(self, estimate):
        self._estimate = estimate

    def estimate(self, shape):
        return self._estimate

    def observations(self, shape):
        return []


def _case(seed: int):
    """A random forward and planner state; small integers so that budget boundaries and ties come up often."""
    rng = random.Random(seed)
    tie = rng.random() < 0.2
    batch, seq = (1, 1) if tie else (rng.randint(1, 4), rng.randint(1, 64))
    shape = GraphShape(batch, seq, "logprobs|k=0|adapter=None")
    estimate = None if rng.random() < 0.25 else float(rng.randint(0, 400))
    pack = None if rng.random() < 0.3 else rng.choice([1e-9, 2e-9, 5e-10, rng.random() * 1e-8])
    restore = None if rng.random() < 0.3 else rng.choice([1e-9, 3e-9, rng.random() * 1e-8])
    planner = MemoryPlanner(
        budget_bytes=None if rng.random() < 0.1 else rng.randint(0, 600),
        estimate_headroom=rng.choice([0.0, 0.05, 0.5]),
        pack_s_per_byte=pack,
        restore_s_per_byte=restore,
    )
    planner.saved = _FixedEstimate(estimate)
    target, frees = rng.choice(["host", "disk"]), rng.random() < 0.5
    if tie and estimate is not None:
        # replay_s = forward_s_per_token × 1 token, computed as offload_s is: an exact tie.
        planner.forward_s_per_token = estimate * planner.offload_s_per_byte(target if frees else "disk")[0] or None
    else:
        planner.forward_s_per_token = None if rng.random() < 0.2 else rng.random() * 1e-6
    replay_bytes = rng.randint(0, 300)
    kwargs = dict(offload_target=target, offload_frees=frees)
    stale = rng.choice([0, replay_bytes])
    return planner, shape, rng.randint(0, 500), replay_bytes, stale, kwargs


@pytest.mark.parametrize("seed", range(300))
def test_the_rule_over_the_registry_decides_as_the_rule_that_named_the_modes(seed):
    planner, shape, resident, replay_bytes, stale, kwargs = _case(seed)
    old_planner, _, _, _, _, _ = _case(seed)
    expected = _frozen_choose(
        old_planner, shape, resident, replay_bytes=replay_bytes, retained_inputs_bytes=stale, **kwargs
    )
    decision = planner.choose(shape, resident, input_bytes=replay_bytes, stale_input_bytes=stale, **kwargs)
    got = (
        decision.mode,
        decision.reason,
        decision.resident_bytes,
        decision.budget_bytes,
        decision.estimate_bytes,
        decision.costs["offload_s"],
        decision.costs["replay_s"],
        decision.offload_cost_measured,
        decision.predicted_peak_bytes,
        decision.offload_target,
    )
    assert got == expected
    # Same types too: the history and the miss reports write these as JSON (0.0 is not 0).
    assert [type(v) for v in got] == [type(v) for v in expected]
    assert planner.choices == old_planner.choices == Counter({expected[0]: 1})


def test_the_cases_cover_every_branch_of_the_rule():
    """The random cases above reach every reason the old rule can give, ties included (else they prove little)."""
    reasons, ties = Counter(), 0
    for seed in range(300):
        planner, shape, resident, replay_bytes, stale, kwargs = _case(seed)
        decision = _frozen_choose(
            planner, shape, resident, replay_bytes=replay_bytes, retained_inputs_bytes=stale, **kwargs
        )
        reasons[decision[1].split("; host")[0].split("; disk")[0]] += 1
        ties += decision[5] is not None and decision[5] == decision[6] and decision[1].endswith("cheaper")
    assert len(reasons) == 9, reasons
    assert ties >= 3, ties


def test_every_registered_mode_answers_the_planner():
    """The registry holds one default, one last resort, and distinct names, exploration and tie ranks."""
    assert [cls.mode for cls in BACKWARD_STATES.values()] == list(BACKWARD_STATES)
    states = [cls for cls in BACKWARD_STATES.values() if cls.planned]
    assert sum(cls.is_default for cls in states) == 1
    others = [cls for cls in states if not cls.is_default]
    assert sum(cls.last_resort for cls in others) == 1
    assert len({cls.exploration_rank for cls in others}) == len(others)
    assert len({cls.tie_rank for cls in others}) == len(others)
    assert len({cls.cost_key for cls in others}) == len(others)


def test_the_config_choices_are_the_registry_and_the_planner():
    from trainer_core.config import TrainSection
    from trainer_core.training.memory import PLANNER

    choices = TrainSection.model_json_schema()["properties"]["backward_mode"]["enum"]
    assert choices == [*BACKWARD_STATES, PLANNER] == ["retain", "offload", "replay", "auto"]
    assert TrainSection(backward_mode=PLANNER).forward_mode is None
    assert [TrainSection(backward_mode=mode).forward_mode for mode in BACKWARD_STATES] == list(BACKWARD_STATES)
