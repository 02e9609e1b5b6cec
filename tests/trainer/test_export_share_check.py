"""The export's per-rank check compares staged tensors bitwise with the rank's own, padded vocabulary rows aside."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from trainer_core.run.export_prepare import _verify_share


@pytest.fixture
def own() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 4, generator=generator),  # 13 true rows padded to 16
        "mlp.weight": torch.randn(8, 4, generator=generator),
    }


def _stage(tmp_path, tensors) -> list:
    path = tmp_path / "model.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))
    return [path]


def test_the_true_rows_of_a_padded_vocabulary_pass(tmp_path, own):
    files = _stage(tmp_path, {"embed.weight": own["embed.weight"][:13], "mlp.weight": own["mlp.weight"]})
    assert [entry.path for entry in _verify_share(tmp_path, files, own, true_vocab=13)] == ["model.safetensors"]


def test_a_changed_true_row_is_caught(tmp_path, own):
    embed = own["embed.weight"][:13].clone()
    embed[12, 0] += 1e-6
    files = _stage(tmp_path, {"embed.weight": embed, "mlp.weight": own["mlp.weight"]})
    with pytest.raises(ValueError, match="embed.weight differs"):
        _verify_share(tmp_path, files, own, true_vocab=13)


@pytest.mark.parametrize("true_vocab", [None, 13])
def test_a_tensor_cut_short_anywhere_else_is_caught(tmp_path, own, true_vocab):
    files = _stage(tmp_path, {"embed.weight": own["embed.weight"][:13], "mlp.weight": own["mlp.weight"][:6]})
    with pytest.raises(ValueError, match="differs"):
        _verify_share(
            tmp_path,
            files,
            {**own, "embed.weight": own["embed.weight"][:13]} if true_vocab is None else own,
            true_vocab=true_vocab,
        )
