"""Training state between segments: every checkpoint's weights, AdamW state and revision, and the data cursor.

Each checkpoint is saved with `checkpoint_io.save_checkpoint` into one
directory per checkpoint, beside `meta.json` (the next step). Rank 0 writes the
whole state into a temporary directory and renames it into place, so a state
directory either exists whole or not at all; a crashed segment never leaves a
half-written state for its retry to resume from. Weights are replicated over
data-parallel ranks, so one copy is enough.

Under `train.sharding = "fsdp"` no rank holds the weights whole: every rank
takes part (`save_sharded_training_state`). Rank 0 makes the temporary
directory, every rank writes its shards of each checkpoint into it
(`fsdp.checkpoint_io`, torch.distributed.checkpoint), and rank 0 writes
`meta.json` and renames it into place, with a status exchange after each
rank-0 part (a failure there fails every rank at once, naming it, instead of
leaving the peers in the next collective until it times out); the ranks
share the run directory (one node). A state directory (or its temporary one)
that is a symlink is replaced, never written through. The files are still plain files
under the state directory, so they travel as run-state bundles as before.
Restoring reshards: a state saved at one world size resumes at another.

Either way the state is durable when the save returns: every file and
directory fsync'd before the rename, the rename fsync'd, and the state's
local record (`state_record.py`: each file's fingerprint) written beside it,
which lets the next segment on this machine resume without re-hashing and the
upload (off the critical path) hash it once.

RNG needs no saving: every random draw is seeded from (seed, step, logical
rank), which also makes dropout independent of the physical world size.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from trainer_core.parallel.fsdp.checkpoint_io import (
    is_sharded,
    missing_shard_files,
    restore_sharded_checkpoint,
    save_sharded_checkpoint,
)
from trainer_core.ranks.coordination import exchange
from trainer_core.run.layout import RunDir
from trainer_core.run.state_record import forget_record, make_durable, make_durable_rename, write_record
from trainer_core.training import Checkpoint, restore_checkpoint, save_checkpoint

META_FILE = "meta.json"


def state_dir_for(run_dir: Path, segment_index: int) -> Path:
    return RunDir(run_dir).state_dir(segment_index)


def has_state(state_dir: Path) -> bool:
    return (state_dir / META_FILE).is_file()


def save_training_state(state_dir: Path, checkpoints: Mapping[str, Checkpoint], meta: dict) -> int:
    """Write the state atomically; returns its size in bytes."""
    tmp = _fresh(state_dir.with_name(state_dir.name + ".tmp"))
    for name, checkpoint in checkpoints.items():
        save_checkpoint(checkpoint, tmp / name)
    _put_in_place(tmp, state_dir, meta)
    return sum(p.stat().st_size for p in state_dir.rglob("*") if p.is_file())


def _remove(path: Path) -> None:
    """Remove whatever is at `path`: a link itself (never what it points to: nothing is written through one)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _fresh(tmp: Path) -> Path:
    _remove(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _put_in_place(tmp: Path, state_dir: Path, meta: dict) -> None:
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    make_durable(tmp)  # every file and directory fsync'd before the rename makes the state visible
    forget_record(state_dir)  # the old state's record goes first: no record outlives its files
    _remove(state_dir)
    os.replace(tmp, state_dir)
    make_durable_rename(state_dir)
    write_record(state_dir)  # fingerprints of the state in place (state_record.py: what resume and upload trust)


def _put_whole_in_place(tmp: Path, state_dir: Path, meta: dict, checkpoints: Mapping[str, Checkpoint]) -> None:
    for name in checkpoints:
        if missing := missing_shard_files(tmp / name):
            # Ranks on another machine wrote these into their own run directory: the state is not whole anywhere.
            raise ValueError(
                f"{tmp / name} lacks the shards {missing[:4]} other ranks wrote: with train.sharding = 'fsdp' across "
                "nodes, run.work_dir must be one shared filesystem at the same path on every node (docs/nodes.md)"
            )
    _put_in_place(tmp, state_dir, meta)


def _rank_zero_part(rank: int, what: str, work) -> None:
    """Rank 0 does `work`, then every rank hears whether it failed (rank 0 re-raises its own error, the others
    RankFailure naming it): a rank-0-only failure never leaves its peers waiting in the next collective."""
    error: BaseException | None = None
    if rank == 0:
        try:
            work()
        except Exception as failure:  # noqa: BLE001 - exchanged, then raised on every rank
            error = failure
    exchange(what, error)  # alone (no process group), it raises the error itself


def save_sharded_training_state(state_dir: Path, checkpoints: Mapping[str, Checkpoint], meta: dict, rank: int) -> int:
    """Every rank writes its shards; the state appears whole or not at all (collective). Returns its bytes."""
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    # No rank writes into a directory rank 0 is still clearing (the exchange is the barrier).
    _rank_zero_part(rank, "making the state's temporary directory", lambda: _fresh(tmp))
    for name, checkpoint in checkpoints.items():
        save_sharded_checkpoint(checkpoint, tmp / name)  # ends in a barrier: every rank's shards are written
    # No rank reports the state saved before it is whole and in place.
    _rank_zero_part(rank, "putting the state in place", lambda: _put_whole_in_place(tmp, state_dir, meta, checkpoints))
    return sum(p.stat().st_size for p in state_dir.rglob("*") if p.is_file())


def load_training_state(state_dir: Path, checkpoints: Mapping[str, Checkpoint], *, with_optimizer: bool = True) -> dict:
    """Restore every checkpoint (weights, revision, and AdamW state unless told not to); returns meta."""
    if not has_state(state_dir):
        raise FileNotFoundError(f"no complete training state at {state_dir}; rerun the segment that writes it")
    for name, checkpoint in checkpoints.items():
        # A sharded checkpoint restores collectively, resharding to this world size.
        restore = restore_sharded_checkpoint if is_sharded(checkpoint) else restore_checkpoint
        restore(checkpoint, state_dir / name, with_optimizer=with_optimizer)
    return json.loads((state_dir / META_FILE).read_text())
