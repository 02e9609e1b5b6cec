"""Stage 4, align: put the behaviour policy's logprobs and the advantages onto the
tokens that carry loss.

Message i's `logprobs` must have exactly one value per loss token of message
i (for the default template: its content, tool calls and closing
`<|im_end|>`), and when `token_ids` are given they must equal those tokens. A
different count or a different token means the behaviour policy tokenized the
turn differently from training; that is an error, never a silent shift.

An SFT conversation passes through with no RL arrays.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .mask import Masked
from .schema import Conversation, DataError
from .tokenize import update_digest


@dataclass(frozen=True)
class Aligned:
    """One document, ready to be laid out in a shard."""

    input_ids: np.ndarray
    """int64 [T]."""
    loss_mask: np.ndarray
    """bool [T]: token t is a target."""
    behaviour_logprobs: np.ndarray | None = None
    """RL: float32 [T], the behaviour logprob of each loss token; 0 elsewhere."""
    advantages: np.ndarray | None = None
    """RL: float32 [T], the advantage of each loss token; 0 elsewhere."""
    policy_version: int | None = None
    """RL: the version of the policy that sampled the document."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def truncated(self, length: int) -> "Aligned":
        cut = slice(0, length)
        return Aligned(
            input_ids=self.input_ids[cut],
            loss_mask=self.loss_mask[cut],
            behaviour_logprobs=None if self.behaviour_logprobs is None else self.behaviour_logprobs[cut],
            advantages=None if self.advantages is None else self.advantages[cut],
            policy_version=self.policy_version,
        )

    def update_digest(self, hasher: "hashlib._Hash") -> None:
        version = None if self.policy_version is None else np.asarray([self.policy_version], dtype=np.int64)
        update_digest(hasher, self.input_ids, self.loss_mask, self.behaviour_logprobs, self.advantages, version)

    def digest(self) -> str:
        hasher = hashlib.sha256()
        self.update_digest(hasher)
        return hasher.hexdigest()


def align(
    masked: Masked,
    conversation: Conversation,
    message_advantages: np.ndarray | None = None,
    *,
    where: str = "(conversation)",
) -> Aligned:
    """Stage 4: behaviour logprobs and advantages onto the loss tokens of an RL trajectory."""
    if not conversation.is_trajectory:
        return Aligned(input_ids=masked.input_ids, loss_mask=masked.loss_mask)
    if message_advantages is None:
        raise ValueError("an RL trajectory needs its per-message advantages (resolve_advantages)")
    length = len(masked.input_ids)
    logprobs = np.zeros(length, dtype=np.float32)
    advantages = np.zeros(length, dtype=np.float32)
    for index, message in enumerate(conversation.messages):
        positions = np.flatnonzero(masked.message_index == index)
        if not message.carries_loss:
            continue
        given = message.logprobs or []
        if len(given) != len(positions):
            raise DataError(
                f"{where}: field messages.{index}.logprobs: {len(given)} logprobs for {len(positions)} loss tokens "
                "(this message's tokens under the training tokenizer and template, the closing end token included); "
                "the behaviour policy tokenized this turn differently: recompute logprobs with the same tokenizer and template"
            )
        if message.token_ids is not None:
            actual = masked.input_ids[positions]
            differ = np.flatnonzero(np.asarray(message.token_ids, dtype=np.int64) != actual)
            if differ.size:
                first = int(differ[0])
                raise DataError(
                    f"{where}: field messages.{index}.token_ids: token {first} is {message.token_ids[first]} in the data "
                    f"but {int(actual[first])} after tokenization; the behaviour policy used a different tokenizer or template"
                )
        advantage = message_advantages[index]
        if not np.isfinite(advantage):
            raise DataError(
                f"{where}: field messages.{index}: carries loss but has no advantage; give it a reward or an advantage, or set train=false"
            )
        logprobs[positions] = np.asarray(given, dtype=np.float32)
        advantages[positions] = np.float32(advantage)
    return Aligned(
        input_ids=masked.input_ids,
        loss_mask=masked.loss_mask,
        behaviour_logprobs=logprobs,
        advantages=advantages,
        policy_version=conversation.policy_version,
    )
