"""The run id of each example config is pinned: a refactor that changes what
enters the plan digest (a new config key at its default, a reordered field)
would silently start every user's run from scratch instead of resuming it."""

import pytest

from tests.conftest import EXAMPLES
from trainer_core.config import load_config
from trainer_core.run.plan import build_plan

PINNED = {
    "tiny_sft": "tiny-sft-a95ac4635b6a",
    "tiny_rl": "tiny-rl-f549dab53b74",
    "tiny_lora": "tiny-lora-afe9b0174381",
}


@pytest.mark.parametrize("example", sorted(PINNED))
def test_the_example_configs_keep_their_run_ids(example, tmp_path):
    config = load_config(
        EXAMPLES / f"{example}.toml",
        [f"run.work_dir={tmp_path / 'work'}", f"storage.url={tmp_path / 'store'}"],
    )
    plan, _ = build_plan(config)
    assert plan.run_id == PINNED[example]
