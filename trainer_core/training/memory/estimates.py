"""How many bytes a retained graph of a given shape will keep: fitted to what forwards actually saved.

A forward saves tensors over the whole padded batch — padding rows and
columns included — so the estimate is a function of the input's shape
`[B, T]`, never of the unpadded token count: a padded batch after a dense one
saves as much as the dense one. Per output signature (which outputs, top-k,
which adapter), the model is

    saved_bytes ≈ a·(B·T) + c·(B·T²),    a, c ≥ 0

— activations grow with the tokens, attention probabilities (eager attention)
with the square of the row length. The coefficients are a non-negative
least-squares fit over the most recent observations, scaled up so that the fit
is never below any observation. With observations at a single row length the
model cannot tell the two terms apart, so it takes the bound that holds for
any a, c ≥ 0: `rate·B·T·max(1, T/T_seen)` with the highest observed rate per
token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MAX_OBSERVATIONS = 32


@dataclass(frozen=True)
class GraphShape:
    """What a graph's saved bytes depend on: the padded input shape and what the forward computed."""

    batch_size: int
    seq_len: int
    signature: str
    """Output kinds, top-k and selected adapter, e.g. "logprobs|k=0|adapter=None"."""

    @property
    def padded_tokens(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class Observation:
    batch_size: int
    seq_len: int
    saved_bytes: int


def _fit(observations: list[Observation]) -> tuple[float, float]:
    """Non-negative least squares of saved_bytes on (B·T, B·T²): two unknowns, so try the candidates in turn."""
    xs = [(float(o.batch_size * o.seq_len), float(o.batch_size * o.seq_len * o.seq_len)) for o in observations]
    ys = [float(o.saved_bytes) for o in observations]
    s11 = sum(x1 * x1 for x1, _ in xs)
    s22 = sum(x2 * x2 for _, x2 in xs)
    s12 = sum(x1 * x2 for x1, x2 in xs)
    s1y = sum(x1 * y for (x1, _), y in zip(xs, ys))
    s2y = sum(x2 * y for (_, x2), y in zip(xs, ys))
    candidates = [(s1y / s11, 0.0), (0.0, s2y / s22)]
    determinant = s11 * s22 - s12 * s12
    if determinant > 1e-9 * s11 * s22:
        a, c = (s1y * s22 - s2y * s12) / determinant, (s2y * s11 - s1y * s12) / determinant
        if a >= 0 and c >= 0:
            candidates.append((a, c))

    def residual(coefficients: tuple[float, float]) -> float:
        a, c = coefficients
        return sum((a * x1 + c * x2 - y) ** 2 for (x1, x2), y in zip(xs, ys))

    return min(candidates, key=residual)


class SavedBytesModel:
    """Per output signature, the observed saved bytes and the estimate for a new shape."""

    def __init__(self) -> None:
        self._observations: dict[str, deque[Observation]] = {}

    def observe(self, shape: GraphShape, saved_bytes: int) -> None:
        seen = self._observations.setdefault(shape.signature, deque(maxlen=MAX_OBSERVATIONS))
        seen.append(Observation(shape.batch_size, shape.seq_len, int(saved_bytes)))

    def observations(self, shape: GraphShape) -> list[Observation]:
        return list(self._observations.get(shape.signature, ()))

    def estimate(self, shape: GraphShape) -> float | None:
        """Bytes a retained graph of this shape is expected to keep; None before any observation."""
        seen = self.observations(shape)
        if not seen:
            return None
        if len({o.seq_len for o in seen}) < 2:
            rate = max(o.saved_bytes / (o.batch_size * o.seq_len) for o in seen)
            return rate * shape.padded_tokens * max(1.0, shape.seq_len / seen[0].seq_len)
        a, c = _fit(seen)

        def fitted(batch_size: int, seq_len: int) -> float:
            return batch_size * seq_len * (a + c * seq_len)

        scale = max(
            [
                1.0,
                *(o.saved_bytes / fitted(o.batch_size, o.seq_len) for o in seen if fitted(o.batch_size, o.seq_len) > 0),
            ]
        )
        return scale * fitted(shape.batch_size, shape.seq_len)
