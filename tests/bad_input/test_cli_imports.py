"""`import flows.cli`, `--help` and a bad config stay light: no torch, transformers or Prefect until a command needs them.

Every `rankflow` process (and every bad-input case run as one) pays its imports:
torch and transformers are seconds each. The config's backward-mode choices
come from the torch-free `trainer_core.registry_names`, checked here (and at
the trainer's import) against the registry of state classes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import REPO

HEAVY = ("torch", "transformers", "prefect")
# Runs in a fresh interpreter: what is imported by the end of the snippet is the cost a command pays.
PROBE = """
import json, sys
{body}
print(json.dumps(sorted({{name.split(".")[0] for name in sys.modules}} & {heavy!r})))
"""


def _heavy_modules_after(body: str, tmp_path: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(body=body, heavy=set(HEAVY))],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DO_NOT_TRACK": "1"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "body",
    [
        "import flows.cli",
        "from flows.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    ],
    ids=["import", "help"],
)
def test_the_cli_imports_no_torch_transformers_or_prefect(tmp_path, body):
    assert _heavy_modules_after(body, tmp_path) == []


def test_loading_a_valid_config_imports_no_torch_transformers_or_prefect(tmp_path):
    # The config checks train.objective's needs against the torch-free names (trainer_core.registry_names),
    # not against the objectives' classes, which are torch code.
    body = f"from trainer_core.config import load_config\nload_config({str(REPO / 'examples' / 'tiny_rl.toml')!r})"
    assert _heavy_modules_after(body, tmp_path) == []


def test_a_bad_config_is_reported_without_importing_torch(tmp_path):
    # Found by config loading: the whole command runs light (exit 2, the message), no trainer import.
    (tmp_path / "run.toml").write_text("[train]\nbackward_mode = 'nope'\n")
    body = f"from flows.cli import main\ncode = main(['run', {str(tmp_path / 'run.toml')!r}])\nassert code == 2, code"
    assert _heavy_modules_after(body, tmp_path) == []


def test_the_config_offers_exactly_the_registered_backward_modes():
    from trainer_core.config import TrainSection
    from trainer_core.registry_names import BACKWARD_MODES
    from trainer_core.training.memory import BACKWARD_STATES, PLANNER

    assert tuple(BACKWARD_STATES) == BACKWARD_MODES
    assert all(BACKWARD_STATES[name].mode == name for name in BACKWARD_MODES)
    choices = list(TrainSection.model_fields["backward_mode"].annotation.__args__)
    assert choices == [*BACKWARD_STATES, PLANNER]


def test_the_config_offers_exactly_the_registered_objectives_and_tracking_backends():
    from infra.tracking import BACKENDS
    from trainer_core.config import TrackingSection
    from trainer_core.objectives import OBJECTIVES
    from trainer_core.registry_names import NO_TRACKING, OBJECTIVE_NEEDS

    assert {name: cls.needs for name, cls in OBJECTIVES.items()} == OBJECTIVE_NEEDS
    assert list(TrackingSection.model_fields["backend"].annotation.__args__) == [NO_TRACKING, *BACKENDS]


def test_a_registry_that_drifts_from_its_names_refuses_to_import():
    from trainer_core.registry_names import check_names

    check_names("train.objective", {"sft": ("loss_mask",)}, {"sft": ("loss_mask",)})
    with pytest.raises(ImportError, match="tracking.backend"):
        check_names("tracking.backend", ("mlflow", "wandb"), {"mlflow": 1, "wandb": 2, "neptune": 3})
    with pytest.raises(ImportError, match="train.objective"):
        check_names("train.objective", {"sft": ("loss_mask",)}, {"sft": ("loss_mask", "advantages")})
    with pytest.raises(ImportError, match="train.backward_mode"):
        check_names("train.backward_mode", ("retain", "replay"), {"replay": 1, "retain": 2})  # the order counts


def test_importing_the_input_checks_imports_no_transformers(tmp_path):
    # transformers is imported by the checks that use it, so a process importing trainer_core.run.validate (through
    # trainer_core.run.plan, the tasks) without checking a model does not pay it. torch comes with the data stages.
    body = "import trainer_core.run.validate, trainer_core.model_checks, trainer_core.model_config"
    assert _heavy_modules_after(body, tmp_path) == ["torch"]
