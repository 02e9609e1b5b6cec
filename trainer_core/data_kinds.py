"""The kinds of training data (`data.kind`), torch-free: what each kind's shards carry and what it trains by default.

A kind is a value object, not a flag: the config checks an objective's
`needs` against `kind.shard_names(packed)`, the plan records `kind.name` and
sizes its shards from the kind's columns, and the data stages produce and
store the columns the kind carries (`kind.carries("advantages")`) rather than
testing for RL. Adding a kind (preference pairs, say) is its record format and
schema under `trainer_core/data/`, its objective under
`trainer_core/objectives/`, and one `DataKind` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class HasTrajectory(Protocol):
    """What `kind_of` reads of a record (`trainer_core.data.schema.Conversation`)."""

    @property
    def is_trajectory(self) -> bool: ...


UNPACKED_NAMES = ("input_ids", "loss_mask", "attention_mask")
"""The shard tensors of every kind (`trainer_core/data/shards.py`)."""
PACKED_NAMES = ("position_ids", "document_ids")
"""The shard tensors a packed plan (`data.pack`) adds."""
COLUMN_BYTES: dict[str, int] = {
    "input_ids": 8,
    "loss_mask": 1,
    "attention_mask": 1,
    "position_ids": 8,
    "document_ids": 4,
    "advantages": 4,
    "behaviour_logprobs": 4,
    "policy_version": 8,
}
"""Bytes a token of each shard tensor takes (`trainer_core/data/shards.py` gives the dtypes)."""


@dataclass(frozen=True)
class DataKind:
    name: str
    """`data.kind`'s value, and the plan's `data_kind`."""
    columns: tuple[str, ...]
    """The shard tensors this kind adds to `UNPACKED_NAMES` (`trainer_core/data/shards.py`)."""
    default_objective: str
    """The objective (`trainer_core.registry_names.OBJECTIVE_NEEDS`) trained when `train.objective` is unset."""
    records: str
    """What its records are, in a message ("RL trajectories")."""
    misread_as_other: str
    """Why records of this kind do not fit a run of another kind (`{configured}`), and the fix."""

    def shard_names(self, *, packed: bool) -> tuple[str, ...]:
        """Every shard tensor a plan of this kind writes."""
        return UNPACKED_NAMES + (PACKED_NAMES if packed else ()) + self.columns

    def carries(self, column: str) -> bool:
        """Whether this kind's documents and shards carry `column` (beyond the tensors of every kind)."""
        return column in self.columns

    def shard_bytes_per_token(self, *, packed: bool) -> int:
        """What a token of a row takes in a shard of this kind."""
        return sum(COLUMN_BYTES[name] for name in self.shard_names(packed=packed))


SFT_DATA = DataKind(
    name="sft",
    columns=(),
    default_objective="sft",
    records="conversations without rewards (SFT)",
    misread_as_other=(
        "data.kind={configured!r} but the records carry no reward or advantage; add them "
        "(see the README's Data section) or set data.kind='sft'"
    ),
)
RL_DATA = DataKind(
    name="rl",
    columns=("advantages", "behaviour_logprobs", "policy_version"),
    default_objective="clipped_policy_gradient",
    records="RL trajectories",
    misread_as_other=(
        "the records are RL trajectories (rewards, logprobs) but data.kind={configured!r}; "
        "set data.kind='rl', or drop the RL fields to train SFT on them"
    ),
)

DATA_KINDS: dict[str, DataKind] = {kind.name: kind for kind in (SFT_DATA, RL_DATA)}
"""Every data kind by its `data.kind` name."""


def kind_of(conversation: HasTrajectory) -> DataKind:
    """The kind of data whose first record is `conversation`: a trajectory (rewards, logprobs) is RL data."""
    return RL_DATA if conversation.is_trajectory else SFT_DATA
