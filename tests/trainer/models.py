"""Tiny random Qwen3 models for trainer tests (nothing is downloaded)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
"""Parametrize a test over the devices: `bench.gpu_suite` runs the `cuda` cases on a GPU machine."""


def tiny_qwen3(seed: int = 0, *, dropout: float = 0.0, dtype=torch.float32, vocab: int = 97) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        attention_dropout=dropout,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)
    # sdpa's dropout draws differ from eager's; eager keeps replay and reference on one path.
    model.config._attn_implementation = "eager"
    return model


def batch(seed: int = 1, size: int = 3, length: int = 12, vocab: int = 97) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -3:] = 0  # one right-padded row
    return input_ids, attention_mask


def wide_qwen3(hidden: int = 4096, seed: int = 0) -> Qwen3ForCausalLM:
    """One wide layer: a forward costs far more than writing out the activations it saves (~45M parameters)."""
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=hidden,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=hidden // 4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model.train()


def mixed_batches(seed: int, shapes: list[tuple[int, int]], vocab: int = 97) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of mixed shapes, each right-padded: row i keeps a random length of at least 4 tokens."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for size, length in shapes:
        input_ids = torch.randint(3, vocab, (size, length), generator=generator)
        lengths = torch.randint(4, length + 1, (size, 1), generator=generator)
        attention_mask = (torch.arange(length)[None, :] < lengths).long()
        batches.append((input_ids, attention_mask))
    return batches
