"""Run under torchrun by test_sharded_adapter: a LoRA adapter exported from a sharded peft model vs the unsharded export.

Each check prints one RESULT line per rank (tests/trainer/sharded_ranks.py).
peft injects the adapter before `shard_model`. Rank 0 writes the unsharded
reference with `export_checkpoint_module` into `--out/reference`; the sharded
export goes to `--out/sharded`. Rank 0 compares the files byte for byte and
loads the sharded export with `PeftModel.from_pretrained` over a fresh base,
whose logits it compares with the sharded model's.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, inject_adapter_in_model

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import bitwise, emit, max_diff, rank_batch, start
from trainer_core.parallel.fsdp.adapter_export import ADAPTER_FILE, export_sharded_adapter, verify_sharded_adapter
from trainer_core.parallel.fsdp.export import ShardedExportError
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.run.distributed import run_rank_process
from trainer_core.training.checkpoint_io import export_checkpoint_module

ADAPTER = "adapter"


def lora_config() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def corrupt_last_row(file: Path, name: str) -> None:
    """Flip one byte in the last row of tensor `name`, inside the data (the header stays intact)."""
    raw = bytearray(file.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    end = 8 + header_len + json.loads(raw[8 : 8 + header_len])[name]["data_offsets"][1]
    raw[end - 3] ^= 0x40
    file.write_bytes(bytes(raw))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    rank, world_size, mesh = start()
    torch.manual_seed(3)
    master = inject_adapter_in_model(lora_config(), tiny_qwen3(vocab=97), adapter_name=ADAPTER)
    model = copy.deepcopy(master)
    sharded = shard_model(model, mesh)
    target, reference = out / "sharded", out / "reference"
    if rank == 0:
        for d in (target, reference):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        trainer = SimpleNamespace(
            model=master, checkpoints={ADAPTER: SimpleNamespace(kind="lora", adapter_config=lora_config())}
        )
        export_checkpoint_module(trainer, ADAPTER, reference)
    dist.barrier()
    verified = export_sharded_adapter(sharded, ADAPTER, lora_config(), target)
    ids, mask = rank_batch(0, rank)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    compared = {}
    if rank == 0:
        files = sorted(p.name for p in target.iterdir())
        loaded = PeftModel.from_pretrained(tiny_qwen3(vocab=97), str(target)).eval()
        with torch.no_grad():
            peft_logits = loaded(input_ids=ids, attention_mask=mask, use_cache=False).logits
            base_logits = tiny_qwen3(vocab=97)(input_ids=ids, attention_mask=mask, use_cache=False).logits
        compared = {
            "files": files,
            "same_bytes": all((target / f).read_bytes() == (reference / f).read_bytes() for f in files),
            "same_names": files == sorted(p.name for p in reference.iterdir()),
            "peft_logits_bitwise": bitwise(peft_logits, logits),
            "peft_logits_max_diff": max_diff(peft_logits, logits),
            "adapter_moves_logits": max_diff(base_logits, logits),
        }
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in master.named_parameters() if "lora_" in n)
    emit("adapter", rank, **compared, verified_bytes=verified, adapter_bytes=adapter_bytes)

    if rank == 0:  # the last v_proj lora_B row of the last layer lives on the last rank
        corrupt_last_row(target / ADAPTER_FILE, "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight")
    dist.barrier()
    try:
        verify_sharded_adapter(sharded, ADAPTER, target)
        emit("adapter_corruption", rank, raised=False)
    except ShardedExportError as error:
        emit("adapter_corruption", rank, raised=True, message=str(error))


if __name__ == "__main__":
    run_rank_process(main)
