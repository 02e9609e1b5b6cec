"""`[train]` of the run configuration: steps and segments, the optimizer and its schedule, the processes and logical
ranks, the backward state, sharding, evaluation's cadence, and the limits a launch runs under (`trainer_core.config`
assembles the sections)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .config_base import _Beta, _Section
from .lr_schedule import SCHEDULE_KINDS, LRSchedule
from .parallel import PARALLELISM_NAMES, REPLICATED  # torch-free: the package loads its classes lazily
from .parallel.limits import PARALLELISM_LIMITS  # torch-free, like the names
from .ranks.topology import topology_problem  # a light module: trainer_core.ranks loads its names lazily
from .registry_names import BACKWARD_MODES, OBJECTIVE_NEEDS, PLANNER


class TrainSection(_Section):
    steps: int = Field(default=100, ge=1)
    """Total optimizer steps of the run."""
    steps_per_segment: int = Field(default=50, ge=1)
    """Optimizer steps per torchrun launch; training state is saved between segments."""
    global_batch_size: int = Field(default=16, ge=1)
    """Sequences per optimizer step, over all logical ranks; a multiple of logical_dp."""
    learning_rate: float = Field(default=1e-4, gt=0)
    """AdamW's peak learning rate, reached after `warmup_steps` of linear warm-up; `lr_schedule` says what follows."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW's decoupled weight decay."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.95)
    """AdamW's moment decay rates, each in [0, 1); note that torch.optim.AdamW's default is (0.9, 0.999)."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW's epsilon."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up from 0: step s (0-based) of the first warmup_steps trains at learning_rate × s / warmup_steps,
    as transformers' schedulers do. At most `steps`."""
    lr_schedule: Literal[SCHEDULE_KINDS] = "constant"  # pyright: ignore[reportInvalidTypeForm]
    """After the warm-up: `constant`, or a `linear` or `cosine` decay toward learning_rate × min_lr_ratio, reached at
    step `steps` (one past the last step trained, so the last step's rate is a little above it); transformers'
    get_constant/linear/cosine(_with_min_lr)_schedule_with_warmup, step for step."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Where a linear or cosine decay ends, as a fraction of learning_rate."""
    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables clipping); note that torch.optim.AdamW does not clip."""
    micro_batch_size: int | None = Field(default=None, ge=1)
    """Rows per forward of each logical rank (gradient accumulation): a logical rank's global_batch_size / logical_dp
    rows run as forwards and backwards of this many rows each, its gradient their sum, normalised as before by the
    loss tokens of the global batch. Peak activation memory falls with it. Unset: all of them in one forward."""
    logical_dp: int = Field(default=1, ge=1)
    """Logical data-parallel ranks L; results depend on L, never on the number of processes (docs/logical-ranks.md)."""
    nproc_per_node: int = Field(default=1, ge=1)
    """Physical ranks W (torchrun processes per node); must divide logical_dp (a bad topology stops before any
    process group)."""
    nnodes: int = Field(default=1, ge=1, le=4096)
    """Nodes a segment runs on (torchrun `--nnodes`, c10d rendezvous); the world size nnodes × nproc_per_node must
    divide logical_dp (docs/nodes.md)."""
    rdzv_endpoint: str | None = None
    """With nnodes > 1: HOST:PORT of the c10d rendezvous store, served by node 0 (which must run on HOST). Unset: node 0
    serves it at a free port of its own address and publishes that through the store for each attempt; the local
    node launches of `rankflow run` use 127.0.0.1 (docs/nodes.md)."""
    node_deployment: str | None = None
    """With nnodes > 1: the per-node deployment (`rankflow-node/NAME`) each node's launch runs as, one flow run per
    node on work queue `node-K` of its pool; `rankflow deploy` sets it. Unset: the node launches run as local
    processes (one machine)."""
    reduction: Literal["deterministic", "fast"] = "deterministic"
    """`deterministic`: gradients, losses and counts are folded in logical-rank order, so results are bitwise the same
    at any nproc_per_node; `fast`: a plain all-reduce (last bits depend on nproc_per_node)."""
    threads_per_process: int | None = Field(default=None, ge=1)
    """Intra-op CPU threads of each rank. Unset: 1 with deterministic reduction (a count that does not depend on
    nproc_per_node), cores / nproc_per_node with fast. The count changes the last bits of results, not W."""
    backward_mode: Literal[(*BACKWARD_MODES, PLANNER)] = "retain"  # pyright: ignore[reportInvalidTypeForm]
    """How each forward keeps its backward state; `auto` lets the memory planner choose per graph."""
    saved_bytes_budget: int | None = Field(default=None, ge=0)
    """Resident bytes the planner may keep (with backward_mode = auto): live graphs' saved tensors and the weight
    snapshots stale graphs hold."""
    max_gradient_staleness: int = Field(default=2, ge=0, strict=True)
    """Optimizer steps a forward's graph may lag behind at backward (0 = strict)."""
    sharding: Literal[PARALLELISM_NAMES] = "none"  # pyright: ignore[reportInvalidTypeForm]
    """`fsdp`: every decoder layer and the root are FSDP2-sharded over the W processes (weights, FP32 masters, AdamW
    moments and gradients live as 1/W shards; the state is saved with torch.distributed.checkpoint). With
    train.reduction = "deterministic" the logical ranks run round-robin over the processes and their gradient
    shards are folded in logical-rank order: bitwise the same at any W, so a run resumes at another W (W stays out
    of the run id); with `fast`, FSDP's reduce-scatter. With [model.lora] the adapter trains as shards over the
    frozen sharded base. `hsdp`: sharded like `fsdp` over the processes of a node (train.nproc_per_node, at least
    2), replicated over the nodes (train.nnodes), bitwise alike under the deterministic reduction. `none`: every
    process holds a full replica. The choices are the parallelism registry's (`trainer_core.parallel`)."""
    activation_checkpointing: Literal["none", "blocks"] = "none"
    """`blocks`: every decoder layer keeps only its input and runs again in backward (about one more forward per
    layer) for far fewer saved bytes; gradients, weights and run id are bitwise those of `none`."""
    device_memory_gb: float | None = Field(default=None, gt=0)
    """Memory of one training device, in GB (1e9 bytes): a run whose predicted bytes per rank (the memory model,
    trainer_core/memory_model.py) exceed it is refused before anything is written. Unset: the memory of CUDA device 0
    of the machine that checks, or no check without one. Not part of the run id."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations: `float32`, or `bfloat16` weights trained through FP32 master weights and moments."""
    planner_miss_threshold: float = Field(default=0.25, gt=0)
    """A memory-planner prediction off by more than this (relative) is a miss: counted, and reported under the run's
    work dir (`planner/`)."""
    nonfinite: Literal["skip", "error"] = "skip"
    """A non-finite gradient norm: `skip` the update on every rank (counted in the segment result) or fail the segment."""
    segment_timeout_s: float = Field(default=1800, gt=0)
    """Wall-clock limit of one torchrun launch; past it torchrun and every rank are killed."""
    stall_timeout_s: float = Field(default=300, gt=0)
    """Watchdog: a segment or export launch with no progress (setup done, a step, the state saved, an export phase)
    for this long is killed and retried."""
    collective_timeout_s: float = Field(default=600, gt=0)
    """Timeout of every collective (init_process_group), set explicitly; a peer silent this long fails the rank.
    Keep it above stall_timeout_s, so that the watchdog, with its better diagnosis, fires first."""
    eval_every: int = Field(default=0, ge=0)
    """Evaluate the held-out data (`data.eval_path` or `data.eval_fraction`) after every this many optimizer
    steps, besides the end of every segment; 0: at the end of every segment only."""
    objective: str | None = None
    """The training objective, one of `trainer_core.objectives.OBJECTIVES`: `sft` or `clipped_policy_gradient`.
    Unset: the one data.kind trains (`sft` for sft data, `clipped_policy_gradient` for rl data)."""

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, value: str | None) -> str | None:
        if value is not None and value not in OBJECTIVE_NEEDS:
            raise ValueError(
                f"must be one of {' or '.join(map(repr, OBJECTIVE_NEEDS))} (got {value!r}); choose one of them, "
                "or leave it unset to train the objective of data.kind"
            )
        return value

    @model_validator(mode="after")
    def _decay_floor(self) -> "TrainSection":
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ValueError(
                f"train.min_lr_ratio={self.min_lr_ratio} is where a decay ends, and train.lr_schedule is 'constant'; "
                "set lr_schedule = 'linear' or 'cosine', or remove min_lr_ratio"
            )
        return self

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> "TrainSection":
        if self.warmup_steps > self.steps:
            # The schedule would still be transformers' (rate s / warmup_steps), but the run would end inside its
            # warm-up and never train at learning_rate: a warm-up meant in steps of another run, or steps cut.
            raise ValueError(
                f"train.warmup_steps={self.warmup_steps} is more than train.steps={self.steps}: the run would end "
                f"inside its warm-up, never reaching learning_rate; set warmup_steps to at most {self.steps} "
                "(a few percent of steps is usual), or raise steps"
            )
        return self

    @model_validator(mode="after")
    def _micro_batches_unsharded(self) -> "TrainSection":
        if self.global_batch_size % self.logical_dp:
            return self  # _divisibility says what is wrong first
        rows = self.global_batch_size // self.logical_dp
        if self.shards_weights and self.micro_batch_size is not None and self.micro_batch_size < rows:
            # The sharded fold takes one backward per logical rank's turn (trainer_core/parallel/fsdp/gradients.py);
            # a second would fold in another association than the unsharded run's.
            raise ValueError(
                f'train.micro_batch_size={self.micro_batch_size} with train.sharding = "{self.sharding}": a sharded logical '
                "rank runs its rows in one forward; cut the rows per forward with more logical ranks instead (a "
                f"train.logical_dp that divides global_batch_size={self.global_batch_size} into shares of at most "
                f"{self.micro_batch_size} row(s), run in turn on every process), or remove micro_batch_size"
            )
        return self

    @model_validator(mode="after")
    def _within_the_parallelism_s_limits(self) -> "TrainSection":
        fewest = PARALLELISM_LIMITS[self.sharding].deterministic_min_processes_per_node
        if self.reduction == "deterministic" and self.nnodes > 1 and self.nproc_per_node < fewest:
            raise ValueError(
                f'train.sharding = "{self.sharding}" with train.reduction = "deterministic" folds over at least '
                f"{fewest} processes per node, got train.nproc_per_node = {self.nproc_per_node} on "
                f'{self.nnodes} nodes; set train.nproc_per_node = {fewest} or more, train.sharding = "fsdp", '
                'or train.reduction = "fast"'
            )
        return self

    @property
    def shards_weights(self) -> bool:
        """Whether `sharding` spreads the weights over the processes: every parallelism but the replicated one."""
        return self.sharding != REPLICATED

    @property
    def rows_per_forward(self) -> int:
        """Rows one forward of a logical rank runs: the micro-batch, or the logical rank's whole share."""
        rows = self.global_batch_size // self.logical_dp
        return rows if self.micro_batch_size is None else min(self.micro_batch_size, rows)

    @property
    def schedule(self) -> LRSchedule:
        """The learning-rate schedule of every checkpoint the run trains."""
        return LRSchedule(self.lr_schedule, self.warmup_steps, self.steps, self.min_lr_ratio)

    @model_validator(mode="after")
    def _divisibility(self) -> "TrainSection":
        if self.nnodes > 1:
            from .node_topology import check_nodes

            check_nodes(self.nnodes, self.nproc_per_node, self.logical_dp, self.node_deployment, self.rdzv_endpoint)
        # One node's processes: with several nodes check_nodes has already held their world to the rule.
        problem = topology_problem(self.nproc_per_node, self.logical_dp, self.global_batch_size)
        if problem is not None and problem.what == "logical_dp":
            raise ValueError(
                f"train.logical_dp={self.logical_dp} is not a multiple of "
                f"train.nproc_per_node={self.nproc_per_node}; choose a logical_dp "
                f"that the world size divides (e.g. {problem.suggestion})"
            )
        if problem is not None:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.logical_dp={self.logical_dp}; every logical rank needs the same "
                f"number of sequences (e.g. global_batch_size={problem.suggestion})"
            )
        return self

    @property
    def forward_mode(self) -> str | None:
        """The `mode` each forward is run with: the backward mode, or None where the planner chooses."""
        return None if self.backward_mode == PLANNER else self.backward_mode

    @property
    def num_segments(self) -> int:
        return -(-self.steps // self.steps_per_segment)
