"""Both facades in one process (W = 1, L = 4), against a plain Trainer on the whole global batch.

A plain Trainer runs each batch as one forward, the facades as four logical
shards folded in order, so they agree within float tolerance, not bitwise;
bitwise equality across world sizes is test_logical_ranks.
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.ranks.loops import make_trainer, rl_batches, rl_loop, sft_batches, sft_loop, spmd_sft
from tests.trainer.models import tiny_qwen3
from trainer_core.ranks import LogicalDataParallel, Topology, run_rank_zero, step_seed
from trainer_core.training import GraphConsumedError, OptimizerConfig, Trainer

TOPOLOGY = Topology(0, 1, 4)


def assert_same_weights(trainer, reference, rtol=1e-4, atol=1e-6) -> None:
    for (name, param), expected in zip(trainer.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(param, expected, rtol=rtol, atol=atol, msg=name)


def test_spmd_over_logical_ranks_trains_as_a_plain_trainer_on_the_global_batch():
    batches = sft_batches((8, 6, 8))
    plain = make_trainer(dropout=0.0)
    expected = sft_loop(plain, batches)
    logical = make_trainer(dropout=0.0)
    losses = spmd_sft(logical, TOPOLOGY, batches)
    assert losses == pytest.approx(expected, rel=1e-5)
    assert_same_weights(logical, plain)


def test_an_rl_loop_for_one_process_runs_unchanged_through_the_rank_zero_facade():
    batches = rl_batches()
    plain = make_trainer(dropout=0.0)
    expected = rl_loop(plain, batches)
    facade = make_trainer(dropout=0.0)
    losses = run_rank_zero(facade, TOPOLOGY, lambda trainer: rl_loop(trainer, batches))
    assert losses == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert_same_weights(facade, plain)


def test_outputs_come_back_in_logical_order_as_managed_tensors_and_dropping_them_frees_every_graph():
    batch = sft_batches((6,))[0]
    plain = make_trainer(dropout=0.0)
    with torch.no_grad():
        expected = plain.forward(batch["input_ids"], batch["attention_mask"], outputs=("logprobs", "hidden"))

    def driver(trainer):
        out = trainer.forward(batch["input_ids"], batch["attention_mask"], outputs=("logprobs", "hidden"))
        torch.testing.assert_close(out.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.hidden_states, expected.hidden_states, rtol=1e-5, atol=1e-5)
        assert out.logprobs.requires_grad and out.logprobs.is_leaf and out.graph_id is not None
        live = trainer.call(lambda context: len(context.trainer.graphs.live()))
        del out
        gc.collect()
        after = trainer.call(lambda context: len(context.trainer.graphs.live()))  # the release travels with it
        with torch.no_grad():
            quiet = trainer.forward(batch["input_ids"], batch["attention_mask"])
        kept = trainer.call(lambda context: len(context.trainer.graphs.live()))
        return live, after, quiet, kept

    live, after, quiet, kept = run_rank_zero(make_trainer(dropout=0.0), TOPOLOGY, driver)
    assert live == [4] and after == [0]  # one graph per logical rank with rows, all freed
    assert quiet.graph_id is None and not quiet.logprobs.requires_grad and kept == [0]


def test_backward_rules_match_the_trainers():
    batch = sft_batches((4,))[0]

    def driver(trainer):
        out = trainer.forward(batch["input_ids"], batch["attention_mask"])
        loss = -out.logprobs.sum()
        report = trainer.backward(loss, retain_graph=True)
        trainer.backward(loss)  # retained: a second backward is allowed, once
        with pytest.raises(GraphConsumedError, match="already used by a backward"):
            trainer.backward(-out.logprobs.sum())
        stray = torch.ones((), requires_grad=True)
        with pytest.raises(ValueError, match="may depend only on this facade's forward outputs"):
            trainer.backward(-out.logprobs.sum() * stray)
        return report, trainer.step()["base"]

    report, step = run_rank_zero(make_trainer(), TOPOLOGY, driver)
    assert report.num_graphs == 1 and report.ages == {0: {"base": 0}} and step.stepped


def test_save_load_and_export_run_through_the_facade(tmp_path):
    batches = sft_batches((8, 8))

    def driver(trainer):
        sft_loop(trainer, batches[:1])
        written = trainer.save(tmp_path / "state", {"next_step": 1})
        sft_loop(trainer, batches[1:])
        meta = trainer.load(tmp_path / "state")  # back to one step
        files = trainer.export(tmp_path / "export")
        return written, meta, files, trainer.checkpoints["base"].revision

    trainer = make_trainer()
    written, meta, files, revision = run_rank_zero(trainer, TOPOLOGY, driver)
    assert written > 0 and meta == {"next_step": 1} and revision == 1
    assert "base/config.json" in files
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export" / "base"), local_files_only=True)
    for name, param in exported.named_parameters():
        assert torch.equal(param, dict(trainer.model.named_parameters())[name]), name


def test_the_logical_dp_facade_refuses_work_outside_a_logical_rank():
    trainer = make_trainer()
    ldp = LogicalDataParallel(trainer, TOPOLOGY)
    batch = sft_batches((2,))[0]
    out = trainer.forward(batch["input_ids"], batch["attention_mask"])
    with pytest.raises(ValueError, match="backward ran outside any logical rank"):
        trainer.backward(-out.logprobs.sum())
    assert all(p.grad is None for p in trainer.model.parameters())
    shards = list(ldp.forward_batches(batch, step=0, yield_empty=False))
    assert [s.logical_rank for s in shards] == [0, 1]  # 2 rows over 4 logical ranks; the empty ones ran unseen
    yielded = []
    for shard in ldp.forward_batches(batch, step=0):
        with shard:
            yielded.append((shard.logical_rank, shard.empty))
            if shard.logical_rank == 0:
                with pytest.raises(RuntimeError, match="inside logical rank 0"):
                    ldp.gradients.check_ready()
    assert yielded == [(0, False), (1, False), (2, True), (3, True)]


def _trainer_on(device: str) -> Trainer:
    trainer = Trainer(tiny_qwen3(seed=0, dropout=0.1).train().to(device))
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(learning_rate=1e-2))
    return trainer


def _streams(device: str) -> list[torch.Tensor]:
    """The caller's global random streams: the CPU's, and every CUDA device's when the test runs on CUDA."""
    streams = [torch.get_rng_state()]
    if device == "cuda":
        streams += [torch.cuda.get_rng_state(index) for index in range(torch.cuda.device_count())]
    return streams


