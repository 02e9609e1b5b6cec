"""Run under torchrun by test_sharded_export: the streaming HF export of a sharded model vs the unsharded export.

Each check prints one RESULT line per rank (tests/trainer/sharded_ranks.py).
The reference is `save_hf_model` of the unsharded model holding the same
weights (the bf16 one cast from the FP32 masters for a bf16 export), written
by rank 0 into `--out/<check>/reference`; the sharded export goes to
`--out/<check>/sharded`. Rank 0 compares the two directories byte for byte
and loads both with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, inject_adapter_in_model
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import bf16_reference, bitwise, emit, start
from trainer_core.parallel.fsdp.export import ShardedExportError, export_sharded_hf, verify_sharded_hf
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.run.distributed import run_rank_process
from trainer_core.training.hf_weights import save_hf_model
from trainer_core.training.vocab import pad_vocabulary


class GatherMeter:
    """Counts the bytes of `DTensor.full_tensor()` results still alive, at their peak (measured outside the writer)."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0
        self._original = DTensor.full_tensor

    def __enter__(self) -> GatherMeter:
        meter = self

        def counted(tensor, *args, **kwargs):
            whole = meter._original(tensor, *args, **kwargs)
            nbytes = whole.numel() * whole.element_size()
            meter.alive += nbytes
            meter.peak = max(meter.peak, meter.alive)
            weakref.finalize(whole, meter._freed, nbytes)
            return whole

        DTensor.full_tensor = counted  # type: ignore[method-assign]
        return self

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes

    def __exit__(self, *exc) -> None:
        DTensor.full_tensor = self._original  # type: ignore[method-assign]


def fresh_dirs(out: Path, check: str, rank: int) -> tuple[Path, Path]:
    sharded, reference = out / check / "sharded", out / check / "reference"
    if rank == 0:
        for d in (sharded, reference):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
    dist.barrier()
    return sharded, reference


def files_equal(a: Path, b: Path) -> dict:
    names_a, names_b = sorted(p.name for p in a.iterdir()), sorted(p.name for p in b.iterdir())
    differing = [n for n in names_b if n in names_a and (a / n).read_bytes() != (b / n).read_bytes()]
    weights = b"".join((a / n).read_bytes() for n in names_a if n.endswith(".safetensors"))
    return {
        "files": names_a,
        "same_names": names_a == names_b,
        "differing": differing,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
    }


def loads_equal(a: Path, b: Path, dtype: torch.dtype) -> dict:
    loaded = AutoModelForCausalLM.from_pretrained(str(a), dtype=dtype, attn_implementation="eager")
    expected = AutoModelForCausalLM.from_pretrained(str(b), dtype=dtype, attn_implementation="eager")
    sa, sb = loaded.state_dict(), expected.state_dict()
    ids = torch.arange(3, 15).reshape(2, 6)
    with torch.no_grad():
        la = loaded(input_ids=ids, use_cache=False).logits
        lb = expected(input_ids=ids, use_cache=False).logits
    return {
        "load_bitwise": sa.keys() == sb.keys() and all(bitwise(sa[k], sb[k]) for k in sa),
        "num_tensors": len(sa),
        "logits_bitwise": bitwise(la, lb),
        "vocab": loaded.config.vocab_size,
        "dtype": str(next(loaded.parameters()).dtype),
    }


def check_export(
    rank,
    world_size,
    mesh,
    out,
    check,
    *,
    dtype=None,
    tied=False,
    pad=None,
    lora=False,
    merge=None,
    max_shard_size="2GB",
):
    master = tiny_qwen3(vocab=97)
    if lora:  # the base of a LoRA run: peft's wrappers folded away, the adapter left out
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        master = inject_adapter_in_model(config, master, adapter_name="adapter")
    if tied:
        master.config.tie_word_embeddings = True
        master.lm_head.weight = master.model.embed_tokens.weight
    true_vocab = pad_vocabulary(master, pad) if pad else None
    with torch.no_grad():  # weights that differ from init, so a wrong source tensor shows
        for i, p in enumerate(master.parameters()):
            p.add_(0.01 * (i + 1))
            if true_vocab is not None and p.shape[0] == 128:
                p[true_vocab:].zero_()  # the padded rows stay zero, as in training
    model = copy.deepcopy(master)
    sharded = shard_model(model, mesh, param_dtype=dtype)
    target, reference_dir = fresh_dirs(out, check, rank)
    if rank == 0:
        reference = bf16_reference(master) if dtype == torch.bfloat16 else master
        save_hf_model(
            reference, reference_dir, vocab_size=true_vocab, merge_adapter=merge, max_shard_size=max_shard_size
        )
    with GatherMeter() as meter:
        report = export_sharded_hf(
            sharded, target, vocab_size=true_vocab, dtype=dtype, max_shard_size=max_shard_size, merge_adapter=merge
        )
    dist.barrier()
    compared = {}
    if rank == 0:
        compared = {**files_equal(target, reference_dir), **loads_equal(target, reference_dir, dtype or torch.float32)}
    largest_tensor = max(p.numel() * p.element_size() for p in master.parameters())
    emit(
        check,
        rank,
        **compared,
        measured_peak_bytes=meter.peak,
        writer_peak_bytes=report.peak_gathered_bytes,
        largest_unit_bytes=report.largest_unit_bytes,
        largest_tensor_bytes=largest_tensor,
        model_bytes=sum(p.numel() * p.element_size() for p in master.parameters()),
        verified_bytes=report.verified_bytes,
        num_weight_files=sum(f.endswith(".safetensors") for f in report.files),
    )
    return sharded, target, true_vocab


