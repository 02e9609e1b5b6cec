"""Bad-input cases: the plan's size."""

from __future__ import annotations

from .common import Case

CASES: list[Case] = [
    Case(
        "steps_past_memory",
        "plan",
        r"train\.steps=1000000000000: planning would hold about [\d.]+ [TPE]iB in memory \(.*step order",
        r"lower train\.steps to at most \d+",
        config={"train": {"steps": 10**12}},
    ),
    Case(
        "steps_past_int64",
        "plan",
        r"train\.steps=1180591620717411303424: planning would hold",
        r"lower train\.steps to at most \d+",
        config={"train": {"steps": 2**70, "steps_per_segment": 2**70}},
    ),
    Case(
        "batch_past_memory",
        "plan",
        r"train\.steps=6: planning would hold",
        r"not even one step fits: lower train\.global_batch_size",
        config={"train": {"global_batch_size": 2**40}},
    ),
    Case(
        "packed_rows_past_memory",
        "plan",
        r"train\.steps=6: planning would hold",
        r"lower train\.global_batch_size or data\.max_seq_len \(the row length when packing\)",
        config={"data": {"pack": True, "max_seq_len": 2**40}},
    ),
]
