"""Checkpoint-owned adapters and heads save, restore and export with their checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from tests.waits import GENEROUS_S
from trainer_core.training import (
    OptimizerConfig,
    StaleGraphError,
    Trainer,
    export_checkpoint_module,
    restore_checkpoint,
    save_checkpoint,
)


def trained_adapter_and_head():
    base = tiny_qwen3().train()
    pristine = copy.deepcopy(base)
    trainer = Trainer(base)
    trainer.add_lora_checkpoint(
        "adapter",
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    trainer.add_module_checkpoint("value", torch.nn.Linear(32, 1), optimizer=OptimizerConfig(learning_rate=1e-2))
    for seed in range(2):
        ids, mask = batch(seed=seed)
        out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
        trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].pow(2).mean())
        trainer.step()
    return trainer, pristine


def test_exported_adapter_loads_in_peft_with_the_trainers_logits(tmp_path):
    trainer, pristine = trained_adapter_and_head()
    ids, mask = batch(seed=5)
    with torch.no_grad():
        untrained = pristine.eval()(input_ids=ids, attention_mask=mask).logits
    files = export_checkpoint_module(trainer, "adapter", tmp_path / "adapter")
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(pristine, str(tmp_path / "adapter")).eval()
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=ids, attention_mask=mask).logits
        actual = loaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    assert (expected - untrained).abs().max() > 1e-3  # the adapter really changed the model


def test_exported_head_holds_the_heads_weights(tmp_path):
    trainer, _ = trained_adapter_and_head()
    export_checkpoint_module(trainer, "value", tmp_path / "value")
    weights = load_file(str(tmp_path / "value" / "model.safetensors"))
    head = trainer.heads["value"]
    assert torch.equal(weights["weight"], head.weight) and torch.equal(weights["bias"], head.bias)


def test_save_and_restore_round_trips_weights_and_optimizer_with_a_new_identity(tmp_path):
    trainer, _ = trained_adapter_and_head()
    adapter = trainer.checkpoints["adapter"]
    save_checkpoint(adapter, tmp_path / "saved")
    saved = {n: p.detach().clone() for n, p in adapter.parameters().items()}
    saved_moments = {n: adapter.optimizer.state[p]["exp_avg"].clone() for n, p in adapter.parameters().items()}
    ids, mask = batch(seed=9)
    stale = trainer.forward(ids, mask)
    trainer.backward(sft_loss(trainer.forward(ids, mask).logprobs, mask))
    trainer.step(["adapter"])  # move away from the saved state
    old_identity = adapter.identity
    restore_checkpoint(adapter, tmp_path / "saved")
    assert adapter.identity != old_identity and adapter.revision == 2
    for name, param in adapter.parameters().items():
        assert torch.equal(param, saved[name])
        assert torch.equal(adapter.optimizer.state[param]["exp_avg"], saved_moments[name])
    with pytest.raises(StaleGraphError, match="checkpoint 'adapter' was replaced"):
        trainer.backward(sft_loss(stale.logprobs, mask))


def test_a_restore_mapped_from_its_files_trains_bitwise_like_one_read_whole_and_never_writes_them(tmp_path):
    """The weights stream from the safetensors map and the moments are read past the page cache, loaded at the
    optimizer's first use: steps after the restore match a twin restored from fully read weights (`load_file`)
    and the optimizer state as it was in memory before the save, and the files keep their bytes."""
    import hashlib
    import json

    trainer, _ = trained_adapter_and_head()
    in_memory = copy.deepcopy(trainer.checkpoints["adapter"].optimizer.state_dict())
    save_checkpoint(trainer.checkpoints["adapter"], tmp_path / "saved")
    files = sorted((tmp_path / "saved").iterdir())
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    twin_trainer = copy.deepcopy(trainer)
    mapped, twin = trainer.checkpoints["adapter"], twin_trainer.checkpoints["adapter"]
    restore_checkpoint(mapped, tmp_path / "saved")
    twin.load_state_dict(
        {
            "params": load_file(str(tmp_path / "saved" / "params.safetensors")),
            "optimizer": in_memory,
            "revision": json.loads((tmp_path / "saved" / "version.json").read_text())["revision"],
        }
    )
    for each in (trainer, twin_trainer):
        for seed in (11, 12):
            ids, mask = batch(seed=seed)
            each.backward(sft_loss(each.forward(ids, mask).logprobs, mask))
            each.step(["adapter"])
    for (name, param), twin_param in zip(mapped.parameters().items(), twin.parameters().values(), strict=True):
        assert torch.equal(param, twin_param), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mapped.optimizer.state[param][moment], twin.optimizer.state[twin_param][moment])
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files} == digests


def test_a_state_saved_before_the_optimizer_file_was_safetensors_still_restores(tmp_path):
    """States written by earlier versions hold `optimizer.pt` (torch.save): a resume from one restores the same."""
    trainer, _ = trained_adapter_and_head()
    adapter = trainer.checkpoints["adapter"]
    save_checkpoint(adapter, tmp_path / "saved")
    torch.save(adapter.optimizer.state_dict(), tmp_path / "saved" / "optimizer.pt")
    (tmp_path / "saved" / "optimizer.safetensors").unlink()
    moments = {n: adapter.optimizer.state[p]["exp_avg_sq"].clone() for n, p in adapter.parameters().items()}
    trainer.backward(sft_loss(trainer.forward(*batch(seed=4)).logprobs, batch(seed=4)[1]))
    trainer.step(["adapter"])  # move away from the saved state
    restore_checkpoint(adapter, tmp_path / "saved")
    for name, param in adapter.parameters().items():
        assert torch.equal(adapter.optimizer.state[param]["exp_avg_sq"], moments[name]), name


def test_every_checkpoint_of_a_trainer_round_trips_its_weights_and_moments_through_its_own_files(tmp_path):
    """An adapter and a head of one trainer, each saved to its own directory and restored after both moved on:
    weights and AdamW state equal the in-memory copies taken at the save, and neither file set holds the other's."""
    trainer, _ = trained_adapter_and_head()
    expected = {}
    for name, checkpoint in trainer.checkpoints.items():
        save_checkpoint(checkpoint, tmp_path / name)
        expected[name] = {
            n: (p.detach().clone(), {k: v.clone() for k, v in checkpoint.optimizer.state[p].items()})
            for n, p in checkpoint.parameters().items()
        }
    ids, mask = batch(seed=7)
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
    trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].pow(2).mean())
    trainer.step()  # both move away from what was saved
    for name, checkpoint in trainer.checkpoints.items():
        restore_checkpoint(checkpoint, tmp_path / name)
        params = checkpoint.parameters()
        assert sorted(params) == sorted(expected[name])
        for n, (weight, moments) in expected[name].items():
            assert torch.equal(params[n], weight), (name, n)
            state = checkpoint.optimizer.state[params[n]]
            assert all(torch.equal(state[k], v) for k, v in moments.items()), (name, n)


