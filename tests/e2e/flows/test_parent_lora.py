"""`model.path` naming a committed LoRA checkpoint: the adapter continues training on its base.

One short LoRA run commits an adapter (with its base in `base/`). The reference for where the next run starts
is peft itself: `PeftModel.from_pretrained(base, checkpoint)` gives the logits the next run's freshly built
trainer gives. Then the next run trains through the whole flow, its ledger names the parent, and its own
checkpoint is self-contained (it ships the base again) and loads with peft alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows.pipeline import train_flow
from infra.publication.parent import resolve_parent
from infra.runs import ledger
from tests.conftest import tiny_tree
from trainer_core.config import ConfigError, RunConfig, config_from_dict
from trainer_core.model import build_trainer
from trainer_core.run.plan import build_plan
from trainer_core.run.validate import validate_inputs

pytestmark = [pytest.mark.flow, pytest.mark.distributed]

SHORT = {"steps": 2, "steps_per_segment": 2, "nproc_per_node": 1, "logical_dp": 1}
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def lora_parent(prefect_harness, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-parent")
    tree = tiny_tree(tmp, train={**SHORT, "learning_rate": 3e-2})
    tree["model"]["lora"] = LORA
    config = config_from_dict(tree, config_dir=tmp)
    result = train_flow(config)
    assert isinstance(result, dict) and result["status"] == "completed", result
    return config, result


def child(tmp_path: Path, parent_config: RunConfig, reference: str, lora: dict | None = None) -> RunConfig:
    tree = tiny_tree(tmp_path, train=SHORT)
    tree["model"] = {"path": reference, **({"lora": lora} if lora is not None else {})}
    tree["storage"] = {"url": parent_config.storage.url}
    return config_from_dict(tree, config_dir=tmp_path)


def peft_logits(checkpoint_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir / "base"), local_files_only=True)
    model = PeftModel.from_pretrained(base, str(checkpoint_dir)).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_the_next_run_starts_from_the_committed_adapter_on_its_base(lora_parent, tmp_path):
    parent_config, result = lora_parent
    config = child(tmp_path, parent_config, f"{result['run_id']}@latest")
    found = resolve_parent(config)
    assert found is not None and found.url == result["checkpoint_url"]
    assert config.model.lora is not None and config.model.lora.init_from is not None
    assert (config.model.lora.rank, config.model.lora.alpha) == (4, 8.0)  # read from the adapter
    assert config.model.path == str(Path(config.model.lora.init_from) / "base")
    model = build_trainer(config).model.eval()
    input_ids = torch.tensor([[1, 5, 9, 300, 42, 7, 2, 0]])
    with torch.no_grad():
        ours = model(input_ids=input_ids).logits
    torch.testing.assert_close(ours, peft_logits(Path(config.model.lora.init_from), input_ids), rtol=0, atol=1e-6)
    # Not the freshly initialised adapter (B = 0 gives the base's logits): the trained one.
    fresh = child(tmp_path / "fresh", parent_config, config.model.path, lora=LORA)
    with torch.no_grad():
        assert not torch.allclose(build_trainer(fresh).model.eval()(input_ids=input_ids).logits, ours, atol=1e-4)
    assert build_plan(config)[0].run_id != build_plan(fresh)[0].run_id  # the adapter's bytes are in the run id


def test_the_continued_adapter_trains_commits_a_self_contained_checkpoint_and_names_its_parent(lora_parent, tmp_path):
    parent_config, result = lora_parent
    config = child(tmp_path, parent_config, result["checkpoint_url"])
    continued = train_flow(config)
    assert isinstance(continued, dict) and continued["status"] == "completed", continued
    (plan_line,) = [e for e in ledger.read(Path(config.run.work_dir) / continued["run_id"]) if e["stage"] == "plan"]
    assert plan_line["parent"]["url"] == result["checkpoint_url"]
    checkpoint = Path(continued["checkpoint_url"])
    assert (checkpoint / "base" / "config.json").is_file()  # not a path into this run's work dir
    input_ids = torch.tensor([[1, 5, 9, 300, 42, 7, 2, 0]])
    parent_logits = peft_logits(Path(result["checkpoint_url"]), input_ids)
    assert not torch.allclose(peft_logits(checkpoint, input_ids), parent_logits, atol=1e-5)  # it trained on


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"rank": 8, "alpha": 8.0}, r"rank 8 \(the adapter's: 4\)"),
        ({"rank": 4, "alpha": 16.0}, r"alpha 16.0 \(the adapter's: 8.0\)"),
    ],
)
def test_other_adapter_settings_are_refused(lora_parent, tmp_path, lora, message):
    parent_config, result = lora_parent
    config = child(tmp_path, parent_config, f"{result['run_id']}@latest", lora=lora)
    with pytest.raises(ConfigError, match=message):
        resolve_parent(config)


def test_an_adapter_of_other_modules_does_not_load(lora_parent, tmp_path):
    parent_config, result = lora_parent
    config = child(tmp_path, parent_config, f"{result['run_id']}@latest", lora={**LORA, "target_modules": ["q_proj"]})
    resolve_parent(config)
    with pytest.raises(
        ConfigError,
        match=rf"model.path names the LoRA checkpoint {result['checkpoint_url']}: adapter_model.safetensors does not "
        "hold the adapter being trained",
    ):
        validate_inputs(config)  # the pre-flight: exit 2 before anything is written
    with pytest.raises(ValueError, match="does not hold the adapter being trained: 0 tensor.s. missing"):
        build_trainer(config)
