"""Replayed backward state: keep inputs, RNG and autocast state; re-run the forward.

Restoring the RNG state makes dropout draw the same masks in the replay as in
the original forward, so a fresh replayed graph has the gradient of plain
autograd.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class ReplayState:
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    device_type: str
    autocast_enabled: bool
    autocast_dtype: torch.dtype | None
    saved_bytes: int

    @classmethod
    def capture(cls, device: torch.device, inputs: list[torch.Tensor]) -> "ReplayState":
        device_type = device.type
        cuda_rng = torch.cuda.get_rng_state(device) if device_type == "cuda" else None
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if enabled else None
        saved = sum(t.numel() * t.element_size() for t in inputs if t is not None)
        return cls(torch.get_rng_state(), cuda_rng, device_type, enabled, dtype, saved)

    @contextlib.contextmanager
    def restored(self):
        """Run the replay with the forward's RNG and autocast state; the caller's RNG is untouched."""
        devices = [torch.cuda.current_device()] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng)
            with torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_enabled):
                yield