def test_the_moments_are_read_beside_the_restore_and_loaded_at_the_optimizer_s_first_use(tmp_path, monkeypatch):
    """`restore_checkpoint` returns with the weights in place while the moments are still being read; the first use
    of the optimizer waits for them; a damaged file is refused before anything is restored; a read that failed is
    raised at that use and at every later one."""
    import threading

    from trainer_core.training import checkpoint_io

    trainer, _ = trained_adapter_and_head()
    adapter = trainer.checkpoints["adapter"]
    save_checkpoint(adapter, tmp_path / "saved")
    saved = {n: p.detach().clone() for n, p in adapter.parameters().items()}
    moments = {n: adapter.optimizer.state[p]["exp_avg"].clone() for n, p in adapter.parameters().items()}
    trainer.backward(sft_loss(trainer.forward(*batch(seed=4)).logprobs, batch(seed=4)[1]))
    trainer.step(["adapter"])  # move away from the saved state
    let_go, real_read = threading.Event(), checkpoint_io.read_optimizer_state

    def slow_read(directory, direct, checked):
        assert let_go.wait(GENEROUS_S)
        return real_read(directory, direct=direct, checked=checked)

    monkeypatch.setattr(checkpoint_io, "read_optimizer_state", slow_read)
    restore_checkpoint(adapter, tmp_path / "saved")  # returns although the moments are not read yet
    assert all(torch.equal(p, saved[n]) for n, p in adapter.parameters().items())
    threading.Timer(0.3, let_go.set).start()
    for name, param in adapter.parameters().items():  # the first use waits for the read
        assert torch.equal(adapter.optimizer.state[param]["exp_avg"], moments[name]), name

    weights = {n: p.detach().clone() for n, p in adapter.parameters().items()}
    damaged = (tmp_path / "saved" / "optimizer.safetensors").read_bytes()
    (tmp_path / "saved" / "optimizer.safetensors").write_bytes(damaged[:200])  # cut short
    with pytest.raises(ValueError, match="optimizer.safetensors is not a whole safetensors file"):
        restore_checkpoint(adapter, tmp_path / "saved")  # refused before anything is restored
    assert all(torch.equal(p, weights[n]) for n, p in adapter.parameters().items())

    def failing_read(directory, direct, checked):
        raise OSError(5, "Input/output error", str(directory / "optimizer.safetensors"))

    (tmp_path / "saved" / "optimizer.safetensors").write_bytes(damaged)
    monkeypatch.setattr(checkpoint_io, "read_optimizer_state", failing_read)
    restore_checkpoint(adapter, tmp_path / "saved")
    for _ in range(2):  # never a fresh AdamW in its place
        with pytest.raises(OSError, match="Input/output error"):
            adapter.optimizer  # noqa: B018 - the use under test


