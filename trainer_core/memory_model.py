"""How many bytes one training process holds, predicted from the model's shape before any GPU is rented.

Pure arithmetic (no torch): the inputs are a `ModelShape` (every parameter's
rows and numel, grouped into the FSDP units `parallel.fsdp.shard.shard_model`
makes: the embedding, each decoder layer, [norm, lm_head], the root) and an
`ActivationFit` (saved bytes per token, measured once on the meta device), both
built by `trainer_core.memory_shape`. `predict` returns, for the most loaded
rank, the bytes of:

- parameters: the model's weights in `train.dtype` (`none`); under `fsdp` the
  FP32 sharded parameters, `ceil(rows / W)` rows of each (FSDP pads dim 0),
  which are also the masters under a bf16 `MixedPrecisionPolicy`;
- masters: FP32 copies of bf16 trainable weights (`none` only);
- moments: AdamW's `exp_avg` and `exp_avg_sq`, FP32, of the trainable weights;
- gradients: FP32 gradients of the trainable weights (the master's under bf16:
  the bf16 gradient is moved onto it one tensor at a time), sharded under fsdp;
- staged: a second backward into an existing accumulator (several local
  logical ranks) holds the staged gradient beside the accumulator until it
  commits: under `none` with the fast reduction (`training/transaction.py`),
  under `fsdp` with either (one FP32 gradient shard);
- partials: under `none` with the deterministic reduction, every local logical
  rank after the first keeps its own gradient until the ordered fold;
- snapshots: weights a stale graph holds per revision it lags (0 in a run: the
  segment runner backpropagates every forward before its step);
- in flight (fsdp): the unsharded weights, their gradients and the FP32
  reduce-scatter input of three consecutive units in backward order (the unit
  whose reduce-scatter is still running, the one computing, the one
  prefetched), plus the ordered fold's receive buffer under the deterministic
  reduction (one shard of the largest unit: `parallel/fsdp/fold.py` scatters
  one source's chunks at a time);
- activations: what one forward of one logical rank's rows saves for backward
  (`a·T + c·T²` per decoder layer and row, plus the rest of the model); with
  block checkpointing, each layer's input, plus one layer recomputed;
- head: the logits in the compute dtype, their FP32 upcast and log-softmax.

Under `hsdp` every term is `fsdp`'s with W the processes of one node
(`train.nproc_per_node`, `SHARD_GROUP`): each node holds a replica of the
shards, so more nodes add throughput, not memory per rank.

The total is the sum: an upper bound on the peak, since the activations peak
as backward starts and the gradients as it ends. Allocator slack and CUDA's own
context are not in it; compare with the device's memory with some margin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

from .parallel import PARALLELISM_NAMES, REPLICATED  # torch-free names

Sharding = Literal["none", "fsdp", "hsdp"]

SHARD_GROUP: dict[str, Callable[[int, int], int]] = {
    "none": lambda world_size, nodes: 1,
    "fsdp": lambda world_size, nodes: world_size,
    "hsdp": lambda world_size, nodes: world_size // nodes,
}
"""Per parallelism (`train.sharding`), the processes one tensor is sharded over, from the world size and the nodes:
none, all of them (fsdp), or those of one node (hsdp: the nodes hold replicas). A torch-free table, checked
against the parallelism registry's names at import."""
if tuple(SHARD_GROUP) != PARALLELISM_NAMES:
    raise ImportError(
        f"memory_model.SHARD_GROUP names {tuple(SHARD_GROUP)}, the parallelism registry {PARALLELISM_NAMES}; "
        "give every parallelism its shard group here"
    )

GB = 10**9
FP32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ParamShape:
    rows: int
    """Size of dim 0: what FSDP shards (1 for a 0-d tensor)."""
    numel: int
    trainable: bool

    def local_numel(self, world_size: int) -> int:
        """Elements one rank holds of it under FSDP: ceil(rows / W) rows (FSDP pads dim 0 to a multiple of W)."""
        return -(-self.rows // world_size) * (self.numel // max(self.rows, 1))

    def padded_numel(self, world_size: int) -> int:
        """Elements of the unsharded, padded tensor FSDP gathers and reduce-scatters."""
        return self.local_numel(world_size) * world_size


@dataclass(frozen=True)
class Unit:
    name: str
    params: tuple[ParamShape, ...]


@dataclass(frozen=True)
class ModelShape:
    units: tuple[Unit, ...]
    """In forward order: embedding, decoder layers, [norm, lm_head], root (units without parameters left out)."""
    num_layers: int
    vocab_rows: int
    """Rows of the output layer (the padded vocabulary when model.pad_vocab_to_multiple_of pads it)."""

    @property
    def params(self) -> tuple[ParamShape, ...]:
        return tuple(p for unit in self.units for p in unit.params)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)


