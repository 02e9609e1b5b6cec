"""Planner miss reports: when a graph's observed peak differs from the prediction, say so in a small JSON file.

A report holds what the planner decided from (the graph's shape, the resident
bytes, the budget, the saved-bytes estimate and the observations behind it,
the measured costs), what it chose, and the predicted and observed peak. The
directory is bounded: at most `max_reports` files of at most
`max_report_bytes` each; misses past that are still counted. Each file is
written aside and renamed, so a reader never sees half a report.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...files import write_text_atomic

MAX_REPORTS = 16
MAX_REPORT_BYTES = 16 * 1024


class MissReports:
    def __init__(
        self,
        directory: Path,
        *,
        prefix: str = "",
        max_reports: int = MAX_REPORTS,
        max_report_bytes: int = MAX_REPORT_BYTES,
    ):
        if max_reports < 0 or max_report_bytes < 512:
            raise ValueError(f"max_reports={max_reports} must be >= 0 and max_report_bytes={max_report_bytes} >= 512")
        self.directory = Path(directory)
        self.prefix = prefix
        self.max_reports = max_reports
        self.max_report_bytes = max_report_bytes
        self.num_misses = 0
        self.written: list[Path] = []

    def record(self, report: dict) -> Path | None:
        """Count the miss; write its report unless the bound is reached. Returns the file written, if any."""
        self.num_misses += 1
        if len(self.written) >= self.max_reports:
            return None
        text = _bounded_json(report, self.max_report_bytes)
        path = self.directory / f"{self.prefix}miss-{len(self.written) + 1:03d}.json"
        write_text_atomic(path, text)
        self.written.append(path)
        return path


def _bounded_json(report: dict, max_bytes: int) -> str:
    """The report as JSON within `max_bytes`: the observation list shrinks first, then goes."""
    report = dict(report)
    inputs = dict(report.get("inputs", {}))
    observations = list(inputs.get("observations", []))
    while True:
        inputs["observations"] = observations
        report["inputs"] = inputs
        text = json.dumps(report, indent=1, sort_keys=True)
        if len(text.encode()) <= max_bytes:
            return text
        if observations:
            observations = observations[len(observations) // 2 + 1 :] if len(observations) > 1 else []
            continue
        report["inputs"] = {k: v for k, v in inputs.items() if isinstance(v, (int, float, str, bool)) or v is None}
        report["truncated"] = True  # scalars only: a few hundred bytes
        return json.dumps(report, sort_keys=True)