def test_a_step_with_a_moments_read_that_failed_changes_no_checkpoint(tmp_path, monkeypatch):
    """All or none: the step loads every restored optimizer state before any checkpoint changes."""
    from trainer_core.training import checkpoint_io

    trainer, _ = trained_adapter_and_head()
    save_checkpoint(trainer.checkpoints["value"], tmp_path / "value")

    def failing_read(directory, direct, checked):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint_io, "read_optimizer_state", failing_read)
    restore_checkpoint(trainer.checkpoints["value"], tmp_path / "value")
    before = {
        name: {n: p.detach().clone() for n, p in checkpoint.parameters().items()}
        for name, checkpoint in trainer.checkpoints.items()
    }
    ids, mask = batch(seed=3)
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
    trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].pow(2).mean())
    with pytest.raises(OSError, match="Input/output error"):
        trainer.step(learning_rate=1e-2)  # a given rate: nothing else asks the optimizers before they step
    for name, checkpoint in trainer.checkpoints.items():
        assert all(torch.equal(p, before[name][n]) for n, p in checkpoint.parameters().items()), name


def test_an_optimizer_file_replaced_by_a_link_is_refused_before_anything_is_restored(tmp_path):
    """A link planted where the moments go (to a valid file elsewhere) is refused by the restore itself, with the
    weights untouched, not at the first step after the weights were replaced."""
    trainer, _ = trained_adapter_and_head()
    adapter = trainer.checkpoints["adapter"]
    save_checkpoint(adapter, tmp_path / "saved")
    elsewhere = tmp_path / "elsewhere.safetensors"
    (tmp_path / "saved" / "optimizer.safetensors").rename(elsewhere)
    (tmp_path / "saved" / "optimizer.safetensors").symlink_to(elsewhere)
    trainer.backward(sft_loss(trainer.forward(*batch(seed=4)).logprobs, batch(seed=4)[1]))
    trainer.step(["adapter"])  # move away from the saved state
    weights = {n: p.detach().clone() for n, p in adapter.parameters().items()}
    with pytest.raises(ValueError, match="optimizer.safetensors is a symbolic link"):
        restore_checkpoint(adapter, tmp_path / "saved")
    assert all(torch.equal(p, weights[n]) for n, p in adapter.parameters().items())


def test_a_restore_checks_the_optimizer_file_s_header_once(tmp_path, monkeypatch):
    from trainer_core import safetensors_read
    from trainer_core.training import checkpoint_io

    trainer, _ = trained_adapter_and_head()
    adapter = trainer.checkpoints["adapter"]
    save_checkpoint(adapter, tmp_path / "saved")
    moments = {n: adapter.optimizer.state[p]["exp_avg_sq"].clone() for n, p in adapter.parameters().items()}
    checks = []
    real_check = safetensors_read.check_safetensors

    def counted(path):
        checks.append(path.name)
        return real_check(path)

    monkeypatch.setattr(safetensors_read, "check_safetensors", counted)
    monkeypatch.setattr(checkpoint_io, "check_safetensors", counted)
    restore_checkpoint(adapter, tmp_path / "saved")
    for name, param in adapter.parameters().items():
        assert torch.equal(adapter.optimizer.state[param]["exp_avg_sq"], moments[name]), name
    assert checks == ["optimizer.safetensors"]


