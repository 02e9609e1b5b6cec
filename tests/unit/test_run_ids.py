"""The run id of each example config is pinned: a refactor that changes what
enters the plan digest (a new config key at its default, a reordered field)
would silently start every user's run from scratch instead of resuming it.

An id changes only where the training result does, on purpose: the warm-up's
start at 0 (transformers' form, trainer_core/lr_schedule.py) changed the
examples' ids (each warms up; tiny_sft decays too); a config without a warm-up trains as before and
keeps the id it had before train.lr_schedule existed (pinned from that code). Held-out files are part of what a
plan holds (tiny_sft evaluates tiny/eval.jsonl): without them, tiny_sft keeps the id it had before they existed.

An override `-section.key` removes that key from the example's file."""

import tomllib

import pytest

from tests.conftest import EXAMPLES
from trainer_core.config import config_from_dict
from trainer_core.run.plan import build_plan

PINNED = {
    ("tiny_sft", ()): "tiny-sft-2d4d9ed0d6ab",
    ("tiny_sft", ("-data.eval_path", "-train.eval_every")): "tiny-sft-2b0fd0a68c3f",  # before held-out data
    ("tiny_sft", ("train.eval_every=3",)): "tiny-sft-2d4d9ed0d6ab",  # how often it evaluates changes no result
    ("tiny_rl", ()): "tiny-rl-055d26792628",
    ("tiny_lora", ()): "tiny-lora-24d2d183bb26",
    # Computed by the code before train.lr_schedule (commit 73c304d): no warm-up, no change.
    (
        "tiny_sft",
        (
            "train.warmup_steps=0",
            'train.lr_schedule="constant"',
            "train.min_lr_ratio=0",
            "-data.eval_path",
            "-train.eval_every",
        ),
    ): "tiny-sft-76d49c83c94d",
    ("tiny_rl", ("train.warmup_steps=0", 'train.lr_schedule="constant"')): "tiny-rl-19158b92e8bd",
}


def _run_id(example: str, overrides: tuple[str, ...], tmp_path) -> str:
    tree = tomllib.loads((EXAMPLES / f"{example}.toml").read_text())
    tree["run"]["work_dir"], tree["storage"] = str(tmp_path / "work"), {"url": str(tmp_path / "store")}
    for override in overrides:
        dotted, _, value = override.lstrip("-").partition("=")
        section, key = dotted.split(".")
        if override.startswith("-"):
            del tree[section][key]
        else:
            tree[section][key] = tomllib.loads(f"v = {value}")["v"]
    config = config_from_dict(tree, config_dir=EXAMPLES)
    plan, _ = build_plan(config)
    return plan.run_id


@pytest.mark.parametrize(("example", "overrides"), sorted(PINNED))
def test_the_example_configs_keep_their_run_ids(example, overrides, tmp_path):
    assert _run_id(example, overrides, tmp_path) == PINNED[(example, overrides)]


def test_a_decay_changes_the_run_id(tmp_path):
    forms = [("constant", 0.0), ("linear", 0.0), ("cosine", 0.0), ("cosine", 0.1)]
    ids = {
        _run_id("tiny_sft", (f'train.lr_schedule="{kind}"', f"train.min_lr_ratio={ratio}"), tmp_path)
        for kind, ratio in forms
    }
    assert len(ids) == len(forms)
