"""Which launch lines become Prefect log rows (`tasks._logging.PersonLines`), against hand-written expectations."""

from __future__ import annotations

from tasks._logging import PersonLines


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str]] = []

    def info(self, msg: str) -> None:
        self.rows.append(("info", msg))

    def warning(self, msg: str) -> None:
        self.rows.append(("warning", msg))

    def error(self, msg: str) -> None:
        self.rows.append(("error", msg))


def test_rank_zero_step_lines_are_sent_at_a_bounded_rate_and_its_other_lines_always():
    now = [0.0]
    recorder = _Recorder()
    lines = PersonLines(recorder, every_s=30, clock=lambda: now[0])
    lines("[rank 0] segment 0: steps 0..999, 2 rank(s) x 1 logical, setup 0.20s")
    for step in range(1000):  # one step every 0.1 s: 100 s of training
        now[0] = step * 0.1
        lines(f"[rank 0] step {step} loss 6.9000 grad_norm 1.000")
        lines(f"[rank 1] step {step} bookkeeping nobody reads")
    lines("[rank 0] segment 0 done: loss 6.9910 -> 6.0634, 1000 tokens/s, state 1 bytes")
    steps = [msg for level, msg in recorder.rows if " step " in msg]
    assert steps == [f"[rank 0] step {s} loss 6.9000 grad_norm 1.000" for s in (0, 300, 600, 900)]
    assert recorder.rows[0][1].startswith("[rank 0] segment 0: steps") and recorder.rows[-1][1].endswith("1 bytes")
    assert len(recorder.rows) == 6


def test_every_warning_and_error_of_every_rank_is_sent_with_its_whole_traceback():
    recorder = _Recorder()
    lines = PersonLines(recorder)
    traceback = [
        "[node 1] [rank 3] Traceback (most recent call last):",
        '[node 1] [rank 3]   File "segment.py", line 12, in train',
        "[node 1] [rank 3]     raise ValueError(bad)",
        "[node 1] [rank 3] ValueError: the batch is empty",
    ]
    for line in [
        "[rank 2] plain chatter",
        "[rank 2] /x.py:3: UserWarning: TypedStorage is deprecated",
        "W1204 12:00:00.000 77 torch/distributed/run.py:793] Setting OMP_NUM_THREADS",
        "I1204 12:00:00.000 77 torch/distributed/elastic/agent.py:1] starting workers",
        *traceback,
        "[node 1] [rank 3] after the error: plain again",
        "[rank 1] ERROR rank 1 failed: killed by SIGKILL",
        "",
    ]:
        lines(line)
    assert recorder.rows == [
        ("warning", "[rank 2] /x.py:3: UserWarning: TypedStorage is deprecated"),
        ("warning", "W1204 12:00:00.000 77 torch/distributed/run.py:793] Setting OMP_NUM_THREADS"),
        *[("error", line) for line in traceback],
        ("error", "[rank 1] ERROR rank 1 failed: killed by SIGKILL"),
    ]
