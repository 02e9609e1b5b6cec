"""Save, restore and export checkpoint-owned parameters and modules.

- `save_checkpoint` / `restore_checkpoint`: a checkpoint's training state
  (weights, AdamW state, revision) in a directory: `params.safetensors` and
  `optimizer.safetensors`, written straight to the disk
  (`trainer_core.safetensors_write`); the weights are read back
  memory-mapped, the moments past the page cache into memory of their own
  (`trainer_core.safetensors_read`). Restoring gives
  the checkpoint a new identity, so graphs recorded before it cannot be
  backwarded. A state saved before the optimizer file was safetensors
  (`optimizer.pt`, `torch.save`) still restores.
- `export_checkpoint_module`: the inference form — a Hugging Face directory for
  the base model (peft wrappers unwrapped, the true vocabulary: `hf_weights`), a peft adapter directory (`adapter_config.json`,
  `adapter_model.safetensors`, loadable with `PeftModel.from_pretrained`) for a
  LoRA adapter, and `model.safetensors` for a custom module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer_core.safetensors_read import Layouts, check_safetensors, only_reader_on_this_node, read_safetensors
from trainer_core.safetensors_write import write_safetensors

from .adapter_config import save_adapter_config
from .checkpoints import Checkpoint
from .hf_weights import save_hf_model
from .optimizer_tensors import check_optimizer_metadata, optimizer_from_tensors, optimizer_to_tensors

VERSION_FILE = "version.json"
PARAMS_FILE = "params.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OLD_OPTIMIZER_FILE = "optimizer.pt"
"""The optimizer file of states saved before OPTIMIZER_FILE (`torch.save`): read, never written."""


def save_checkpoint(checkpoint: Checkpoint, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = checkpoint.state_dict(copy=False)  # written as they are: nothing changes them during the save
    write_safetensors(directory / PARAMS_FILE, state["params"])
    write_safetensors(directory / OPTIMIZER_FILE, *optimizer_to_tensors(state["optimizer"]))
    (directory / VERSION_FILE).write_text(
        json.dumps(
            {
                "name": checkpoint.name,
                "kind": checkpoint.kind,
                "identity": checkpoint.identity,
                "revision": checkpoint.revision,
            }
        )
    )


class _SafetensorsTensors(Mapping[str, torch.Tensor]):
    """The tensors of an open safetensors file, each read from its mapping when asked for.

    Restoring copies each weight into its parameter: read one at a time, the
    peak is one tensor beside the model, not a second copy of every weight
    (`load_file` reads them all first).
    """

    def __init__(self, handle) -> None:
        self._handle = handle
        self._names = frozenset(handle.keys())

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor to answer
        return name in self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def shapes(self) -> dict[str, list[int]]:
        """Each tensor's shape, from the header (nothing read): a restore checks them all before it copies any."""
        return {name: self._handle.get_slice(name).get_shape() for name in self._names}

    def __len__(self) -> int:
        return len(self._names)


def restore_checkpoint(checkpoint: Checkpoint, directory: Path, *, with_optimizer: bool = True) -> None:
    """Load a saved checkpoint (its AdamW state too, unless `with_optimizer` is False).

    Nothing is held twice: the weights stream from the memory-mapped safetensors file into the parameters
    (read ahead into the page cache: `trainer_core.run.state_readahead`), and the AdamW moments (two thirds of a
    full fine-tune's state) are read into memory the optimizer then owns (`trainer_core.safetensors_read`; past
    the page cache where this process is its node's only rank, through it where several ranks each read the
    file), by a thread of their own: the checkpoint waits for them at the optimizer's first use, so the read
    runs beside the weights' copy and the first forward and backward. The optimizer file's header is checked
    first: a missing or damaged file is refused before anything is restored.
    """
    meta = json.loads((directory / VERSION_FILE).read_text())
    if meta["kind"] != checkpoint.kind:
        raise ValueError(
            f"{directory} holds a '{meta['kind']}' checkpoint, not '{checkpoint.kind}'; restore it into a checkpoint of that kind"
        )
    params_path = _state_file(directory, PARAMS_FILE)  # before the moments' read starts: a refusal leaves none
    optimizer = None
    if with_optimizer:  # read by a thread of its own, beside the weights' copy and the first forward and backward
        checked = check_optimizer_file(directory)  # a missing or damaged file is refused before anything is restored
        reading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-moments")
        optimizer = reading.submit(read_optimizer_state, directory, direct=only_reader_on_this_node(), checked=checked)
        reading.shutdown(wait=False)  # the thread ends with the read; the checkpoint waits for it at its first step
    with safe_open(str(params_path), framework="pt") as params:
        checkpoint.load_state_dict(
            {"params": _SafetensorsTensors(params), "optimizer": optimizer, "revision": meta["revision"]}
        )


def _state_file(directory: Path, name: str) -> Path:
    """`directory/name`, refused unless it is a regular file (missing, a directory, or a FIFO, whose open would
    block for good)."""
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no {name} file; the state is incomplete: resume from another")
    return path


def _old_optimizer_file(directory: Path) -> bool:
    return not (directory / OPTIMIZER_FILE).is_file() and (directory / OLD_OPTIMIZER_FILE).is_file()


def check_optimizer_file(directory: Path) -> Layouts | None:
    """Refuse a missing, damaged or foreign optimizer file (its header only: the cheap part of a read); returns its
    tensors' layouts for the read (None for a state's old `optimizer.pt`)."""
    if _old_optimizer_file(directory):
        return None
    path = _state_file(directory, OPTIMIZER_FILE)
    layouts, metadata = check_safetensors(path)
    try:
        check_optimizer_metadata(metadata)
    except ValueError as foreign:
        raise ValueError(f"{path}: {foreign}") from None
    return layouts


def read_optimizer_state(directory: Path, *, direct: bool = True, checked: Layouts | None = None) -> dict:
    """The saved optimizer `state_dict`, its tensors in memory of their own (`trainer_core.safetensors_read`: the
    first step writes them in place, which a copy-on-write map would make copy every page again); `direct`: read
    past the page cache; `checked`: its layouts from `check_optimizer_file` (not checked again)."""
    if _old_optimizer_file(directory):
        return torch.load(directory / OLD_OPTIMIZER_FILE, weights_only=True, mmap=True)
    return optimizer_from_tensors(*read_safetensors(directory / OPTIMIZER_FILE, direct=direct, checked=checked))


def export_checkpoint_module(trainer, name: str, directory: Path) -> list[str]:
    """Write checkpoint `name` in its inference form; returns the files written."""
    checkpoint = trainer.checkpoints[name]
    directory.mkdir(parents=True, exist_ok=True)
    if checkpoint.kind == "base":
        save_hf_model(trainer.model, directory, vocab_size=trainer.vocab_size)
    elif checkpoint.kind == "lora":
        from peft import get_peft_model_state_dict

        # PeftModel.from_pretrained expects the keys its own wrapper would save.
        state = get_peft_model_state_dict(trainer.model, adapter_name=name)
        save_file(
            {f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
            str(directory / "adapter_model.safetensors"),
        )
        save_adapter_config(checkpoint.adapter_config, directory)
    else:
        save_file(
            {k: v.contiguous() for k, v in checkpoint.owner.state_dict().items()}, str(directory / "model.safetensors")
        )
    return sorted(p.name for p in directory.iterdir())
