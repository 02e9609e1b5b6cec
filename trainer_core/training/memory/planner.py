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

After the forward the trainer reports the observed peak; a prediction off by
more than `miss_threshold` (relative) is a *miss*: counted, and written as a
JSON report when the planner has a `MissReports` sink.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

from .base import BackwardMode
from .estimates import GraphShape, SavedBytesModel
from .miss_reports import MissReports

DEFAULT_OFFLOAD_BYTES_PER_S = {"host": 10e9, "disk": 1e9}
"""Assumed bytes/s of one direction (pack, or restore) until measured: pinned host copies over PCIe, a local disk."""
DEFAULT_MISS_THRESHOLD = 0.25


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass(frozen=True)
class PlannerDecision:
    """What the planner chose for one forward, and everything it chose from."""

    mode: BackwardMode
    reason: str
    shape: GraphShape
    resident_bytes: int
    """Resident bytes before this forward: live graphs' saved tensors and weight snapshots."""
    budget_bytes: int | None
    estimate_bytes: float | None
    """Bytes a retained graph of this shape is expected to keep."""
    offload_s: float | None
    replay_s: float | None
    offload_cost_measured: bool
    predicted_peak_bytes: float | None
    """Resident bytes expected right after this forward (None without a budget)."""
    observations: tuple = ()
    """The saved-bytes observations behind the estimate, as (batch_size, seq_len, saved_bytes)."""
    offload_target: str | None = None
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

    def choose(self, shape: GraphShape, resident_bytes: int, *, replay_bytes: int, offload_target: str,
               offload_frees: bool, retained_inputs_bytes: int = 0) -> PlannerDecision:
        """Pick the backward state of a forward of `shape`.

        `replay_bytes`: what a replay keeps (input copies); `retained_inputs_bytes`: what a retained graph keeps
        besides its saved tensors (input copies for a replay once stale, under the importance policy);
        `offload_frees`: whether offloading to `offload_target` frees device memory.
        """
        def decide(mode: BackwardMode, reason: str, graph_bytes: float | None, estimate=None, offload_s=None,
                   replay_s=None, measured=False) -> PlannerDecision:
            predicted = None if graph_bytes is None else resident_bytes + graph_bytes
            self.choices[mode] += 1
            seen = tuple(asdict(o) for o in self.saved.observations(shape)) if self.budget_bytes is not None else ()
            target = (offload_target if offload_frees else "disk") if mode == "offload" else None
            return PlannerDecision(mode, reason, shape, resident_bytes, self.budget_bytes, estimate, offload_s,
                                   replay_s, measured, predicted, seen, target)

        if self.budget_bytes is None:
            return decide("retain", "no budget", None)
        replay_fits = resident_bytes + replay_bytes <= self.budget_bytes
        # Disk is where an offload goes when the target frees nothing; it keeps nothing on the device.
        to_disk = "" if offload_frees else f"; {offload_target} offload frees no device memory here: offload to disk"
        estimate = self.saved.estimate(shape)
        if estimate is None:
            if offload_frees:
                return decide("offload", "no evidence yet: offload keeps nothing and measures the bytes", 0.0)
            if replay_fits:
                return decide("replay", "no evidence yet: replay keeps only the inputs and measures the bytes",
                              replay_bytes)
            return decide("offload", "no evidence yet: replay's input copies do not fit the budget" + to_disk, 0.0)
        retained_bytes = estimate * (1 + self.estimate_headroom) + retained_inputs_bytes
        if resident_bytes + retained_bytes <= self.budget_bytes:
            return decide("retain", "fits the budget", estimate + retained_inputs_bytes, estimate)
        per_byte, measured = self.offload_s_per_byte(offload_target if offload_frees else "disk")
        offload_s = estimate * per_byte
        replay_s = self.forward_s_per_token * shape.padded_tokens if self.forward_s_per_token else math.inf
        costs = dict(estimate=estimate, offload_s=offload_s, replay_s=replay_s, measured=measured)
        if not offload_frees and replay_fits:
            return decide("replay", f"over the budget; {offload_target} offload frees no device memory here",
                          replay_bytes, **costs)
        if not replay_fits:
            return decide("offload", "over the budget; replay's input copies do not fit it either" + to_disk, 0.0,
                          **costs)
        if offload_s < replay_s:
            return decide("offload", "over the budget; offload is cheaper", 0.0, **costs)
        return decide("replay", "over the budget; replay is cheaper", replay_bytes, **costs)

    def settle(self, decision: PlannerDecision, observed_peak_bytes: int) -> bool:
        """Compare the prediction with the observed peak; a miss is counted and reported. Returns whether it missed."""
        predicted = decision.predicted_peak_bytes
        if predicted is None:
            return False
        error = abs(observed_peak_bytes - predicted) / max(predicted, 1.0)
        self.history.append({"batch_size": decision.shape.batch_size, "seq_len": decision.shape.seq_len,
                             "choice": decision.mode, "reason": decision.reason, "predicted_peak_bytes": predicted,
                             "observed_peak_bytes": observed_peak_bytes, "offload_s": decision.offload_s,
                             "replay_s": decision.replay_s, "offload_target": decision.offload_target,
                             "miss": error > self.miss_threshold})
        if error <= self.miss_threshold:
            return False
        self.num_misses += 1
        if self.miss_reports is not None:
            self.miss_reports.record(self._miss_report(decision, observed_peak_bytes, error))
        return True

    def _miss_report(self, decision: PlannerDecision, observed: int, error: float) -> dict:
        inputs = {
            "batch_size": decision.shape.batch_size, "seq_len": decision.shape.seq_len,
            "signature": decision.shape.signature, "resident_bytes": decision.resident_bytes,
            "budget_bytes": decision.budget_bytes, "estimate_bytes": decision.estimate_bytes,
            "offload_s": decision.offload_s, "replay_s": decision.replay_s,
            "offload_cost_measured": decision.offload_cost_measured,
            "forward_s_per_token": self.forward_s_per_token, "pack_s_per_byte": self.pack_s_per_byte,
            "restore_s_per_byte": self.restore_s_per_byte,
            "observations": list(decision.observations),
        }
        budget = decision.budget_bytes
        return {"choice": decision.mode, "reason": decision.reason, "inputs": inputs,
                "predicted_peak_bytes": decision.predicted_peak_bytes, "observed_peak_bytes": observed,
                "relative_error": error, "miss_threshold": self.miss_threshold,
                "over_budget": budget is not None and observed > budget}

    # -- evidence --------------------------------------------------------------------

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
        return {"choices": dict(self.choices), "num_misses": self.num_misses,
                "miss_reports": [] if self.miss_reports is None else [p.name for p in self.miss_reports.written],
                "budget_bytes": self.budget_bytes, "forward_s_per_token": self.forward_s_per_token,
                "pack_s_per_byte": self.pack_s_per_byte, "restore_s_per_byte": self.restore_s_per_byte}
