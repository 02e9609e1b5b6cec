"""The shard contract: the tensors of one segment's safetensors file.

S = optimizer steps in the segment, B = `train.global_batch_size` rows per
step (split over logical ranks in equal contiguous slices), T = the row length.

Always present:

| name             | dtype   | shape     | meaning |
|------------------|---------|-----------|---------|
| `input_ids`      | int64   | [S, B, T] | token ids, right-padded with the pad id (`<|endoftext|>`, else 0) |
| `loss_mask`      | bool    | [S, B, T] | token t is a *target*: the loss takes log p(input_ids[t] given the tokens before it in its document), computed from the logits at t-1. False at position 0, at every document's first token, and on padding |
| `attention_mask` | bool    | [S, B, T] | True on real tokens, False on padding |

Packed shards (`data.pack`) add, and then hold several documents per row:

| `position_ids`   | int64   | [S, B, T] | position within the document, restarting at 0 with each; 0 on padding |
| `document_ids`   | int32   | [S, B, T] | 1, 2, … for the documents of a row in order; 0 on padding |

A packed row must be fed as `model(**packed_attention_inputs(input_ids,
position_ids, document_ids))` — never with the 2D `attention_mask`, which would
let documents attend to each other. Unpacked shards hold one document per row,
T = the segment's longest document rounded up to a multiple of 8; packed rows
have T = `data.max_seq_len` rounded up to a multiple of 8.

RL shards (the data holds trajectories) add:

| `advantages`         | float32 | [S, B, T] | the advantage of each target token (given, or group-relative); 0 where `loss_mask` is False |
| `behaviour_logprobs` | float32 | [S, B, T] | log p_behaviour(input_ids[t] given its prefix) at each target token t — aligned with `loss_mask`, not shifted; 0 elsewhere |
| `policy_version`     | int64   | [S, B, T] | the version of the policy that sampled the token's document (per token, since a packed row mixes documents); -1 on padding |

A staleness filter therefore works per token (on the loss tokens of stale
documents), so a packed row keeps the fresh documents it shares with a stale one.

The trainer's per-token logprob of target t is `log_softmax(logits[t-1])[input_ids[t]]`;
the importance ratio is `exp(that − behaviour_logprobs[t])` where `loss_mask[t]`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..data_kinds import PACKED_NAMES, RL_DATA, UNPACKED_NAMES
from .align import Aligned
from .pack import Rows, assign_rows, layout_rows


def round_up(length: int, multiple: int = 8) -> int:
    """A multiple of 8 keeps kernels on their fast paths."""
    return -(-length // multiple) * multiple


def stack_rows(steps: Sequence[Rows], *, packed: bool) -> dict[str, torch.Tensor]:
    """Stack the rows of each step into the [S, B, T] tensors of the contract above."""
    names = UNPACKED_NAMES + (PACKED_NAMES if packed else ())
    if steps[0].advantages is not None:
        names += RL_DATA.columns
    return {name: torch.from_numpy(np.stack([getattr(rows, name) for rows in steps])) for name in names}


def unpacked_steps(documents: Sequence[Aligned], order: np.ndarray, pad_id: int) -> list[Rows]:
    """One document per row; `order` is [S, B] document indices."""
    length = round_up(max(documents[i].num_tokens for i in order.flat))
    return [layout_rows(documents, [[int(i)] for i in step], length, pad_id) for step in order]


def packed_steps(
    documents: Sequence[Aligned],
    stream: Iterator[int],
    num_steps: int,
    num_rows: int,
    row_len: int,
    pad_id: int,
    *,
    shortest: int | None = None,
) -> list[Rows]:
    """Fill each step's `num_rows` rows from `stream` (document indices, in data order) by first fit.

    `shortest`: the shortest document's length, when the caller knows it (a
    plan's documents are read from disk on access: finding it would read them all).
    """
    if shortest is None:
        shortest = min(d.num_tokens for d in documents)
    window_size = num_rows * (row_len // max(shortest, 1)) + 1  # more than can ever fit in one step
    window: list[int] = []
    steps = []
    for _ in range(num_steps):
        while len(window) < window_size:
            window.append(next(stream))
        rows, used = assign_rows([documents[i].num_tokens for i in window], num_rows, row_len)
        steps.append(layout_rows(documents, [[window[j] for j in row] for row in rows], row_len, pad_id))
        window = window[used:]
    return steps
