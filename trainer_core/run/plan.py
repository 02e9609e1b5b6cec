"""The plan: a pure, deterministic function of config + data.

`build_plan` validates the data, tokenizes it, orders the sequences with the run
seed, cuts the run into segments of optimizer steps and lays out, per segment,
a shard file that every rank reads. The digest covers everything that decides
the training result, so the same inputs always give the same run id, and a
re-run of the same config finds (and resumes) the same run directory.

The plan streams: the data goes through the stages chunk by chunk into a store
on disk (`trainer_core.data.streaming`), the order and the packing need only
each document's length, and each segment's shard is laid out, hashed and
written (staged, see plan_shards.py) before the next, so its memory is one
segment's rows and a few integers a conversation (`plan_size`), whatever the
dataset's size.

Nothing is written until the whole input has been validated (the tokens stream
to a scratch store in the system's temporary space until then).

The data goes through the stages of `trainer_core.data` (render → tokenize →
mask → align → pack); the tensors of a shard, and what each means, are the
contract documented in `trainer_core/data/shards.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from trainer_core.config import RunConfig
from trainer_core.data import DataOptions, Prepared
from trainer_core.data.shards import packed_steps, round_up, stack_rows, unpacked_steps
from trainer_core.data_kinds import DATA_KINDS
from trainer_core.files import tensors_sha256, write_text_atomic
from trainer_core.run.held_out import EVAL_SHARD_FILE, eval_shard, split_held_out
from trainer_core.run.plan_shards import StagedShards, staging_root
from trainer_core.run.validate import CheckedInputs, validate_inputs

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
    data_kind: str = "sft"
    """`sft`, or `rl` when the data holds trajectories (the shards then carry the RL tensors)."""
    packed: bool = False
    """Whether the shards hold packed rows (`position_ids`, `document_ids`)."""
    num_flat_groups: int = 0
    """RL: reward groups whose rewards are all equal (advantage 0 throughout)."""
    stage_digests: dict[str, str] = field(default_factory=dict)
    """One digest per data stage (render, tokenize, mask, align) over the whole file."""
    eval_file: str | None = None
    """The held-out rows (`held_out.EVAL_SHARD_FILE`), relative to the run directory; None without held-out data."""
    num_eval_conversations: int = 0
    eval_loss_tokens: int = 0
    """Loss tokens of the held-out rows: the eval loss is their loss sum divided by this."""

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


def _step_order(num_sequences: int, config: RunConfig) -> np.ndarray:
    """Sequence indices for every optimizer step: epochs of seeded permutations."""
    needed = config.train.steps * config.train.global_batch_size
    rng = np.random.default_rng(config.run.seed)
    epochs = -(-needed // num_sequences)
    order = np.concatenate([rng.permutation(num_sequences) for _ in range(epochs)])
    return order[:needed].reshape(config.train.steps, config.train.global_batch_size)


def _document_stream(num_documents: int, seed: int) -> Iterator[int]:
    """Endless epochs of seeded permutations (packing does not know upfront how many it uses)."""
    rng = np.random.default_rng(seed)
    while True:
        yield from (int(i) for i in rng.permutation(num_documents))


def segment_bounds(config: RunConfig) -> list[tuple[int, int]]:
    """(start, end) optimizer steps of each segment, end exclusive: `train.steps` cut every `steps_per_segment`."""
    span = config.train.steps_per_segment
    return [(i * span, min((i + 1) * span, config.train.steps)) for i in range(config.train.num_segments)]


def _pad_id(tokenizer: Tokenizer) -> int:
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    return 0 if pad_id is None else pad_id


def _segment_shards(
    prepared: Prepared, config: RunConfig, options: DataOptions, pad_id: int, bounds: list[tuple[int, int]]
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Each segment's shard in turn, laid out from the documents it uses (read from the store as needed; `prepared`
    is what trains: without the held-out split)."""
    documents = prepared.documents
    if options.pack:
        stream = _document_stream(len(documents), config.run.seed)
        row_len = round_up(options.max_seq_len)
        shortest = int(prepared.lengths.min())
        for index, (start, end) in enumerate(bounds):
            steps = packed_steps(
                documents, stream, end - start, config.train.global_batch_size, row_len, pad_id, shortest=shortest
            )
            yield index, stack_rows(steps, packed=True)
        return
    order = _step_order(len(documents), config)
    for index, (start, end) in enumerate(bounds):
        yield index, stack_rows(unpacked_steps(documents, order[start:end], pad_id), packed=False)


def _objective_of_the_data(config: RunConfig) -> str:
    return DATA_KINDS[config.data.kind].default_objective


