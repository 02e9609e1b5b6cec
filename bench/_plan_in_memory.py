"""The plan as it was before it streamed: every record, token and shard in memory at once.

Kept out of the package, as the reference the streamed plan is checked against
(tests/unit/test_plan_streams.py: same run id, bitwise the same shard files)
and as bench.plan_scale's baseline. It reads every record (`read_records`),
runs the stages over the whole file in one batch (`pipeline.prepare`), lays out
every segment's shard into one dict, hashes them and writes them with
`save_file`, as `build_plan` and `write_plan` did.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from trainer_core.config import RunConfig
from trainer_core.data import DataOptions, load_chat_template, load_tokenizer, prepare, read_records
from trainer_core.data.shards import packed_steps, round_up, stack_rows, unpacked_steps
from trainer_core.model_checks import check_model
from trainer_core.run.plan import digest_view, segment_bounds
from trainer_core.run.validate import input_fingerprint


@dataclass(frozen=True)
class InMemoryPlan:
    run_id: str
    digest: str
    stage_digests: dict[str, str]
    num_conversations: int
    shards: dict[int, dict[str, torch.Tensor]]


def _step_order(num_sequences: int, config: RunConfig) -> np.ndarray:
    needed = config.train.steps * config.train.global_batch_size
    rng = np.random.default_rng(config.run.seed)
    epochs = -(-needed // num_sequences)
    order = np.concatenate([rng.permutation(num_sequences) for _ in range(epochs)])
    return order[:needed].reshape(config.train.steps, config.train.global_batch_size)


def _document_stream(num_documents: int, seed: int) -> Iterator[int]:
    rng = np.random.default_rng(seed)
    while True:
        yield from (int(i) for i in rng.permutation(num_documents))


def _tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def plan_in_memory(config: RunConfig) -> InMemoryPlan:
    """Today's plan of `config`, the old way (the checks the plan runs besides the data's are left out)."""
    tokenizer = load_tokenizer(config.tokenizer.path)
    template = load_chat_template(config.tokenizer.path)
    check_model(config, tokenizer.get_vocab_size())  # loads what the old plan loaded (transformers)
    options = DataOptions.from_config(config.data)
    records = read_records(config.data.path, config.data.format)
    prepared = prepare(records, tokenizer, template, options)
    pad = tokenizer.token_to_id("<|endoftext|>")
    pad_id = 0 if pad is None else pad
    documents = prepared.documents
    bounds = segment_bounds(config)
    batch = config.train.global_batch_size
    if options.pack:
        stream = _document_stream(len(documents), config.run.seed)
        row_len = round_up(options.max_seq_len)
        shards = {
            i: stack_rows(packed_steps(documents, stream, end - start, batch, row_len, pad_id), packed=True)
            for i, (start, end) in enumerate(bounds)
        }
    else:
        order = _step_order(len(documents), config)
        shards = {
            i: stack_rows(unpacked_steps(documents, order[start:end], pad_id), packed=False)
            for i, (start, end) in enumerate(bounds)
        }
    view = {
        "config": digest_view(config),
        "inputs": input_fingerprint(config, template),
        "shards": [_tensors_sha256(shards[i]) for i in sorted(shards)],
    }
    digest = hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()
    return InMemoryPlan(
        run_id=f"{config.run.name}-{digest[:12]}",
        digest=digest,
        stage_digests=prepared.stage_digests,
        num_conversations=prepared.num_records,
        shards=shards,
    )


def write_in_memory(plan: InMemoryPlan, directory: Path) -> list[Path]:
    """The shard files as `write_plan` wrote them (`save_file` with the run id in the metadata)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, tensors in sorted(plan.shards.items()):
        path = directory / f"segment-{index:04d}.safetensors"
        save_file(tensors, str(path) + ".tmp", metadata={"run_id": plan.run_id})
        os.replace(str(path) + ".tmp", path)
        paths.append(path)
    return paths
