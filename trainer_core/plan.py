"""The plan: a pure, deterministic function of config + data.

`build_plan` validates the data, tokenizes it, orders the sequences with the run
seed, cuts the run into segments of optimizer steps and lays out, per segment,
a shard file that every rank reads. The digest covers everything that decides
the training result, so the same inputs always give the same run id, and a
re-run of the same config finds (and resumes) the same run directory.

Nothing is written until the whole input has been validated.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .config import RunConfig
from .data import DataError, load_tokenizer, read_conversations, render_chatml, tokenize_rendered
from .data.tokenize import TokenizedSequence
from .model import model_vocab_size

PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class SegmentPlan:
    index: int
    start_step: int
    """First optimizer step (0-based, inclusive)."""
    end_step: int
    """One past the last optimizer step."""
    shard_file: str
    """Path of this segment's shard, relative to the run directory."""
    num_loss_tokens: int

    @property
    def num_steps(self) -> int:
        return self.end_step - self.start_step


@dataclass(frozen=True)
class Plan:
    run_id: str
    digest: str
    config: dict
    num_conversations: int
    num_truncated: int
    num_dropped: int
    num_tokens: int
    segments: list[SegmentPlan] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        raw["segments"] = [SegmentPlan(**s) for s in raw["segments"]]
        return cls(**raw)

    def run_config(self) -> RunConfig:
        return RunConfig.model_validate(self.config)


def run_dir_for(config: RunConfig, run_id: str) -> Path:
    return Path(config.run.work_dir) / run_id


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _input_fingerprint(config: RunConfig) -> dict:
    """Digests of the inputs that decide the result (paths themselves do not)."""
    tokenizer_path = Path(config.tokenizer.path)
    tokenizer_file = tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path
    fingerprint = {"data": _file_digest(Path(config.data.path)), "tokenizer": _file_digest(tokenizer_file)}
    if config.model.config is not None:
        fingerprint["model_config"] = _file_digest(Path(config.model.config))
    else:
        model_dir = Path(config.model.path)
        # Hashing multi-GB weights would dominate planning; name + size + config is
        # enough to notice a different model in the same directory.
        fingerprint["model_dir"] = sorted(
            (p.name, p.stat().st_size) for p in model_dir.iterdir() if p.is_file()
        )
        fingerprint["model_config"] = _file_digest(model_dir / "config.json")
    return fingerprint


def _fit_length(seqs: list[TokenizedSequence], config: RunConfig) -> tuple[list[TokenizedSequence], int, int]:
    limit = config.data.max_seq_len
    kept: list[TokenizedSequence] = []
    truncated = dropped = 0
    for index, seq in enumerate(seqs):
        if len(seq.input_ids) <= limit:
            kept.append(seq)
        elif config.data.overflow == "truncate":
            truncated += 1
            kept.append(TokenizedSequence(seq.input_ids[:limit], seq.loss_mask[:limit]))
        elif config.data.overflow == "drop":
            dropped += 1
        else:
            raise DataError(
                f"{config.data.path}: conversation {index + 1} (non-blank line) has {len(seq.input_ids)} tokens, "
                f"over data.max_seq_len={limit}; raise max_seq_len or set data.overflow to 'truncate' or 'drop'"
            )
    # Position 0 is never a target (nothing predicts it), so it cannot carry loss.
    kept = [s for s in kept if s.loss_mask[1:].any()] if kept else kept
    if not kept:
        raise DataError(f"{config.data.path}: no conversation left with loss tokens after applying data.max_seq_len={limit}")
    return kept, truncated, dropped


