"""Intra-op CPU threads per process: fixed by the run, never derived from the world size, in deterministic mode.

A CPU kernel that reduces (a sum, a norm, a matmul that splits its inner
dimension) gives each thread a partial result and adds the partials up, so the
same micro-batch can give bitwise different gradients at 1 and at 2 threads.
The launcher's default (cores / processes) would tie the thread count — and so
the bits — to W. With `train.reduction = "deterministic"` every rank therefore
runs `train.threads_per_process` threads (default 1), set before any compute;
`"fast"` keeps the launcher's cores / processes unless the key is set.
"""

from __future__ import annotations

import os

import torch

DETERMINISTIC_DEFAULT_THREADS = 1
"""Threads per process when the run does not say: 1 is the only count every W can run without oversubscribing."""


def threads_for(reduction: str, threads_per_process: int | None) -> int | None:
    """The thread count a rank must run with, or None to keep what the launcher set."""
    if threads_per_process is not None:
        return threads_per_process
    return DETERMINISTIC_DEFAULT_THREADS if reduction == "deterministic" else None


def pin_threads(num_threads: int | None) -> int:
    """Set this process's intra-op threads (torch, OpenMP, MKL) to `num_threads`; returns the count in effect."""
    if num_threads is not None:
        # torch.set_num_threads also tells OpenMP and MKL; the variable is for any child process.
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()
