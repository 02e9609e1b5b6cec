"""Stage 5, pack: documents into fixed-length rows, with per-document position ids
and attention boundaries.

`assign_rows` decides which documents share a row (first fit, in data order);
`layout_rows` writes the rows; `packed_attention_inputs` turns a packed row into
the keyword arguments of a Hugging Face causal LM so that each document attends
only to itself — packed and unpacked rows give the same per-token logprobs.

Unpacked data is the special case of one document per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from .align import Aligned
from .tokenize import array_digest


@dataclass(frozen=True)
class Rows:
    """Rows of documents, each array [R, T] (see `shards` for the meaning of each)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    document_ids: np.ndarray
    behaviour_logprobs: np.ndarray | None = None
    advantages: np.ndarray | None = None
    policy_version: np.ndarray | None = None
    documents: tuple[tuple[int, ...], ...] = field(default=())
    """The document indices in each row, in order."""

    def arrays(self) -> dict[str, np.ndarray]:
        names = (
            "input_ids",
            "loss_mask",
            "attention_mask",
            "position_ids",
            "document_ids",
            "behaviour_logprobs",
            "advantages",
            "policy_version",
        )
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def digest(self) -> str:
        arrays = self.arrays()
        return array_digest(*(arrays[name] for name in sorted(arrays)))


def assign_rows(lengths: Sequence[int], num_rows: int, row_len: int) -> tuple[list[list[int]], int]:
    """First fit, in order: each document goes into the first of `num_rows` rows with room.

    Stops at the first document that fits no row (it opens the next batch), so
    the data order is kept. Returns the rows (indices into `lengths`) and how
    many documents they hold (a prefix of `lengths`).
    """
    if num_rows < 1:
        raise ValueError(f"num_rows={num_rows}: need at least one row")
    free = [row_len] * num_rows
    rows: list[list[int]] = [[] for _ in range(num_rows)]
    for index, length in enumerate(lengths):
        if length > row_len:
            raise ValueError(
                f"document {index} has {length} tokens, more than a row holds ({row_len}); apply max_seq_len first"
            )
        row = next((r for r in range(num_rows) if free[r] >= length), None)
        if row is None:
            return rows, index
        rows[row].append(index)
        free[row] -= length
    return rows, len(lengths)


@dataclass(frozen=True)
class _RlColumns:
    """The RL arrays of a layout: present for every row, or for none."""

    logprobs: np.ndarray
    advantages: np.ndarray
    versions: np.ndarray

    @classmethod
    def empty(cls, shape: tuple[int, int]) -> _RlColumns:
        return cls(
            np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.float32), np.full(shape, -1, dtype=np.int64)
        )


def layout_rows(documents: Sequence[Aligned], rows: Sequence[Sequence[int]], row_len: int, pad_id: int) -> Rows:
    """Write each row's documents one after another, right-padded to `row_len`.

    Position ids restart at 0 with each document; document ids count 1, 2, …
    within the row (0 is padding). A document's first token is never a target:
    in a packed row the token before it belongs to another document.
    """
    num_rows = len(rows)
    shape = (num_rows, row_len)
    input_ids = np.full(shape, pad_id, dtype=np.int64)
    loss_mask = np.zeros(shape, dtype=bool)
    attention_mask = np.zeros(shape, dtype=bool)
    position_ids = np.zeros(shape, dtype=np.int64)
    document_ids = np.zeros(shape, dtype=np.int32)
    carries_advantages = any(documents[i].advantages is not None for row in rows for i in row)
    rl = _RlColumns.empty(shape) if carries_advantages else None
    for r, row in enumerate(rows):
        cursor = 0
        for number, index in enumerate(row, start=1):
            doc = documents[index]
            n = doc.num_tokens
            if cursor + n > row_len:
                raise ValueError(f"row {r}: documents {list(row)} need more than {row_len} tokens")
            span = slice(cursor, cursor + n)
            input_ids[r, span] = doc.input_ids
            loss_mask[r, span] = doc.loss_mask
            loss_mask[r, cursor] = False
            attention_mask[r, span] = True
            position_ids[r, span] = np.arange(n)
            document_ids[r, span] = number
            if rl is not None:
                if doc.advantages is None or doc.behaviour_logprobs is None or doc.policy_version is None:
                    raise ValueError(f"document {index} has no RL arrays but shares a batch with RL documents")
                rl.logprobs[r, span] = doc.behaviour_logprobs
                rl.advantages[r, span] = doc.advantages
                rl.versions[r, span] = doc.policy_version
            cursor += n
    if rl is not None:
        # Values only where the loss is taken, so a shard never carries a logprob
        # for a token that no document predicts (a first token, a truncated tail).
        rl.logprobs[~loss_mask] = 0.0
        rl.advantages[~loss_mask] = 0.0
    return Rows(
        input_ids=input_ids,
        loss_mask=loss_mask,
        attention_mask=attention_mask,
        position_ids=position_ids,
        document_ids=document_ids,
        behaviour_logprobs=rl.logprobs if rl else None,
        advantages=rl.advantages if rl else None,
        policy_version=rl.versions if rl else None,
        documents=tuple(tuple(row) for row in rows),
    )


def pack(documents: Sequence[Aligned], num_rows: int, row_len: int, pad_id: int) -> tuple[Rows, int]:
    """Stage 5: pack a prefix of `documents` into `num_rows` rows; returns the rows and the count used."""
    rows, used = assign_rows([d.num_tokens for d in documents], num_rows, row_len)
    return layout_rows(documents, rows, row_len, pad_id), used


def packed_attention_inputs(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    document_ids: torch.Tensor,
    *,
    mode: Literal["position_ids", "mask"] = "position_ids",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The keyword arguments for a Hugging Face causal LM's forward on packed rows [B, T].

    Both modes pass `use_cache=False`: with a KV cache (the default of most
    configs, even in training mode) transformers skips packing detection.

    mode="position_ids" (default) passes `input_ids` and `position_ids` and NO
    `attention_mask`: transformers (>= the masking_utils rewrite; checked on
    5.24) then detects packing where a position id does not follow its
    predecessor by one, and builds a block-diagonal causal mask for the sdpa,
    eager and flex kernels (flash-attention uses the same positions for varlen).
    Memory stays O(B·T). Padding sits at the end of a row, where causality
    already keeps it out of every real token.

    mode="mask" passes an explicit 4D additive float mask [B, 1, T, T] (0 where
    a token may attend: same document, not later; the dtype's minimum
    elsewhere), which any attention implementation that takes 4D masks honours,
    at O(B·T²) memory; `dtype` must be the model's compute dtype.
    """
    if mode == "position_ids":
        return {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
    if mode != "mask":
        raise ValueError(f"mode={mode!r}: choose 'position_ids' or 'mask'")
    length = input_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    allowed = same_document & causal & (document_ids[:, :, None] > 0)
    # A padding token attends to itself only: no softmax over an empty row.
    allowed |= torch.eye(length, dtype=torch.bool, device=input_ids.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": mask[:, None], "use_cache": False}