def _step_order(num_sequences: int, config: RunConfig) -> np.ndarray:
    """Sequence indices for every optimizer step: epochs of seeded permutations."""
    needed = config.train.steps * config.train.global_batch_size
    rng = np.random.default_rng(config.run.seed)
    epochs = -(-needed // num_sequences)
    order = np.concatenate([rng.permutation(num_sequences) for _ in range(epochs)])
    return order[:needed].reshape(config.train.steps, config.train.global_batch_size)


def _segment_tensors(seqs: list[TokenizedSequence], rows: np.ndarray, pad_id: int) -> dict[str, torch.Tensor]:
    steps, batch = rows.shape
    length = max(len(seqs[i].input_ids) for i in rows.flat)
    length = -(-length // 8) * 8  # a multiple of 8 keeps kernels on their fast paths
    input_ids = np.full((steps, batch, length), pad_id, dtype=np.int64)
    loss_mask = np.zeros((steps, batch, length), dtype=bool)
    attention_mask = np.zeros((steps, batch, length), dtype=bool)
    for s in range(steps):
        for b in range(batch):
            seq = seqs[rows[s, b]]
            n = len(seq.input_ids)
            input_ids[s, b, :n] = seq.input_ids
            loss_mask[s, b, :n] = seq.loss_mask
            attention_mask[s, b, :n] = True
    loss_mask[:, :, 0] = False
    return {
        "input_ids": torch.from_numpy(input_ids),
        "loss_mask": torch.from_numpy(loss_mask),
        "attention_mask": torch.from_numpy(attention_mask),
    }


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def build_plan(config: RunConfig) -> tuple[Plan, dict[int, dict[str, torch.Tensor]]]:
    """Validate, tokenize and lay out the run in memory; writes nothing."""
    conversations = read_conversations(config.data.path)
    tokenizer = load_tokenizer(config.tokenizer.path)
    vocab = model_vocab_size(config)
    if tokenizer.get_vocab_size() > vocab:
        raise DataError(
            f"tokenizer.path={config.tokenizer.path!r} has {tokenizer.get_vocab_size()} tokens but the model's "
            f"vocab_size is {vocab}; use a model whose vocab_size covers the tokenizer"
        )
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    pad_id = 0 if pad_id is None else pad_id
    sequences = tokenize_rendered(tokenizer, [render_chatml(c) for c in conversations])
    sequences, num_truncated, num_dropped = _fit_length(sequences, config)
    order = _step_order(len(sequences), config)

    per_segment: dict[int, dict[str, torch.Tensor]] = {}
    segment_specs = []
    span = config.train.steps_per_segment
    for index in range(config.train.num_segments):
        start, end = index * span, min((index + 1) * span, config.train.steps)
        tensors = _segment_tensors(sequences, order[start:end], pad_id)
        per_segment[index] = tensors
        segment_specs.append((index, start, end, int(tensors["loss_mask"].sum())))

    training_config = config.model_dump(mode="json")
    # Where things are stored and how long a launch may take do not change the result.
    for volatile in ("storage", "export"):
        training_config.pop(volatile)
    training_config["run"].pop("work_dir")
    training_config["train"].pop("segment_timeout_s")
    for section in ("model", "tokenizer", "data"):
        training_config[section].pop("path", None)
        training_config[section].pop("config", None)
    digest = hashlib.sha256(
        json.dumps(
            {"config": training_config, "inputs": _input_fingerprint(config),
             "shards": [_tensor_digest(per_segment[i]) for i in sorted(per_segment)]},
            sort_keys=True,
        ).encode()
    ).hexdigest()
    run_id = f"{config.run.name}-{digest[:12]}"
    plan = Plan(
        run_id=run_id,
        digest=digest,
        config=config.model_dump(mode="json"),
        num_conversations=len(conversations),
        num_truncated=num_truncated,
        num_dropped=num_dropped,
        num_tokens=int(sum(len(s.input_ids) for s in sequences)),
        segments=[
            SegmentPlan(index=i, start_step=s, end_step=e, shard_file=f"plan/segment-{i:04d}.safetensors", num_loss_tokens=n)
            for i, s, e, n in segment_specs
        ],
    )
    return plan, per_segment


def write_plan(plan: Plan, shards: dict[int, dict[str, torch.Tensor]], run_dir: Path) -> Path:
    """Write shards, then plan.json last (atomically), so a plan file implies its shards."""
    (run_dir / "plan").mkdir(parents=True, exist_ok=True)
    for segment in plan.segments:
        target = run_dir / segment.shard_file
        tmp = target.with_suffix(".tmp")
        save_file(shards[segment.index], str(tmp), metadata={"run_id": plan.run_id})
        os.replace(tmp, target)
    plan_path = run_dir / PLAN_FILE
    tmp = plan_path.with_suffix(".tmp")
    tmp.write_text(plan.to_json())
    os.replace(tmp, plan_path)
    return plan_path


def read_plan(run_dir: Path) -> Plan:
    return Plan.from_json((run_dir / PLAN_FILE).read_text())


def load_segment_shard(run_dir: Path, segment: SegmentPlan) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / segment.shard_file))