def _same_streams(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(torch.equal(a, b) for a, b in zip(left, right))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_the_facades_leave_the_callers_random_streams_as_they_were(device):
    """Inside a logical rank the streams are its own seed's; after any facade call the caller's are untouched."""
    batch = {name: tensor.to(device) for name, tensor in sft_batches((6,))[0].items()}
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if device == "cuda" else []):
        torch.manual_seed(99)
        trainer = _trainer_on(device)
        ldp = LogicalDataParallel(trainer, TOPOLOGY, seed=5)
        before = _streams(device)
        inside = {}
        for shard in ldp.forward_batches(batch, step=3):
            with shard:
                inside[shard.logical_rank] = torch.rand(4, device=device)  # the logical rank's stream
                if not shard.empty:
                    out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"])
                    trainer.backward(-out.logprobs.sum())
            assert _same_streams(_streams(device), before), f"logical rank {shard.logical_rank} left its stream behind"
        ldp.step()
        assert _same_streams(_streams(device), before)
        for logical_rank, drawn in inside.items():
            own = torch.Generator(device=device).manual_seed(step_seed(5, 3, logical_rank))
            assert torch.equal(drawn, torch.rand(4, device=device, generator=own)), logical_rank

        def driver(facade):
            seen = [_streams(device)]
            out = facade.forward(batch["input_ids"], batch["attention_mask"])
            seen.append(_streams(device))
            facade.backward(-out.logprobs.sum())
            seen.append(_streams(device))
            facade.step()
            seen.append(_streams(device))
            return seen

        seen = run_rank_zero(_trainer_on(device), TOPOLOGY, driver, seed=5)
        assert all(_same_streams(streams, seen[0]) for streams in seen[1:])