ADDED_LATER = {
    ("train", "objective"): _objective_of_the_data,
    # The state's format (DCP shards) and the fast reduction's last bits differ from a replicated run's.
    ("train", "sharding"): lambda _: "none",
    # A warm-up now starts at 0 as transformers' schedulers do (step s trains at s / warmup_steps, before at
    # (s + 1) / warmup_steps): a run with a warm-up planned before trained at other rates, so its id must change,
    # and the key stays in the digest (None is never a config's value). Without a warm-up nothing changed.
    ("train", "lr_schedule"): lambda config: "constant" if config.train.warmup_steps == 0 else None,
    ("train", "min_lr_ratio"): lambda _: 0.0,
    ("train", "micro_batch_size"): lambda _: None,
    ("data", "eval_fraction"): lambda _: 0.0,
    # Unset: transformers' own kernel, as every run before the key. A hub model's commit names its bytes.
    ("model", "attn_implementation"): lambda _: None,
    ("model", "revision"): lambda _: None,
}
"""Keys added after run ids were first given out, each with its default for a config: at that default a key leaves the
digest, so every run planned before the key existed keeps its run id (tests/unit/test_run_ids.py pins them). A new key
that decides the result joins this table; one that does not is popped below with the other operational keys."""


def digest_view(config: RunConfig) -> dict:
    """The part of the config that decides the training result: what the digest (and so the run id) covers."""
    training_config = config.model_dump(mode="json")
    # Where things are stored and how long a launch may take do not change the result.
    for volatile in ("storage", "export", "tracking"):  # where metrics go does not change them either
        training_config.pop(volatile)
    if config.export.merge_lora:  # the merged weights are part of what the run commits
        training_config["export"] = {"merge_lora": True}
    for operational in ("work_dir", "lease_wait_s", "lease_ttl_s"):  # the run lease's settings: how, not what
        training_config["run"].pop(operational)
    for operational in ("segment_timeout_s", "stall_timeout_s", "collective_timeout_s", "planner_miss_threshold"):
        training_config["train"].pop(operational)
    # Recomputing a layer in backward gives bitwise the gradients of a plain forward (tests/trainer/
    # test_activation_checkpointing.py): how much is kept, not what is trained.
    training_config["train"].pop("activation_checkpointing")
    # A micro-batch of a logical rank's whole share is one forward, as without: the same result and run id.
    if config.train.rows_per_forward == config.train.global_batch_size // config.train.logical_dp:
        training_config["train"]["micro_batch_size"] = None
    # The device's memory decides whether a run may start, not what it computes.
    training_config["train"].pop("device_memory_gb")
    if config.train.reduction == "deterministic":
        # The number of processes changes only the speed (trainer_core.ranks): a run
        # resumed at another nproc_per_node is the same run, under the same id.
        training_config["train"].pop("nproc_per_node")
    # Nodes are processes too (trainer_core.node_topology); one node leaves the digest as it was before nnodes.
    if config.train.reduction == "deterministic" or config.train.nnodes == 1:
        training_config["train"].pop("nnodes")
    for where in ("rdzv_endpoint", "node_deployment"):
        training_config["train"].pop(where)
    for section in ("model", "tokenizer", "data"):
        training_config[section].pop("path", None)
        training_config[section].pop("config", None)
    if training_config["model"].get("lora") is not None:  # where the adapter starts from: its bytes are fingerprinted
        training_config["model"]["lora"].pop("init_from")
    # The held-out files' bytes are in the inputs' fingerprint; how often they are evaluated changes no result.
    training_config["data"].pop("eval_path")
    training_config["train"].pop("eval_every")
    # The format the records were read in is in the inputs' fingerprint (validate.input_fingerprint), as resolved
    # from `auto`: how it was chosen is not what is trained on.
    training_config["data"].pop("format")
    for (section, key), default_for in ADDED_LATER.items():
        if training_config[section].get(key) == default_for(config):
            training_config[section].pop(key)
    return training_config


