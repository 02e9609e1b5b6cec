"""Run under torchrun by test_sharded_load: `load_sharded` vs `from_pretrained` then `shard_model`.

Each check prints one RESULT line per rank (tests/trainer/sharded_ranks.py).
Rank 0 writes a checkpoint with `save_hf_model` into `--out/<check>`; every
rank then loads it both ways and compares shard by shard (the flat padded
local shard FSDP all-gathers from, padding included), buffer by buffer
(RoPE's inv_freq) and logit by logit. The bytes each rank reads are counted
by wrapping `safetensors.safe_open`, outside the loader.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import safetensors
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import bitwise, emit, rank_batch, start
from trainer_core.parallel.fsdp.load import load_sharded
from trainer_core.parallel.fsdp.shard import fsdp_params, shard_model, shard_units
from trainer_core.run.distributed import run_rank_process
from trainer_core.training.hf_weights import save_hf_model
from trainer_core.training.vocab import pad_vocabulary


class ReadMeter:
    """Wraps `safetensors.safe_open`: counts the bytes of every tensor and slice read through it."""

    def __init__(self) -> None:
        self.bytes = 0
        self._original = safetensors.safe_open

    def __enter__(self) -> ReadMeter:
        meter = self

        class Slice:
            def __init__(self, inner) -> None:
                self._inner = inner

            def __getitem__(self, key):
                tensor = self._inner[key]
                meter.bytes += tensor.numel() * tensor.element_size()
                return tensor

            def __getattr__(self, name):
                return getattr(self._inner, name)

        class Opened:
            def __init__(self, *args, **kwargs) -> None:
                self._inner = meter._original(*args, **kwargs)

            def __enter__(self):
                self._file = self._inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self._inner.__exit__(*exc)

            def get_slice(self, name):
                return Slice(self._file.get_slice(name))

            def get_tensor(self, name):
                tensor = self._file.get_tensor(name)
                meter.bytes += tensor.numel() * tensor.element_size()
                return tensor

            def __getattr__(self, name):
                return getattr(self._file, name)

        safetensors.safe_open = Opened  # type: ignore[assignment]
        return self

    def __exit__(self, *exc) -> None:
        safetensors.safe_open = self._original  # type: ignore[assignment]


def checkpoint(out: Path, check: str, rank: int, *, tied=False, dtype=torch.float32, max_shard_size="2GB") -> Path:
    directory = out / check
    if rank == 0:
        master = tiny_qwen3(vocab=97)
        if tied:
            master.config.tie_word_embeddings = True
            master.lm_head.weight = master.model.embed_tokens.weight
        with torch.no_grad():
            for i, p in enumerate(master.parameters()):
                p.add_(0.01 * (i + 1))
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        save_hf_model(master.to(dtype), directory, max_shard_size=max_shard_size)
    dist.barrier()
    return directory


def flat_shards(model) -> list[tuple[str, torch.Tensor]]:
    return [(fp._param_fqn, fp._sharded_param_data) for fp in fsdp_params(model)]


def check_load(rank, world_size, mesh, out, check, *, param_dtype=None, pad=None, **kwargs):
    directory = checkpoint(out, check, rank, **kwargs)
    reference = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    true_vocab = pad_vocabulary(reference, pad) if pad else None  # as build_model pads after from_pretrained
    shard_model(reference, mesh, param_dtype=param_dtype)
    with ReadMeter() as meter:
        loaded, report = load_sharded(
            directory, mesh, param_dtype=param_dtype, attn_implementation="eager", pad_vocab_to_multiple_of=pad
        )
    model = loaded.model
    mine, theirs = flat_shards(model), flat_shards(reference)
    buffers, expected_buffers = dict(model.named_buffers()), dict(reference.named_buffers())
    ids, mask = rank_batch(0, rank)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    # A control: RoPE's inv_freq rounded to bf16 (what `model.to(bf16)` would make of it) moves the logits.
    rotary = model.model.rotary_emb
    kept = rotary.inv_freq
    rotary.inv_freq = kept.bfloat16().float()
    with torch.no_grad():
        rounded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    rotary.inv_freq = kept
    local_bytes = sum(t.numel() * t.element_size() for _, t in mine)
    emit(
        check,
        rank,
        same_names=[n for n, _ in mine] == [n for n, _ in theirs],
        shards_bitwise=len(mine) == len(theirs) and all(bitwise(a, b) for (_, a), (_, b) in zip(mine, theirs)),
        buffers=sorted(buffers),
        buffers_bitwise=buffers.keys() == expected_buffers.keys()
        and all(bitwise(buffers[k], expected_buffers[k]) for k in buffers),
        inv_freq_dtype=str(model.model.rotary_emb.inv_freq.dtype),
        logits_bitwise=bitwise(logits, expected),
        logits_dtype=str(logits.dtype),
        rounded_inv_freq_moves_logits=not bitwise(rounded, expected),
        tied=model.lm_head.weight is model.model.embed_tokens.weight,
        training=model.training,
        measured_bytes_read=meter.bytes,
        reported_bytes_read=report.bytes_read,
        file_bytes=report.file_bytes,
        local_shard_bytes=local_bytes,
        num_units=len(loaded.units),
        true_vocab=report.true_vocab,
        expected_true_vocab=true_vocab,
        vocab_rows=model.model.embed_tokens.weight.shape[0],
    )


def check_same_units(rank, world_size, mesh):
    """`shard_units` (what the loader calls on meta) makes the units `shard_model` makes: same parameters, same order."""

    def layout(model, units) -> list[list[str]]:
        from torch.distributed.fsdp import fully_shard

        names = {id(p): n for n, p in model.named_parameters()}
        return [
            [names[id(fp.sharded_param)] for g in fully_shard.state(u)._fsdp_param_groups for fp in g.fsdp_params]
            for u in units
        ]

    from torch.distributed.fsdp import MixedPrecisionPolicy

    for tied in (False, True):
        a, b = tiny_qwen3(vocab=97), tiny_qwen3(vocab=97)
        if tied:
            for m in (a, b):
                m.config.tie_word_embeddings = True
                m.lm_head.weight = m.model.embed_tokens.weight
        reference = shard_model(a, mesh)
        units = shard_units(b, mesh, MixedPrecisionPolicy(reduce_dtype=torch.float32))
        emit(f"same_units_tied_{tied}", rank, same=layout(a, reference.units) == layout(b, units), num=len(units))


def check_missing_tensor(rank, world_size, mesh, out):
    """A checkpoint without a tensor the model needs is refused on every rank, naming it (no rank waits)."""
    directory = checkpoint(out, "missing_tensor", rank)
    if rank == 0:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(directory / "model.safetensors"))
        del tensors["model.norm.weight"]
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    try:
        load_sharded(directory, mesh, attn_implementation="eager")
        emit("missing_tensor", rank, raised=False)
    except ValueError as error:
        emit("missing_tensor", rank, raised=True, message=str(error))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    rank, world_size, mesh = start()
    check_load(rank, world_size, mesh, out, "fp32_files", max_shard_size="40KB")
    check_load(rank, world_size, mesh, out, "fp32_one_file")
    check_load(rank, world_size, mesh, out, "bf16_checkpoint", dtype=torch.bfloat16, max_shard_size="20KB")
    check_load(rank, world_size, mesh, out, "bf16_compute", param_dtype=torch.bfloat16)
    check_load(rank, world_size, mesh, out, "tied", tied=True, max_shard_size="40KB")
    check_load(rank, world_size, mesh, out, "padded_vocab", pad=64, max_shard_size="40KB")
    check_load(rank, world_size, mesh, out, "padded_vocab_tied", pad=64, tied=True)
    check_same_units(rank, world_size, mesh)
    check_missing_tensor(rank, world_size, mesh, out)


if __name__ == "__main__":
    run_rank_process(main)
