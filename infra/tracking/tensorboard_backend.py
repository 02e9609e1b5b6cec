"""TensorBoard: event files under `URI/RUN_ID` (torch's SummaryWriter), read back with TensorBoard's own reader."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from .backend import TrackingBackend, flat_params


class TensorBoardBackend(TrackingBackend):
    def start(self, params: Callable[[], Mapping[str, object]]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(self.uri) / self.run_id
        first = not self.log_dir.exists()
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        if first:
            self.writer.add_text("params", f"```\n{json.dumps(flat_params(params()), indent=1)}\n```", global_step=0)

    def logged_through(self) -> int | None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(self.log_dir), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        if "loss" not in events.Tags()["scalars"]:
            return None
        return max(event.step for event in events.Scalars("loss"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # on disk before the step counts as logged

    def tag(self, key: str, value: str) -> None:
        self.writer.add_text(key, value)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