def test_a_save_right_after_a_restore_writes_the_restored_moments_not_a_fresh_optimizer(tmp_path, monkeypatch):
    """Saved again before any step (the moments still being read): the optimizer file is the one restored,
    byte for byte; and a second restore before the first's read ended supersedes it."""
    import threading

    from trainer_core.training import checkpoint_io

    trainer, _ = trained_adapter_and_head()
    adapter = trainer.checkpoints["adapter"]
    save_checkpoint(adapter, tmp_path / "first")
    trainer.backward(sft_loss(trainer.forward(*batch(seed=4)).logprobs, batch(seed=4)[1]))
    trainer.step(["adapter"])
    save_checkpoint(adapter, tmp_path / "second")
    let_go, real_read = threading.Event(), checkpoint_io.read_optimizer_state

    def slow_read(directory, direct, checked):
        if directory.name == "first":
            assert let_go.wait(GENEROUS_S)
        return real_read(directory, direct=direct, checked=checked)

    monkeypatch.setattr(checkpoint_io, "read_optimizer_state", slow_read)
    restore_checkpoint(adapter, tmp_path / "first")  # its read waits
    restore_checkpoint(adapter, tmp_path / "second")  # supersedes it: nothing waits for the first read
    save_checkpoint(adapter, tmp_path / "again")
    let_go.set()
    for name in ("optimizer.safetensors", "params.safetensors"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name


def _saved_adapter(tmp_path):
    trainer, _ = trained_adapter_and_head()
    adapter = trainer.checkpoints["adapter"]
    save_checkpoint(adapter, tmp_path / "saved")
    weights = {n: p.detach().clone() for n, p in adapter.parameters().items()}
    return adapter, weights


def _unchanged(checkpoint, weights) -> bool:
    return all(torch.equal(p, weights[n]) for n, p in checkpoint.parameters().items())


def test_a_saved_weight_of_another_shape_is_refused_before_any_weight_changes(tmp_path):
    """`copy_` broadcasts: a (1, N) weight would fill every row of an (M, N) parameter and fail only at the step."""
    from safetensors.torch import save_file

    adapter, weights = _saved_adapter(tmp_path)
    params = load_file(tmp_path / "saved" / "params.safetensors")
    last = sorted(params)[-1]  # the others, earlier in the slots' order, would be copied before it
    params[last] = params[last][:1].clone()
    save_file(params, tmp_path / "saved" / "params.safetensors")
    revision, identity = adapter.revision, adapter.identity
    with pytest.raises(ValueError, match=f"saved {last} has shape"):
        restore_checkpoint(adapter, tmp_path / "saved", with_optimizer=False)
    assert _unchanged(adapter, weights) and (adapter.revision, adapter.identity) == (revision, identity)


def test_a_saved_state_lacking_a_weight_is_refused_before_any_weight_changes(tmp_path):
    from safetensors.torch import save_file

    adapter, weights = _saved_adapter(tmp_path)
    params = load_file(tmp_path / "saved" / "params.safetensors")
    missing = sorted(params)[-1]
    for name in params:  # every weight the state does hold differs from the live one
        params[name] = params[name] + 1
    del params[missing]
    save_file(params, tmp_path / "saved" / "params.safetensors")
    with pytest.raises(KeyError, match=f"lacks parameter {missing}"):
        restore_checkpoint(adapter, tmp_path / "saved", with_optimizer=False)
    assert _unchanged(adapter, weights)


def test_a_weights_only_restore_after_a_failing_read_raises_at_the_first_use_however_the_read_was_timed(
    tmp_path, monkeypatch
):
    """The pending read's failure is kept by a load that brings no optimizer state, finished or not when it came."""
    import threading

    from trainer_core.training import checkpoint_io

    for finished_first in (True, False):
        adapter, _ = _saved_adapter(tmp_path / str(finished_first))
        saved = tmp_path / str(finished_first) / "saved"
        let_go = threading.Event()

        def failing_read(directory, direct, checked, let_go=let_go):
            assert let_go.wait(GENEROUS_S)
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(checkpoint_io, "read_optimizer_state", failing_read)
        restore_checkpoint(adapter, saved)
        pending = adapter._pending_optimizer_state
        assert pending is not None
        if finished_first:
            let_go.set()
            with pytest.raises(OSError):
                pending.result(timeout=GENEROUS_S)
        restore_checkpoint(adapter, saved, with_optimizer=False)
        let_go.set()
        with pytest.raises(OSError, match="Input/output error"):
            adapter.optimizer  # noqa: B018 - the first use
        monkeypatch.undo()


def test_a_fifo_in_place_of_the_weights_is_refused_instead_of_blocking_the_restore(tmp_path):
    import os

    adapter, weights = _saved_adapter(tmp_path)
    (tmp_path / "saved" / "params.safetensors").unlink()
    os.mkfifo(tmp_path / "saved" / "params.safetensors")
    with pytest.raises(FileNotFoundError, match="no params.safetensors file"):
        restore_checkpoint(adapter, tmp_path / "saved", with_optimizer=False)
    assert _unchanged(adapter, weights)


def test_weights_that_are_no_file_are_refused_before_the_moments_read_starts(tmp_path, monkeypatch):
    """Before: the moments' read was started first, and ran on (memory and disk) after the refusal."""
    import os

    from trainer_core.training import checkpoint_io

    reads = []
    monkeypatch.setattr(checkpoint_io, "read_optimizer_state", lambda *args, **kwargs: reads.append(args))
    adapter, weights = _saved_adapter(tmp_path)
    (tmp_path / "saved" / "params.safetensors").unlink()
    os.mkfifo(tmp_path / "saved" / "params.safetensors")
    with pytest.raises(FileNotFoundError, match="no params.safetensors file"):
        restore_checkpoint(adapter, tmp_path / "saved")
    assert reads == [] and adapter._pending_optimizer_state is None
    assert _unchanged(adapter, weights)
