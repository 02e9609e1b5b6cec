"""The memory planner: per graph, retain, offload or replay, from a budget and measured costs.

With no budget every graph is retained and nothing is measured. With a budget
of resident bytes — saved tensors of live graphs plus the weight snapshots
stale graphs hold — the planner, per forward:

1. estimates the bytes a retained graph of this shape keeps (`estimates.py`:
   fitted to the saved tensors of earlier forwards, padding included);
2. retains it if `resident + estimate·(1 + estimate_headroom) <= budget` (the
   headroom covers a shape between the observed ones, where the fit can be
   a fraction of a percent low);
3. otherwise compares the measured costs of the two ways to keep (almost)
   nothing on the device: offload = estimate × (pack + restore seconds per
   byte, timed on the copies themselves, synchronised on CUDA), replay = one
   more forward (seconds per padded token, timed on forwards with grad), and
   takes the cheaper.

The budget bounds every mode: a replay keeps copies of the inputs, so it is
chosen only where they fit too. Offload keeps nothing on the device — except
host offload on a CPU-only machine, where host memory is the device memory:
there it frees nothing and is never chosen, and where replay does not fit
either the graph is offloaded to disk (`PlannerDecision.offload_target`).
Only what no mode can shed (weight snapshots already held) can exceed it.

With no evidence yet (the first forward of a shape signature), the default
is to offload the graph when offloading frees device memory — it keeps
nothing resident and measures both the bytes a retained graph would keep and
what moving them costs — and to replay it otherwise (the replay's forward in
backward measures the bytes). Until a pack or a restore has been timed, its
cost is the documented default `DEFAULT_OFFLOAD_BYTES_PER_S` for the target.

The rule itself names no mode: it walks `BACKWARD_STATES` and asks each
class (`costs.PlanInputs` in, bytes, seconds and reason strings out), so the
modes above are what the three registered classes answer, and a new mode is
considered without an edit here.

After the forward the trainer reports the observed peak; a prediction off by
more than `miss_threshold` (relative) is a *miss*: counted, and written as a
JSON report when the planner has a `MissReports` sink.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import cast

from .base import AlternativeMode, DefaultMode
from .costs import Evidence, OffloadTarget, PlanInputs
from .estimates import GraphShape, SavedBytesModel
from .miss_reports import MissReports
from .registry import BACKWARD_STATES

DEFAULT_OFFLOAD_BYTES_PER_S = {"host": 10e9, "disk": 1e9}
"""Assumed bytes/s of one direction (pack, or restore) until measured: pinned host copies over PCIe, a local disk."""
DEFAULT_MISS_THRESHOLD = 0.25


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def _planned_roles() -> tuple[type[DefaultMode], list[type[AlternativeMode]]]:
    """The planned modes of `BACKWARD_STATES` by role: the default (exactly one), and the others in registry order."""
    states = [cls for cls in BACKWARD_STATES.values() if cls.planned]
    # The registry is typed by BackwardState; a planned mode has its role's members too (memory/base.py).
    default = cast("type[DefaultMode]", next(cls for cls in states if cls.is_default))
    return default, [cast("type[AlternativeMode]", cls) for cls in states if not cls.is_default]


def _exploration_rank(cls: type[AlternativeMode]) -> int:
    rank = cls.exploration_rank
    assert rank is not None  # every planned mode but the default explores
    return rank


@dataclass(frozen=True)
class PlannerDecision:
    """What the planner chose for one forward, and everything it chose from."""

    mode: str
    reason: str
    shape: GraphShape
    resident_bytes: int
    """Resident bytes before this forward: live graphs' saved tensors and weight snapshots."""
    budget_bytes: int | None
    estimate_bytes: float | None
    """Bytes a retained graph of this shape is expected to keep."""
    costs: dict
    """Each non-default mode's extra seconds under its `cost_key` (`offload_s`, `replay_s`; None: not compared)."""
    offload_cost_measured: bool
    predicted_peak_bytes: float | None
    """Resident bytes expected right after this forward (None without a budget)."""
    observations: tuple = ()
    """The saved-bytes observations behind the estimate, as (batch_size, seq_len, saved_bytes)."""
    offload_target: OffloadTarget | None = None
    """Where an offloaded graph's tensors go: the trainer's target, or disk where that frees nothing."""


