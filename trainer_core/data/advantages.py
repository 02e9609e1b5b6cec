"""Advantages of RL trajectories: given ones are used as they are; rewards with
group ids become group-relative advantages.

For the rewards of one group (every trajectory reward and every per-turn reward
of the records sharing a `group_id` that carry no advantage of their own):

    mean_std (default):  A = (r - mean(r)) / (std(r) + 1e-6)     (GRPO)
    mean:                A = r - mean(r)                          (Dr. GRPO: no std division)

`std` is the population standard deviation (ddof=0). A group whose rewards are
all equal (including a group of one) gets advantage 0 for all of them, so it
teaches nothing; such groups are counted in the plan.

A trajectory's advantage applies to every loss token; a per-turn advantage to
the loss tokens of that turn.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from .schema import DataError

Normalization = Literal["mean_std", "mean"]
STD_EPS = 1e-6


def group_relative_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], normalization: Normalization = "mean_std"
) -> np.ndarray:
    """Normalise each reward against the rewards of its group (float64 [N])."""
    values = np.asarray(rewards, dtype=np.float64)
    members: dict[Hashable, list[int]] = defaultdict(list)
    for index, group in enumerate(groups):
        members[group].append(index)
    advantages = np.zeros_like(values)
    for indices in members.values():
        group_values = values[indices]
        centred = group_values - group_values.mean()
        if normalization == "mean_std":
            centred = centred / (group_values.std() + STD_EPS)
        advantages[indices] = centred
    return advantages


@dataclass(frozen=True)
class AdvantageStats:
    num_groups: int
    num_flat_groups: int
    """Groups whose rewards are all equal (advantage 0 throughout)."""


class MessageRewards(Protocol):
    """What a message says about its own reward (a schema `Message` is one)."""

    @property
    def reward(self) -> float | None: ...
    @property
    def advantage(self) -> float | None: ...


class TrajectoryRewards(Protocol):
    """What advantages are computed from (a schema `Conversation` is one; the plan keeps only these fields)."""

    @property
    def reward(self) -> float | None: ...
    @property
    def advantage(self) -> float | None: ...
    @property
    def group_id(self) -> str | int | None: ...
    @property
    def messages(self) -> Sequence[MessageRewards]: ...


def resolve_advantages(
    conversations: Sequence[TrajectoryRewards], wheres: Sequence[str], normalization: Normalization = "mean_std"
) -> tuple[list[np.ndarray], AdvantageStats]:
    """Per record, the advantage of each message (float64 [num_messages], NaN where none applies)."""
    per_record = [np.full(len(c.messages), np.nan) for c in conversations]
    pending: list[tuple[int, int | None, float, Hashable]] = []  # (record, message or None=trajectory, reward, group)
    for record, (conversation, where) in enumerate(zip(conversations, wheres, strict=True)):
        if conversation.advantage is not None:
            per_record[record][:] = conversation.advantage
        elif conversation.reward is not None:
            if conversation.group_id is None:
                raise DataError(
                    f"{where}: field group_id: a reward without an advantage needs a group_id to be normalised against; add group_id or advantage"
                )
            pending.append((record, None, conversation.reward, conversation.group_id))
        for index, message in enumerate(conversation.messages):
            if message.advantage is not None:
                per_record[record][index] = message.advantage
            elif message.reward is not None:
                if conversation.group_id is None:
                    raise DataError(
                        f"{where}: field messages.{index}.reward: a reward without an advantage needs the record's group_id to be normalised against; add group_id or advantage"
                    )
                pending.append((record, index, message.reward, conversation.group_id))
    computed = group_relative_advantages([p[2] for p in pending], [p[3] for p in pending], normalization)
    for (record, message, _, _), advantage in zip(pending, computed):
        if message is None:
            per_record[record][:] = advantage
        else:
            per_record[record][message] = advantage
    group_rewards: dict[Hashable, list[float]] = defaultdict(list)
    for _, _, reward, group in pending:
        group_rewards[group].append(reward)
    flat = sum(1 for rewards in group_rewards.values() if min(rewards) == max(rewards))
    return per_record, AdvantageStats(num_groups=len(group_rewards), num_flat_groups=flat)
