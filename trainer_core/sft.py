"""The SFT objective: next-token cross-entropy on the tokens that carry loss.

The loss of one optimizer step is the sum over all its loss tokens divided by
their number in the whole global batch, so it does not depend on how the batch
is split over logical or physical ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss_sum(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of next-token negative log-likelihoods over positions where `loss_mask` is set."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none")
    return (nll * mask.reshape(-1)).sum()
