"""A step's rows cut to the padding they need: each logical rank's rows to its own longest row, not the segment's.

The plan pads every unpacked row of a segment to the segment's longest
document (`shards.py`: the shard is one [S, B, T] tensor per name), so a
step of short rows would run on the columns of the longest row anywhere in
the segment. The loop trims each logical rank's rows to their own longest
real row, rounded up to a multiple of 8 (`shards.round_up`, the kernels' fast
paths), just before the forward: the shard stays bitwise what the plan wrote.

Why the results do not change: unpacked rows are right-padded and the model
is causal, so a real token attends to no padding column; padding carries no
loss token (`loss_mask` is False there) and no RL figure (0, or -1 for the
policy version). Dropping trailing all-padding columns removes only work
whose outputs nothing reads — the sums are the same up to the last bits that
other matmul shapes give. The cut depends only on the logical rank's own
rows, which are the same at every world size, so a deterministic run stays
bitwise the same at any W.

Packed rows (`position_ids` present) are left as planned: they are filled to
`data.max_seq_len` already, and leaving them alone keeps a packed run's
results bitwise what they were.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .shards import round_up

TRIM_MULTIPLE = 8
"""Rows are cut to a multiple of this many columns (the rounding the plan's own row lengths use)."""


def real_length(attention_mask: torch.Tensor) -> int:
    """One past the last column where any row holds a real token (0 for no real token)."""
    columns = attention_mask.any(dim=0).nonzero()
    return int(columns[-1]) + 1 if columns.numel() else 0


def trim_padding(rows: Mapping[str, torch.Tensor], multiple: int = TRIM_MULTIPLE) -> dict[str, torch.Tensor]:
    """`rows` ([B, T] tensors of one logical rank) cut to `round_up(longest real row, multiple)` columns.

    Packed rows, rows without padding columns to drop and an empty share come back as they are (the same tensors).
    """
    if "position_ids" in rows or rows["attention_mask"].shape[0] == 0:
        return dict(rows)
    num_columns = rows["attention_mask"].shape[1]
    # At least one column: a forward over zero columns has nothing to return, and the row has no loss token anyway.
    length = min(num_columns, round_up(max(real_length(rows["attention_mask"]), 1), multiple))
    if length == num_columns:
        return dict(rows)
    return {name: tensor[:, :length].contiguous() for name, tensor in rows.items()}
