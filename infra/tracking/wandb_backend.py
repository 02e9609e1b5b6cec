"""Weights & Biases: one W&B run per rankflow run (its id derived from the run id), offline unless WANDB_MODE says.

W&B keeps no step history a client can read offline, so the last step logged is kept beside its files
(`rankflow-RUN_ID.json`, written after each step's `log` returns). W&B itself also drops a step lower than
one it holds, so an online run is not doubled either.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from .backend import TrackingBackend


class WandbBackend(TrackingBackend):
    @property
    def marker(self) -> Path:
        return Path(self.uri) / f"rankflow-{self.run_id}.json"

    def start(self, params: Callable[[], Mapping[str, object]]) -> None:
        import wandb

        Path(self.uri).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.experiment,
            id=re.sub(r"[^A-Za-z0-9_-]", "_", self.run_id),
            name=self.run_id,
            dir=self.uri,
            mode=os.environ.get("WANDB_MODE", "offline"),  # pyright: ignore[reportArgumentType] - no network unless asked
            resume="allow",
            config=dict(params()),
            settings=wandb.Settings(console="off", silent=True),
        )

    def logged_through(self) -> int | None:
        if not self.marker.is_file():
            return None
        return int(json.loads(self.marker.read_text())["logged_through"])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)
        tmp = self.marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"logged_through": step}))
        tmp.replace(self.marker)

    def tag(self, key: str, value: str) -> None:
        self.run.summary[key] = value

    def close(self) -> None:
        self.run.finish()
