"""Stage 2, tokenize: rendered text to token ids with character offsets.

The text is cut at every loss-span boundary and the pieces are encoded in one
batch (no special tokens added). Cutting there is what inference does: a
prompt ending in `<|im_start|>assistant\\n` is tokenized, then the reply's
tokens are sampled after it, so no token can straddle the start of a reply.
Without the cut, a byte-level BPE may merge the header's newline with a reply
that starts with whitespace, and the tokens would differ from the ones the
behaviour policy produced. Decoding the ids gives back the text exactly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..errors import ConfigError
from ..input_files import parse_json_object, read_input_text
from .render import Rendered


@dataclass(frozen=True)
class Tokenized:
    input_ids: np.ndarray
    """int64 [T]."""
    offsets: np.ndarray
    """int64 [T, 2]: each token's half-open character range in the rendered text."""

    def update_digest(self, hasher: "hashlib._Hash") -> None:
        update_digest(hasher, self.input_ids, self.offsets)

    def digest(self) -> str:
        return array_digest(self.input_ids, self.offsets)


def update_digest(hasher: "hashlib._Hash", *arrays: np.ndarray | None) -> None:
    """Feed dtypes, shapes and bytes of `arrays` into `hasher` (the stages' digests use it)."""
    for array in arrays:
        if array is None:
            hasher.update(b"none;")
            continue
        hasher.update(f"{array.dtype.str}{array.shape};".encode())
        hasher.update(np.ascontiguousarray(array).data)


def array_digest(*arrays: np.ndarray | None) -> str:
    hasher = hashlib.sha256()
    update_digest(hasher, *arrays)
    return hasher.hexdigest()


_TOKENIZER_FIX = "point tokenizer.path at a complete tokenizer.json (as tokenizers' Tokenizer.save writes it) or a directory holding one"


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json a `tokenizer.path` names: the file itself, or the one inside a directory."""
    path = Path(path)
    return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json`, or the one inside a tokenizer directory.

    A missing, unreadable, empty, non-UTF-8, malformed or incomplete file is a
    ConfigError naming the file and the fix.
    """
    file = tokenizer_file(path)
    label = f"tokenizer.path={str(path)!r}"
    if file != Path(path) and not file.exists():
        raise ConfigError(f"{label}: the directory has no tokenizer.json; {_TOKENIZER_FIX}")
    text = read_input_text(file, label, _TOKENIZER_FIX)
    parse_json_object(text, file, label, _TOKENIZER_FIX)  # FILE:LINE:COL for broken JSON
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise ConfigError(f"{label}: {file} is not a usable tokenizer ({error}); {_TOKENIZER_FIX}") from None
    if tokenizer.get_vocab_size() == 0:
        raise ConfigError(f"{label}: {file} has an empty vocabulary; {_TOKENIZER_FIX}")
    return tokenizer


def _cuts(rendered: Rendered) -> list[int]:
    points = {0, len(rendered.text)}
    for start, end in rendered.loss_spans:
        points.update((start, end))
    return sorted(points)


def tokenize(tokenizer: Tokenizer, rendered: list[Rendered]) -> list[Tokenized]:
    """Stage 2: encode every rendered text, cut at its loss-span boundaries, in one batch."""
    pieces: list[str] = []
    piece_starts: list[int] = []
    pieces_per_text: list[int] = []
    for item in rendered:
        cuts = _cuts(item)
        count = 0
        for start, end in zip(cuts, cuts[1:]):
            if end > start:
                pieces.append(item.text[start:end])
                piece_starts.append(start)
                count += 1
        pieces_per_text.append(count)
    encodings = tokenizer.encode_batch(pieces, add_special_tokens=False) if pieces else []
    # Flatten once and split with numpy: per-token Python work dominates otherwise.
    flat_ids: list[int] = []
    flat_offsets: list[tuple[int, int]] = []
    tokens_per_piece = np.empty(len(encodings), dtype=np.int64)
    for index, encoding in enumerate(encodings):
        flat_ids.extend(encoding.ids)
        flat_offsets.extend(encoding.offsets)
        tokens_per_piece[index] = len(encoding.ids)
    ids = np.asarray(flat_ids, dtype=np.int64)
    offsets = np.asarray(flat_offsets, dtype=np.int64).reshape(len(flat_ids), 2)
    offsets += np.repeat(np.asarray(piece_starts, dtype=np.int64), tokens_per_piece)[:, None]
    piece_ends = np.cumsum(np.asarray(pieces_per_text, dtype=np.int64))
    token_ends = np.concatenate([[0], np.cumsum(tokens_per_piece)])[piece_ends]
    bounds = np.concatenate([[0], token_ends]).tolist()
    return [Tokenized(input_ids=ids[a:b], offsets=offsets[a:b]) for a, b in zip(bounds, bounds[1:])]
