"""Objectives as registered classes: the registry, `train.objective`, the digest rule, named figures, live columns.

The loss of each objective is checked bitwise against a frozen copy of the
branch the segment loop used before objectives were classes.
"""

from __future__ import annotations

import pytest
import torch

from tasks.live import live_columns, metrics_row
from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.data_kinds import DATA_KINDS
from trainer_core.objectives import (
    OBJECTIVES,
    SFT,
    ClippedPolicyGradient,
    clipped_policy_gradient_sum,
    count_documents,
    objective_for,
    sft_loss_sum,
    stale_trajectory_mask,
)
from trainer_core.ranks.reduction import ordered_fold
from trainer_core.run.figures import LOOP_FIGURES, FigureLayout
from trainer_core.run.plan import digest_view

RL_DATA = {"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl"}


def config(tmp_path, **sections):
    return config_from_dict(tiny_tree(tmp_path, **sections), config_dir=tmp_path)


def test_the_registry_names_every_objective_and_each_data_kind_has_one():
    assert OBJECTIVES == {"sft": SFT, "clipped_policy_gradient": ClippedPolicyGradient}
    assert set(DATA_KINDS) == {"sft", "rl"} and {kind.default_objective for kind in DATA_KINDS.values()} <= set(
        OBJECTIVES
    )


def test_train_objective_follows_data_kind_unless_set(tmp_path):
    assert config(tmp_path).train.objective == "sft"
    assert config(tmp_path, data=RL_DATA).train.objective == "clipped_policy_gradient"
    sft_on_trajectories = config(tmp_path, data=RL_DATA, train={"objective": "sft"})
    assert isinstance(objective_for(sft_on_trajectories), SFT)  # trajectories carry a loss mask too


def test_a_config_without_a_train_section_gets_its_own_objective():
    """The default [train] is filled per config: an RL config first must not leave its objective to the next."""
    from trainer_core.config import RunConfig

    base = {"model": {"config": "model.json"}, "tokenizer": {"path": "tokenizer.json"}}
    rl = RunConfig.model_validate({**base, "data": {"path": "rl.jsonl", "kind": "rl"}})
    sft = RunConfig.model_validate({**base, "data": {"path": "sft.jsonl"}})
    assert (rl.train.objective, sft.train.objective) == ("clipped_policy_gradient", "sft")
    assert RunConfig.model_validate(rl.model_dump(mode="json")).train.objective == "clipped_policy_gradient"


def test_an_unknown_objective_and_one_the_data_cannot_feed_are_config_errors(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"train\.objective: must be one of 'sft' or 'clipped_policy_gradient' "
        r"\(got 'dpo'\); choose one of them",
    ):
        config(tmp_path, train={"objective": "dpo"})
    with pytest.raises(
        ConfigError,
        match=r"train\.objective='clipped_policy_gradient' needs behaviour_logprobs, "
        r"advantages, policy_version, which data\.kind='sft' data do not carry",
    ):
        config(tmp_path, train={"objective": "clipped_policy_gradient"})


def test_the_default_objective_leaves_the_digest_and_any_other_enters_it(tmp_path):
    unset = digest_view(config(tmp_path, data=RL_DATA))
    assert "objective" not in unset["train"]
    assert digest_view(config(tmp_path, data=RL_DATA, train={"objective": "clipped_policy_gradient"})) == unset
    chosen = digest_view(config(tmp_path, data=RL_DATA, train={"objective": "sft"}))
    assert chosen["train"].pop("objective") == "sft" and chosen == unset


def test_a_figure_layout_packs_by_name_and_refuses_a_missing_or_repeated_one():
    layout = FigureLayout.for_objective(ClippedPolicyGradient.figures)
    assert layout.names == (*LOOP_FIGURES, "clipped_tokens", "ratio_sum", "kept_tokens")
    values = dict(zip(layout.names, [1.5, 2.0, 8.0, 0.0, 3.0, 4.25, 5.0], strict=True))
    packed = layout.pack(values)
    assert packed.dtype == torch.float64 and layout.unpack(packed) == values
    with pytest.raises(KeyError, match="do not match the layout"):
        layout.pack({**values, "extra": 1.0})
    with pytest.raises(KeyError, match="do not match the layout"):
        layout.pack({k: v for k, v in values.items() if k != "ratio_sum"})
    with pytest.raises(ValueError, match="repeat a name"):
        FigureLayout.for_objective(("loss_sum",))
    with pytest.raises(ValueError, match="does not hold the layout"):
        layout.unpack(torch.zeros(3, dtype=torch.float64))


def test_leaving_columns_out_of_the_layout_changes_no_bit_of_the_others():
    generator = torch.Generator().manual_seed(3)
    per_rank = torch.randn(5, 6, generator=generator, dtype=torch.float64) * 1e3
    assert torch.equal(ordered_fold(per_rank)[:3], ordered_fold(per_rank[:, :3]))


