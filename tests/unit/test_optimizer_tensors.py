"""An optimizer's state through the safetensors file and back: torch's AdamW continues bitwise as if never saved."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

from trainer_core.safetensors_write import write_safetensors
from trainer_core.training.optimizer_tensors import optimizer_from_tensors, optimizer_to_tensors


def stepped(steps: int) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    generator = torch.Generator().manual_seed(5)
    params = [
        torch.nn.Parameter(torch.randn(7, 3, generator=generator)),
        torch.nn.Parameter(torch.randn(4, generator=generator)),
    ]
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    for step in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator) * (step + 1)
        optimizer.step()
    return params, optimizer


def through_file(tmp_path, state_dict: dict) -> dict:
    tmp_path.mkdir(exist_ok=True)
    write_safetensors(tmp_path / "optimizer.safetensors", *optimizer_to_tensors(state_dict))
    with safe_open(str(tmp_path / "optimizer.safetensors"), framework="pt") as saved:
        return optimizer_from_tensors({name: saved.get_tensor(name) for name in saved.keys()}, saved.metadata())


def test_adamw_restored_from_the_file_steps_bitwise_like_the_one_never_saved(tmp_path):
    params, optimizer = stepped(3)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = torch.optim.AdamW(twin_params, lr=0.5, betas=(0.1, 0.2))  # options too come from the file
    twin.load_state_dict(through_file(tmp_path, optimizer.state_dict()))
    assert twin.param_groups[0]["betas"] == (0.8, 0.95) and isinstance(twin.param_groups[0]["betas"], tuple)
    assert {k: v for k, v in twin.param_groups[0].items() if k != "params"} == {
        k: v for k, v in optimizer.param_groups[0].items() if k != "params"
    }
    generator = torch.Generator().manual_seed(9)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        for each in (params, twin_params):
            for param, grad in zip(each, grads, strict=True):
                param.grad = grad.clone()
        optimizer.step()
        twin.step()
    for param, twin_param in zip(params, twin_params, strict=True):
        assert torch.equal(param, twin_param)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[param][key], twin.state[twin_param][key]), key


def test_an_optimizer_that_never_stepped_and_state_that_is_not_a_tensor_come_back(tmp_path):
    _, fresh = stepped(0)
    assert through_file(tmp_path / "a", fresh.state_dict()) == {
        "state": {},
        "param_groups": fresh.state_dict()["param_groups"],
    }
    state = copy.deepcopy(stepped(1)[1].state_dict())
    state["state"][1]["note"] = {"kept": [1, 2]}
    state["state"][1]["count"] = 3
    restored = through_file(tmp_path / "b", state)
    assert restored["state"][1]["note"] == {"kept": [1, 2]} and restored["state"][1]["count"] == 3
    assert torch.equal(restored["state"][0]["exp_avg_sq"], state["state"][0]["exp_avg_sq"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["state"][0].update({"a.b": torch.zeros(1)}), "holds a '.'"),
        (lambda s: s["param_groups"][0].update({"lr": torch.tensor(0.1)}), "are tensors"),
    ],
)
def test_state_the_file_cannot_name_is_refused(change, message):
    state = copy.deepcopy(stepped(1)[1].state_dict())
    change(state)
    with pytest.raises(ValueError, match=message):
        optimizer_to_tensors(state)


def test_a_file_that_is_not_an_optimizer_state_is_refused():
    with pytest.raises(ValueError, match="not a saved optimizer state"):
        optimizer_from_tensors({}, {"format": "pt"})
    _, metadata = optimizer_to_tensors(stepped(1)[1].state_dict())
    for name in ("weight", "state.x.exp_avg", "state.0", "other.0.exp_avg"):
        with pytest.raises(ValueError, match="not 'state.<index>.<key>'"):
            optimizer_from_tensors({name: torch.zeros(1)}, metadata)