@dataclass
class MemoryPlanner:
    budget_bytes: int | None = None
    """Resident bytes allowed over all live graphs, snapshots included (None: no limit, always retain)."""
    miss_threshold: float = DEFAULT_MISS_THRESHOLD
    """A prediction whose relative error exceeds this is a miss (counted, and reported to `miss_reports`)."""
    miss_reports: MissReports | None = None
    estimate_headroom: float = 0.05
    """Relative margin added to a retained graph's estimate before comparing it with the budget."""
    saved: SavedBytesModel = field(default_factory=SavedBytesModel)
    pack_s_per_byte: float | None = None
    restore_s_per_byte: float | None = None
    forward_s_per_token: float | None = None
    """Seconds of a forward with grad per padded token: what a replay costs."""
    choices: Counter = field(default_factory=Counter)
    num_misses: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=256))
    """The most recent settled decisions: shape, choice, reason, predicted and observed peak, miss."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes={self.budget_bytes} must be >= 0 (or None for no limit)")
        if not self.miss_threshold > 0:
            raise ValueError(f"miss_threshold={self.miss_threshold} must be > 0 (a relative error, e.g. 0.25)")
        if not self.estimate_headroom >= 0:
            raise ValueError(f"estimate_headroom={self.estimate_headroom} must be >= 0 (e.g. 0.05)")

    @property
    def measuring(self) -> bool:
        """Whether forwards, copies and saved bytes are timed and counted (only with a budget to plan for)."""
        return self.budget_bytes is not None

    # -- the decision ---------------------------------------------------------------

    def offload_s_per_byte(self, target: str) -> tuple[float, bool]:
        """Pack + restore seconds per byte, and whether both were measured (else the target's default fills in)."""
        default = 1.0 / DEFAULT_OFFLOAD_BYTES_PER_S[target]
        pack = self.pack_s_per_byte if self.pack_s_per_byte is not None else default
        restore = self.restore_s_per_byte if self.restore_s_per_byte is not None else default
        return pack + restore, self.pack_s_per_byte is not None and self.restore_s_per_byte is not None

    def choose(
        self,
        shape: GraphShape,
        resident_bytes: int,
        *,
        input_bytes: int,
        offload_target: OffloadTarget,
        offload_frees: bool,
        stale_input_bytes: int = 0,
    ) -> PlannerDecision:
        """Pick the backward state of a forward of `shape`, among `BACKWARD_STATES`.

        `input_bytes`: what a copy of the forward's inputs keeps; `stale_input_bytes`: what a graph that is not a
        replay keeps besides its saved tensors (input copies for its replay once stale, under the importance
        policy); `offload_frees`: whether offloading to `offload_target` frees device memory.

        The rule names no mode: with no budget, the default; with no evidence yet, the available mode of lowest
        `exploration_rank`; when the default fits the budget, the default; otherwise the cheapest available mode
        (`extra_seconds`; ties to the lower `tie_rank`). Where no mode is available, the `last_resort`.
        """
        default, others = _planned_roles()
        if self.budget_bytes is None:
            return self._decide(default, default.no_budget_reason, shape, resident_bytes, None, None)
        per_byte, measured = self.offload_s_per_byte(offload_target if offload_frees else "disk")
        inputs = PlanInputs(
            shape,
            resident_bytes,
            self.budget_bytes,
            self.saved.estimate(shape),
            self.estimate_headroom,
            input_bytes,
            stale_input_bytes,
            offload_target,
            offload_frees,
            per_byte,
            measured,
            self.forward_s_per_token,
        )
        available = [cls for cls in others if cls.available(inputs)]
        if inputs.exploring:
            if available:
                chosen = min(available, key=_exploration_rank)
                return self._decide(
                    chosen, "no evidence yet: " + chosen.exploration_reason, shape, resident_bytes, inputs, None
                )
            return self._last_resort(others, "no evidence yet: ", inputs, None)
        if inputs.fits(default.budgeted_bytes(inputs)):
            return self._decide(default, default.fits_reason, shape, resident_bytes, inputs, None)
        costs = {cls: cls.extra_seconds(inputs) for cls in others}
        if not available:
            return self._last_resort(others, "over the budget; ", inputs, costs)
        if len(available) == 1:
            excluded = [cls.unavailable_reason(inputs) for cls in others if cls not in available]
            return self._decide(
                available[0], "over the budget; " + "; ".join(excluded), shape, resident_bytes, inputs, costs
            )
        chosen: type[AlternativeMode] | None = None
        for cls in sorted(available, key=lambda cls: cls.tie_rank):
            if chosen is None or costs[cls] < costs[chosen]:  # strictly cheaper, else the lower tie rank keeps it
                chosen = cls
        assert chosen is not None  # `available` holds two modes or more here
        return self._decide(chosen, "over the budget; " + chosen.cheaper_reason, shape, resident_bytes, inputs, costs)

    def _last_resort(self, others: list, prefix: str, inputs: PlanInputs, costs: dict | None) -> PlannerDecision:
        """No mode keeps within the budget: the last resort, and why every other one did not."""
        chosen = next(cls for cls in others if cls.last_resort)
        why = [cls.unavailable_reason(inputs) for cls in others if cls is not chosen]
        return self._decide(
            chosen,
            prefix + "; ".join([*why, chosen.last_resort_reason(inputs)]),
            inputs.shape,
            inputs.resident_bytes,
            inputs,
            costs,
        )

    def _decide(
        self, cls, reason: str, shape: GraphShape, resident_bytes: int, inputs: PlanInputs | None, costs: dict | None
    ) -> PlannerDecision:
        graph_bytes = None if inputs is None else cls.planned_bytes(inputs)
        predicted = None if graph_bytes is None else resident_bytes + graph_bytes
        self.choices[cls.mode] += 1
        seen = tuple(asdict(o) for o in self.saved.observations(shape)) if self.budget_bytes is not None else ()
        recorded = {other.cost_key: None if costs is None else costs[other] for other in _planned_roles()[1]}
        return PlannerDecision(
            cls.mode,
            reason,
            shape,
            resident_bytes,
            self.budget_bytes,
            None if inputs is None else inputs.estimate,
            recorded,
            costs is not None and inputs is not None and inputs.copy_cost_measured,
            predicted,
            seen,
            None if inputs is None else cls.placement(inputs),
        )

    def settle(self, decision: PlannerDecision, observed_peak_bytes: int) -> bool:
        """Compare the prediction with the observed peak; a miss is counted and reported. Returns whether it missed."""
        predicted = decision.predicted_peak_bytes
        if predicted is None:
            return False
        error = abs(observed_peak_bytes - predicted) / max(predicted, 1.0)
        self.history.append(
            {
                "batch_size": decision.shape.batch_size,
                "seq_len": decision.shape.seq_len,
                "choice": decision.mode,
                "reason": decision.reason,
                "predicted_peak_bytes": predicted,
                "observed_peak_bytes": observed_peak_bytes,
                **decision.costs,
                "offload_target": decision.offload_target,
                "miss": error > self.miss_threshold,
            }
        )
        if error <= self.miss_threshold:
            return False
        self.num_misses += 1
        if self.miss_reports is not None:
            self.miss_reports.record(self._miss_report(decision, observed_peak_bytes, error))
        return True

    def _miss_report(self, decision: PlannerDecision, observed: int, error: float) -> dict:
        inputs = {
            "batch_size": decision.shape.batch_size,
            "seq_len": decision.shape.seq_len,
            "signature": decision.shape.signature,
            "resident_bytes": decision.resident_bytes,
            "budget_bytes": decision.budget_bytes,
            "estimate_bytes": decision.estimate_bytes,
            **decision.costs,
            "offload_cost_measured": decision.offload_cost_measured,
            "forward_s_per_token": self.forward_s_per_token,
            "pack_s_per_byte": self.pack_s_per_byte,
            "restore_s_per_byte": self.restore_s_per_byte,
            "observations": list(decision.observations),
        }
        budget = decision.budget_bytes
        return {
            "choice": decision.mode,
            "reason": decision.reason,
            "inputs": inputs,
            "predicted_peak_bytes": decision.predicted_peak_bytes,
            "observed_peak_bytes": observed,
            "relative_error": error,
            "miss_threshold": self.miss_threshold,
            "over_budget": budget is not None and observed > budget,
        }

    # -- evidence --------------------------------------------------------------------

    def observe(self, shape: GraphShape | None, evidence: Evidence) -> None:
        """Fold what a forward (of `shape`) or a backward measured into the estimates."""
        if evidence.pack is not None:
            self.observe_pack(*evidence.pack)
        if evidence.forward_s is not None:
            assert shape is not None
            self.observe_forward(shape, evidence.forward_s)
        if evidence.saved_bytes is not None:
            assert shape is not None
            self.observe_saved(shape, evidence.saved_bytes)
        if evidence.restore is not None:
            self.observe_restore(*evidence.restore)

    def observe_saved(self, shape: GraphShape, saved_bytes: int) -> None:
        """Bytes a graph of this shape saved (or would have kept, had it been retained)."""
        self.saved.observe(shape, saved_bytes)

    def observe_forward(self, shape: GraphShape, seconds: float) -> None:
        if shape.padded_tokens and seconds > 0:
            self.forward_s_per_token = _ema(self.forward_s_per_token, seconds / shape.padded_tokens)

    def observe_pack(self, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > 0:
            self.pack_s_per_byte = _ema(self.pack_s_per_byte, seconds / num_bytes)

    def observe_restore(self, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > 0:
            self.restore_s_per_byte = _ema(self.restore_s_per_byte, seconds / num_bytes)

    def summary(self) -> dict:
        """Choices made, misses, and the measured costs: what a segment result records."""
        return {
            "choices": dict(self.choices),
            "num_misses": self.num_misses,
            "miss_reports": [] if self.miss_reports is None else [p.name for p in self.miss_reports.written],
            "budget_bytes": self.budget_bytes,
            "forward_s_per_token": self.forward_s_per_token,
            "pack_s_per_byte": self.pack_s_per_byte,
            "restore_s_per_byte": self.restore_s_per_byte,
        }