@dataclass(frozen=True)
class ActivationFit:
    """Saved bytes of one row of T tokens (parameters excluded), in the compute dtype."""

    layer_linear: float
    """Per decoder layer, per token."""
    layer_quadratic: float
    """Per decoder layer, per token² (eager attention's probabilities; 0 with fused attention)."""
    rest_linear: float
    """Everything outside the decoder layers (embedding output, final norm, the head's input), per token."""
    checkpointed_layer_linear: float
    """Per checkpointed decoder layer, per token: its input."""

    def layer(self, seq_len: int) -> float:
        return self.layer_linear * seq_len + self.layer_quadratic * seq_len * seq_len


@dataclass(frozen=True)
class MemorySettings:
    """What the prediction depends on besides the model: the run's (or a benchmark's) choices."""

    sharding: Sharding
    world_size: int
    dtype: str
    """`float32` or `bfloat16` (train.dtype)."""
    logical_dp: int = 1
    reduction: str = "deterministic"
    activation_checkpointing: str = "none"
    rows_per_logical_rank: int = 1
    seq_len: int = 512
    held_revisions: int = 0
    """Revisions a live graph lags behind (snapshots kept); 0 for a run's segments."""
    nodes: int = 1
    """train.nnodes: under hsdp each node holds a replica, sharded over its own processes."""

    @property
    def shards_weights(self) -> bool:
        """Whether the weights, FP32 masters, moments and gradients are shards (any parallelism but replicas)."""
        return self.sharding != REPLICATED

    @property
    def shard_group(self) -> int:
        """The processes one tensor is sharded over (`SHARD_GROUP`); 1 for replicas."""
        return SHARD_GROUP[self.sharding](self.world_size, self.nodes)

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def local_logical_ranks(self) -> int:
        return max(1, self.logical_dp // self.world_size)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, per term (see the module docstring); `total` is their sum."""

    parameters: int
    masters: int
    moments: int
    gradients: int
    staged: int
    partials: int
    snapshots: int
    in_flight: int
    activations: int
    head: int

    @property
    def state(self) -> int:
        """Parameters, masters, moments and gradients: what a rank holds between steps, plus its gradients."""
        return self.parameters + self.masters + self.moments + self.gradients

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def terms(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _unit_in_flight(unit: Unit, settings: MemorySettings) -> int:
    """An unsharded unit in backward: its gathered weights, their gradients, and the FP32 reduce-scatter input."""
    w, cb = settings.shard_group, settings.compute_bytes
    weights = sum(p.padded_numel(w) for p in unit.params) * cb
    grads = sum(p.padded_numel(w) for p in unit.params if p.trainable) * (cb + FP32)
    return weights + grads


def _in_flight(shape: ModelShape, settings: MemorySettings) -> int:
    if not settings.shards_weights:
        return 0
    backward = [u for u in reversed(shape.units) if u.params]
    each = [_unit_in_flight(u, settings) for u in backward]
    window = max((sum(each[i : i + 3]) for i in range(max(1, len(each) - 2))), default=0)
    if settings.reduction == "deterministic":
        # The ordered fold receives one source's chunk of a unit's gradient at a time: one FP32 shard.
        w = settings.shard_group
        largest = max((sum(p.padded_numel(w) for p in u.params if p.trainable) for u in backward), default=0)
        window += largest // w * FP32
    return window


def _activations(shape: ModelShape, fit: ActivationFit, settings: MemorySettings) -> int:
    t = settings.seq_len
    if settings.activation_checkpointing == "blocks":
        # Every layer keeps its input; backward recomputes one layer at a time, which then saves what it saves.
        per_row = shape.num_layers * fit.checkpointed_layer_linear * t + fit.layer(t)
    else:
        per_row = shape.num_layers * fit.layer(t)
    return round(settings.rows_per_logical_rank * (per_row + fit.rest_linear * t))


def _staged(n_trainable: int, accumulator_bytes: int, extra_local: int, sharded: bool, reduction: str) -> int:
    """A backward into an existing accumulator holds the new gradient beside it until the commit.

    Unsharded, only the fast reduction stages (the deterministic one keeps partials instead). Sharded, both do:
    the committed FP32 shards are stashed while FSDP writes the turn's shards (`parallel/fsdp/fold.py`).
    """
    if not extra_local:
        return 0
    if sharded:
        return n_trainable * FP32
    return n_trainable * accumulator_bytes if reduction == "fast" else 0


def predict(shape: ModelShape, fit: ActivationFit, settings: MemorySettings) -> MemoryEstimate:
    """The bytes of the most loaded rank, per term."""
    w, cb, sharded = settings.shard_group, settings.compute_bytes, settings.shards_weights
    trainable = [p for p in shape.params if p.trainable]

    def held(params: list[ParamShape] | tuple[ParamShape, ...]) -> int:
        return sum(p.local_numel(w) if sharded else p.numel for p in params)

    n_trainable = held(trainable)
    bf16_masters = settings.dtype != "float32"
    accumulator_bytes = cb  # the gradient autograd accumulates, in the parameters' dtype
    extra_local = settings.local_logical_ranks - 1
    return MemoryEstimate(
        # Under fsdp the model is built in FP32 and the all-gather casts (MixedPrecisionPolicy).
        parameters=held(shape.params) * (FP32 if sharded else cb),
        masters=0 if sharded or not bf16_masters else n_trainable * FP32,
        moments=n_trainable * 2 * FP32,
        gradients=n_trainable * FP32 if sharded or bf16_masters else n_trainable * cb,
        staged=_staged(n_trainable, accumulator_bytes, extra_local, sharded, settings.reduction),
        partials=n_trainable * accumulator_bytes * extra_local
        if not sharded and settings.reduction == "deterministic"
        else 0,
        snapshots=settings.held_revisions * n_trainable * cb,
        in_flight=_in_flight(shape, settings),
        activations=_activations(shape, fit, settings),
        head=settings.rows_per_logical_rank * settings.seq_len * shape.vocab_rows * (cb + FP32 + FP32),
    )


LABELS = {
    "parameters": "parameters",
    "masters": "FP32 masters",
    "moments": "AdamW moments",
    "gradients": "gradients",
    "staged": "staged gradients",
    "partials": "logical-rank partials",
    "snapshots": "stale-weight snapshots",
    "in_flight": "in flight (gathered units)",
    "activations": "activations",
    "head": "head (logits, log-softmax)",
}


def human(num_bytes: float) -> str:
    """Bytes in decimal units (GB = 1e9, as GPUs are sold), three significant figures or so."""
    for unit, size in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def format_table(estimate: MemoryEstimate, settings: MemorySettings) -> list[str]:
    """The per-rank table, one line per term, then the total."""
    title = (
        f"memory per rank (sharding={settings.sharding}, W={settings.world_size}, dtype={settings.dtype}, "
        f"activation_checkpointing={settings.activation_checkpointing}, {settings.rows_per_logical_rank} rows × "
        f"{settings.seq_len} tokens per forward):"
    )
    lines = [title]
    lines += [f"  {LABELS[name]:<28} {human(value):>12}" for name, value in estimate.terms().items()]
    lines.append(f"  {'total':<28} {human(estimate.total):>12}")
    return lines


def fixes(settings: MemorySettings, *, lora: bool, can_shard: bool) -> list[str]:
    """What lowers the prediction, in the order to try it, leaving out what the config already does.

    `can_shard`: whether the config offers `train.sharding` (more processes only help a sharded model).
    """
    found = []
    if can_shard and not settings.shards_weights:
        found.append('train.sharding = "fsdp"')
    if not lora:
        found.append("[model.lora]")
    if settings.dtype == "float32":
        found.append('train.dtype = "bfloat16"')
    if settings.activation_checkpointing != "blocks":
        found.append('train.activation_checkpointing = "blocks"')
    if settings.rows_per_logical_rank > 1 and settings.shards_weights:  # one forward per sharded logical rank
        found.append(f"fewer rows per forward (more logical ranks: train.logical_dp above {settings.logical_dp})")
    elif settings.rows_per_logical_rank > 1:
        found.append(f"fewer rows per forward (train.micro_batch_size below {settings.rows_per_logical_rank})")
    if can_shard:
        found.append("more processes (train.nproc_per_node, train.nnodes)")
    return found
