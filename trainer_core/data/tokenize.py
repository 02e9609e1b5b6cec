"""Tokenize rendered conversations and derive the per-token loss mask.

Tokenization runs on the whole rendered text (batched, with offsets), and a
token carries loss when its character span lies inside a loss span. This keeps
the tokens identical to what inference sees, instead of stitching pieces that
were tokenized separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .render import Rendered


@dataclass(frozen=True)
class TokenizedSequence:
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]: token t is a target the loss is taken on


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json`, or the one inside a tokenizer directory."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer.path={str(path)!r}: no tokenizer.json there; point it at a tokenizer.json file or a directory holding one")
    return Tokenizer.from_file(str(file))


def mask_from_offsets(offsets: list[tuple[int, int]], spans: tuple[tuple[int, int], ...]) -> np.ndarray:
    mask = np.zeros(len(offsets), dtype=bool)
    if not spans:
        return mask
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    ends = np.fromiter((e for _, e in offsets), dtype=np.int64, count=len(offsets))
    for span_start, span_end in spans:
        mask |= (starts >= span_start) & (ends <= span_end) & (ends > starts)
    return mask


def tokenize_rendered(tokenizer: Tokenizer, rendered: list[Rendered]) -> list[TokenizedSequence]:
    encodings = tokenizer.encode_batch([r.text for r in rendered], add_special_tokens=False)
    sequences = []
    for encoding, item in zip(encodings, rendered, strict=True):
        ids = np.asarray(encoding.ids, dtype=np.int64)
        sequences.append(TokenizedSequence(input_ids=ids, loss_mask=mask_from_offsets(encoding.offsets, item.loss_spans)))
    return sequences
