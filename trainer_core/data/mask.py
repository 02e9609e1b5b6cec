"""Stage 3, mask: which tokens carry loss, and which message each belongs to.

A token carries loss when its character range lies inside a loss span of the
rendering (assistant turns by default, or whatever the per-message `train`
flags select). Tokenization cuts the text at span boundaries, so every loss
span is covered exactly by whole tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .render import Rendered
from .tokenize import Tokenized, array_digest, update_digest


@dataclass(frozen=True)
class Masked:
    input_ids: np.ndarray
    """int64 [T]."""
    loss_mask: np.ndarray
    """bool [T]: token t is a target the loss is taken on (predicted from position t-1)."""
    message_index: np.ndarray
    """int32 [T]: the message a loss token belongs to; -1 for tokens without loss."""

    def update_digest(self, hasher: "hashlib._Hash") -> None:
        update_digest(hasher, self.input_ids, self.loss_mask, self.message_index)

    def digest(self) -> str:
        return array_digest(self.input_ids, self.loss_mask, self.message_index)


def mask(tokenized: Tokenized, rendered: Rendered) -> Masked:
    """Stage 3: mark the tokens inside each loss span with their message."""
    starts, ends = tokenized.offsets[:, 0], tokenized.offsets[:, 1]
    message_index = np.full(len(tokenized.input_ids), -1, dtype=np.int32)
    for (span_start, span_end), message in zip(rendered.loss_spans, rendered.span_messages, strict=True):
        inside = (starts >= span_start) & (ends <= span_end) & (ends > starts)
        message_index[inside] = message
    return Masked(input_ids=tokenized.input_ids, loss_mask=message_index >= 0, message_index=message_index)
