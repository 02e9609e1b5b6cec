"""The parallelism seam: the registry agrees with the config's torch-free names, and the trainer asks its parallelism.

A parallelism registered without its name in `PARALLELISM_NAMES` (or the other
way round) must fail at import, not silently in the config's choices; a
trainer built without one runs `Replicated`, and one built around another
model is refused before anything is registered.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from trainer_core.config_train import TrainSection
from trainer_core.parallel import PARALLELISM_NAMES, PARALLELISMS, Replicated, parallelism_for
from trainer_core.training import Trainer


def test_the_registry_holds_every_named_parallelism_in_order():
    assert tuple(PARALLELISMS) == PARALLELISM_NAMES
    assert all(cls.name == name for name, cls in PARALLELISMS.items())


def test_a_parallelism_shards_the_weights_exactly_when_the_config_says_its_name_does():
    # The run asks the parallelism (state save, export side); the config's checks ask train.shards_weights.
    for name, cls in PARALLELISMS.items():
        assert cls.shards_weights == TrainSection(sharding=name).shards_weights, name


def test_the_names_load_without_torch():
    code = "import sys, trainer_core.parallel as p; p.PARALLELISM_NAMES; print('torch' in sys.modules)"
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False"


def test_a_trainer_without_a_parallelism_is_replicated():
    model = nn.Linear(3, 2)
    trainer = Trainer(model)
    assert isinstance(trainer.parallelism, Replicated) and trainer.parallelism.model is model
    assert not trainer.parallelism.shards_weights
    assert trainer.parallelism.snapshot(model.parameters()) is None
    assert not any(trainer.parallelism.manages(p) for p in model.parameters())
    assert trainer.parallelism.compute_dtype(model.weight) == torch.float32


def test_a_parallelism_built_around_another_model_is_refused():
    with pytest.raises(ValueError, match="parallelism= describes another model"):
        Trainer(nn.Linear(3, 2), parallelism=Replicated(nn.Linear(3, 2)))


def test_an_unknown_parallelism_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"train\.sharding = 'ring'; choose one of"):
        parallelism_for("ring", nn.Linear(3, 2), None)


def test_the_replicated_one_wraps_nothing():
    model = nn.Linear(3, 2)
    assert parallelism_for("none", model, None).model is model