def build_plan(config: RunConfig, checked: CheckedInputs | None = None) -> tuple[Plan, StagedShards]:
    """Validate, tokenize and lay out the run, one segment at a time.

    Everything comes from the config (the data stages from `config.data`), so
    the digest really names the plan. The inputs are checked first
    (`validate_inputs`, unless the caller passes what it already checked); the
    only things written are the stage cache and the staged shards, both under
    `run.work_dir/cache`, and only for inputs that passed every check. The
    shards come back staged (read on access); `write_plan` puts them in the
    run directory.
    """
    if checked is None:
        checked = validate_inputs(config)
    checked.store_cache()
    bounds = segment_bounds(config)
    shards = StagedShards(staging_root(config.run.work_dir), config.run.name)
    trained, held_out = checked.prepared, checked.held_out.prepared if checked.held_out is not None else None
    if config.data.eval_fraction:
        trained, held_out = split_held_out(trained, config.data.eval_fraction, config.run.seed, checked.source.label)
    pad_id = _pad_id(checked.tokenizer)
    shard_digests, loss_tokens = [], []
    for index, tensors in _segment_shards(trained, config, checked.options, pad_id, bounds):
        shard_digests.append(tensors_sha256(tensors))
        loss_tokens.append(int(tensors["loss_mask"].sum()))
        shards.add(index, tensors)
        del tensors  # the next segment is laid out without this one in memory
    held = None
    if held_out is not None:
        tensors = eval_shard(held_out, pad_id)
        held = HeldOutPlan(len(held_out.lengths), int(tensors["loss_mask"][:, 1:].sum()), tensors_sha256(tensors))
        shards.add_eval(tensors)
        del tensors
    digest = _digest(config, checked.fingerprint, shard_digests, held.digest if held else None)
    plan = _plan(config, checked, digest, bounds, loss_tokens, trained, held)
    shards.stamp(plan.run_id)
    return plan, shards


@dataclass(frozen=True)
class HeldOutPlan:
    num_conversations: int
    loss_tokens: int
    digest: str


def plan_digest(config: RunConfig, fingerprint: dict, shards: Mapping[int, Mapping[str, torch.Tensor]]) -> str:
    """What names the plan: the config as the digest sees it (`digest_view`), the inputs and every shard's bytes."""
    return _digest(config, fingerprint, [tensors_sha256(shards[i]) for i in sorted(shards)])


def _digest(config: RunConfig, fingerprint: dict, shard_digests: list[str], eval_digest: str | None = None) -> str:
    """`plan_digest` from each shard's `tensors_sha256`, in segment order (and the eval shard's, where there is one:
    a plan without held-out data keeps the digest it had before they existed)."""
    named: dict[str, object] = {"config": digest_view(config), "inputs": fingerprint, "shards": shard_digests}
    if eval_digest is not None:
        named["eval_shard"] = eval_digest
    return hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()


def _plan(
    config: RunConfig,
    checked: CheckedInputs,
    digest: str,
    bounds: list[tuple[int, int]],
    loss_tokens: list[int],
    trained: Prepared,
    held: HeldOutPlan | None,
) -> Plan:
    prepared, options = checked.prepared, checked.options
    return Plan(
        run_id=f"{config.run.name}-{digest[:12]}",
        digest=digest,
        config=config.model_dump(mode="json"),
        num_conversations=prepared.num_records,
        num_truncated=prepared.num_truncated,
        num_dropped=prepared.num_dropped,
        num_tokens=int(trained.lengths.sum()),
        segments=[
            SegmentPlan(
                index=i,
                start_step=start,
                end_step=end,
                shard_file=f"plan/segment-{i:04d}.safetensors",
                num_loss_tokens=loss_tokens[i],
            )
            for i, (start, end) in enumerate(bounds)
        ],
        data_kind=prepared.kind.name,
        packed=options.pack,
        num_flat_groups=prepared.advantage_stats.num_flat_groups if prepared.advantage_stats else 0,
        stage_digests=prepared.stage_digests,
        eval_file=EVAL_SHARD_FILE if held is not None else None,
        num_eval_conversations=held.num_conversations if held is not None else 0,
        eval_loss_tokens=held.loss_tokens if held is not None else 0,
    )


def write_plan(plan: Plan, shards: StagedShards, run_dir: Path) -> Path:
    """Put the staged shards in place, then plan.json last (atomically), so a plan file implies its shards."""
    (run_dir / "plan").mkdir(parents=True, exist_ok=True)
    placed = [(segment.index, segment.shard_file) for segment in plan.segments]
    for index, shard_file in placed + ([(None, plan.eval_file)] if plan.eval_file is not None else []):
        target = run_dir / shard_file
        tmp = target.with_suffix(".tmp")
        shards.place(index, tmp)
        os.replace(tmp, target)
    plan_path = run_dir / PLAN_FILE
    write_text_atomic(plan_path, plan.to_json())
    return plan_path


def read_plan(run_dir: Path) -> Plan:
    return Plan.from_json((run_dir / PLAN_FILE).read_text())


def load_segment_shard(run_dir: Path, segment: SegmentPlan) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / segment.shard_file))


def load_eval_shard(run_dir: Path, plan: Plan) -> dict[str, torch.Tensor] | None:
    """The held-out rows ([N, T] tensors), or None for a plan without held-out data."""
    return None if plan.eval_file is None else load_file(str(run_dir / plan.eval_file))
