"""Removing segment states that no run needs any more (`storage.keep_states = false`).

A segment's bundle (run_state.py) holds its training state and its result.
After the checkpoint of segment A commits, a state of a segment j < A is
needed by nothing: every later segment resumes from A's state or a later
one, and j's export, if it has one, is committed (or retention removed it).
`states_to_remove` is that rule. A state is removed holding the finalizer
lease (which every state upload holds too, so none is in flight), in this
order:

1. the bundle's manifest is replaced by one that lists only the result (one
   atomic put): the state is no longer part of the bundle, and a rerun still
   finds the segment done (its losses, no training) — it never retrains it;
2. the state's objects are removed from the store, then its directory;
3. the local copy in `run.work_dir` (a cache) is removed.

A gc killed after 1 leaves unlisted objects that the next one removes (it
looks for them under every removable segment). A bundle with no manifest
(an upload that never finished), or one that lists no result, is left alone.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from infra.publication.finalizer import HeldFinalizer
from infra.runs.run_state import BundleManifest, manifest_path, read_bundle_manifest, segment_bundle
from infra.store.base import ObjectStore
from infra.store.objects import list_files, put_small, remove_empty_directories, remove_files
from trainer_core.run.state_record import forget_record


def states_to_remove(anchor: int, exported: Callable[[int], bool], published: Callable[[int], bool]) -> list[int]:
    """The segments before `anchor` whose state nothing needs: no export, or their checkpoint is published.

    `anchor` is the segment whose checkpoint just committed (its bundle complete); `exported(j)` says whether the
    plan exports after segment j, `published(j)` whether that checkpoint is committed or was removed by retention.
    """
    return [j for j in range(anchor) if not exported(j) or published(j)]


def retire_state(
    store: ObjectStore, run_id: str, run_dir: Path, segment: int, state_prefix: str, held: HeldFinalizer
) -> int | None:
    """Remove segment `segment`'s state (files under `state_prefix/`), keeping its result; bytes removed, or None.

    None: nothing removed (no complete bundle, no result in it, or removed already).
    """
    bundle = segment_bundle(segment)
    prefix = state_prefix.rstrip("/") + "/"
    with store.errors(f"retention of the {bundle} state of run {run_id}"):
        manifest = read_bundle_manifest(store, run_id, bundle)
        if manifest is None:
            return None
        results = [entry for entry in manifest.files if not entry.path.startswith(prefix)]
        if not results:
            return None
        reduced_now = len(results) < len(manifest.files)
        if reduced_now:
            held.check()
            reduced = BundleManifest(format=manifest.format, run_id=run_id, bundle=bundle, files=results)
            put_small(store, manifest_path(store, run_id, bundle), reduced.to_bytes())
        base = store.path(run_id, prefix.rstrip("/"))
        files = list_files(store, base)
        held.check()
        remove_files(store, base, sorted(files))
        remove_empty_directories(store, base, sorted(files))
    local = run_dir / prefix.rstrip("/")
    forget_record(local)  # first, as a save replaces a state: no record outlives its files
    cached = local.exists() or local.is_symlink()
    if local.is_dir() and not local.is_symlink():
        shutil.rmtree(local)
    elif cached:
        local.unlink()  # a link: removed, never what it points to
    return sum(files.values()) if reduced_now or files or cached else None
