"""Versions of trainable parameter sets: `(identity, revision)`.

The revision counts successful optimizer steps; the identity changes when the
checkpoint is replaced or reloaded, which makes any graph recorded before that
impossible to differentiate, whatever its age.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


def new_identity() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Version:
    identity: str
    revision: int

    def __str__(self) -> str:
        return f"{self.identity}@{self.revision}"