# The segment loop's branch before objectives were classes (trainer_core/run/segment_main.py at 497f6e6), frozen.
def _old_micro_batch_loss_sum(rl, kind, logprobs, rows, version, rl_sums):
    loss_mask = rows["loss_mask"][:, 1:]
    if kind == "sft":
        return sft_loss_sum(logprobs, loss_mask), 0
    num_stale = 0
    mask = loss_mask
    if rl.max_data_staleness is not None:
        keep, num_stale_tokens = stale_trajectory_mask(
            rows["policy_version"][:, 1:], version, rl.max_data_staleness, rl.stale_trajectories, valid=loss_mask
        )
        if num_stale_tokens:
            num_stale = count_documents(loss_mask & ~keep, rows)
            mask = loss_mask & keep
    loss, stats = clipped_policy_gradient_sum(
        logprobs,
        rows["behaviour_logprobs"][:, 1:],
        rows["advantages"][:, 1:],
        mask,
        clip_low=rl.clip_low,
        clip_high=rl.clip_high,
    )
    num_tokens = float(mask.sum())
    rl_sums += torch.tensor([stats.clipped_fraction * num_tokens, stats.mean_ratio * num_tokens, num_tokens])
    if rl.sft_coef:
        loss = loss + rl.sft_coef * sft_loss_sum(logprobs, mask)
    return loss, num_stale


def _rows(seed: int, rows: int = 4, length: int = 9) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(rows, length, generator=generator) > 0.3
    loss_mask[:, 0] = False
    tensors = {
        "loss_mask": loss_mask,
        "behaviour_logprobs": -torch.rand(rows, length, generator=generator) * 2,
        "advantages": torch.randn(rows, length, generator=generator),
        "policy_version": torch.randint(0, 6, (rows, 1), generator=generator).expand(rows, length).clone(),
    }
    return -torch.rand(rows, length - 1, generator=generator) * 2, tensors


@pytest.mark.parametrize("rl", [{}, {"sft_coef": 0.1, "initial_policy_version": 3, "max_data_staleness": 2}])
def test_each_objective_gives_the_old_loop_s_loss_and_figures_bit_for_bit(tmp_path, rl):
    rl_config = config(tmp_path, data=RL_DATA, rl=rl)
    sft_config = config(tmp_path)
    for seed in range(4):
        logprobs, rows = _rows(seed)
        revision = seed  # policy versions 3..6 against versions 0..5: some trajectories are stale
        old_sums = torch.zeros(3)
        old_loss, old_stale = _old_micro_batch_loss_sum(
            rl_config.rl, "rl", logprobs, rows, rl_config.rl.initial_policy_version + revision, old_sums
        )
        new = objective_for(rl_config).loss_sum(logprobs, rows, revision=revision)
        assert torch.equal(new.loss, old_loss) and new.num_dropped == old_stale
        assert torch.equal(torch.tensor(list(new.figures.values()), dtype=torch.float64), old_sums.double())
        sft_old, _ = _old_micro_batch_loss_sum(None, "sft", logprobs, rows, 0, None)
        sft_new = objective_for(sft_config).loss_sum(logprobs, rows, revision=revision)
        assert torch.equal(sft_new.loss, sft_old) and sft_new.figures == {} and sft_new.num_dropped == 0


def test_the_step_figures_keep_their_flattened_keys():
    sums = {
        "loss_sum": 3.0,
        "input_tokens": 10.0,
        "stale_trajectories": 2.0,
        "clipped_tokens": 1.0,
        "ratio_sum": 4.0,
        "kept_tokens": 4.0,
    }
    objective = ClippedPolicyGradient(
        clip_low=0.2,
        clip_high=0.28,
        sft_coef=0.0,
        initial_policy_version=0,
        max_data_staleness=None,
        stale_trajectories="drop",
    )
    assert objective.step_figures(sums) == {
        "stale_trajectories_dropped": 2,
        "clip_fraction": 0.25,
        "mean_importance_ratio": 1.0,
    }
    assert objective.step_figures({**sums, "kept_tokens": 0.0})["clip_fraction"] is None  # every token stale
    assert SFT().step_figures(sums) == {}


def test_the_live_table_shows_the_objective_s_columns_named_by_the_ready_record():
    record = {
        "step": 0,
        "loss": 1.23456,
        "grad_norm": 0.5,
        "learning_rate": 1e-3,
        "stepped": True,
        "tokens_per_s": 12.3,
        "step_s": 0.1,
        "stale_trajectories_dropped": 1,
        "clip_fraction": 0.123456,
        "mean_importance_ratio": float("nan"),
    }
    rl_columns = live_columns({"event": "ready", "objective": "clipped_policy_gradient"})
    row = metrics_row(record, rl_columns)
    assert list(row)[-3:] == ["stale_dropped", "clip_fraction", "importance_ratio"]
    assert (row["stale_dropped"], row["clip_fraction"], row["importance_ratio"]) == (1, 0.1235, "nan")
    assert metrics_row(record, live_columns({"event": "ready", "objective": "sft"})) == metrics_row(record)
    assert live_columns({"event": "ready"}) == ()  # a launch that names no objective shows the loop's columns