def corrupt_last_embedding_row(directory: Path) -> None:
    """Flip one byte of the embedding's last row, inside the data: the header and every other byte stay intact."""
    index = directory / "model.safetensors.index.json"
    file = directory / "model.safetensors"
    if index.exists():
        file = directory / json.loads(index.read_text())["weight_map"]["model.embed_tokens.weight"]
    raw = bytearray(file.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    info = json.loads(raw[8 : 8 + header_len])["model.embed_tokens.weight"]
    end = 8 + header_len + info["data_offsets"][1]
    raw[end - 3] ^= 0x40
    file.write_bytes(bytes(raw))
    with safe_open(str(file), framework="pt") as opened:  # the metadata still parses
        opened.get_tensor("model.embed_tokens.weight")


def check_corruption(rank, world_size, mesh, out):
    sharded, target, _ = check_export(rank, world_size, mesh, out, "before_corruption", max_shard_size="40KB")
    if rank == 0:
        corrupt_last_embedding_row(target)
    dist.barrier()
    try:
        verify_sharded_hf(sharded, target, max_shard_size="40KB")
        emit("corruption", rank, raised=False)
    except ShardedExportError as error:
        emit("corruption", rank, raised=True, message=str(error))


def check_write_failure(rank, world_size, mesh, out):
    """Rank 0 cannot write (its directory is missing): every rank raises, none waits in a gather."""
    model = tiny_qwen3(vocab=97)
    sharded = shard_model(model, mesh)
    try:
        export_sharded_hf(sharded, out / "missing" / "dir")
        emit("write_failure", rank, raised=False)
    except ShardedExportError as error:
        emit("write_failure", rank, raised=True, message=str(error))


def check_non_empty_directory(rank, world_size, mesh, out):
    """A staging holding a stale index and a symlink out of it: refused on every rank, nothing written through."""
    model = tiny_qwen3(vocab=97)
    sharded = shard_model(model, mesh)
    target, outside = out / f"stale_{world_size}", out / f"outside_{world_size}.bin"
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        outside.write_bytes(b"not yours")
        (target / "model.safetensors.index.json").write_text("{}")
        (target / "model.safetensors").symlink_to(outside)
    torch.distributed.barrier()
    try:
        export_sharded_hf(sharded, target)
        emit("non_empty", rank, raised=False)
    except ShardedExportError as error:
        untouched = (
            outside.read_bytes() == b"not yours" and (target / "model.safetensors.index.json").read_text() == "{}"
        )
        emit("non_empty", rank, raised=True, message=str(error), untouched=untouched)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    rank, world_size, mesh = start()
    check_export(rank, world_size, mesh, out, "fp32_files", max_shard_size="40KB")
    check_export(rank, world_size, mesh, out, "fp32_one_file")
    check_export(rank, world_size, mesh, out, "bf16_files", dtype=torch.bfloat16, max_shard_size="20KB")
    check_export(rank, world_size, mesh, out, "tied", tied=True, max_shard_size="40KB")
    check_export(rank, world_size, mesh, out, "padded_vocab", pad=64, max_shard_size="40KB")
    check_export(rank, world_size, mesh, out, "lora_base", lora=True, max_shard_size="40KB")
    check_export(rank, world_size, mesh, out, "merged", lora=True, merge="adapter", max_shard_size="40KB")
    check_export(rank, world_size, mesh, out, "merged_bf16", lora=True, merge="adapter", dtype=torch.bfloat16)
    check_corruption(rank, world_size, mesh, out)
    check_write_failure(rank, world_size, mesh, out)
    check_non_empty_directory(rank, world_size, mesh, out)


if __name__ == "__main__":
    run_rank_process(main)
