"""Committing an already committed checkpoint again vs committing it the first time.

    python -m bench.recommit [--repeats 7] [--shards 4] [--shard-mb 50]

The baseline is a first commit of a ~202 MB staged checkpoint to a fresh run
on a local SeaweedFS. The candidate commits the same staging again with its
journal and the store's journal mirror deleted — a retry on another machine,
or a checkpoint committed by an older rankflow — so the commit must find out
from the store what is already there: one listing, one HEAD per object (the
sha256 is stored with each object, so nothing is downloaded), no upload. The
ratio is candidate/baseline wall time (lower is better, target <= 0.05).
`with_journal_s` is the retry the pipeline usually makes, whose journal
already says COMMITTED.
"""

from __future__ import annotations

import json
import time

from bench._storage import BUCKET, checkpoint_arguments, median, seaweedfs, stage_checkpoint, staged_bytes
from infra.publication.commit import commit_checkpoint
from infra.publication.journal import journal_path_for
from infra.publication.manifests import journal_key
from infra.store import open_store

RUN = "bench-run"


def main(argv: list[str] | None = None) -> None:
    args = checkpoint_arguments(__doc__.splitlines()[0]).parse_args(argv)
    with seaweedfs() as (_, tmp):
        staged = stage_checkpoint(tmp / "staging", RUN, 100, args.shards, args.shard_mb * 10**6)
        megabytes = staged_bytes(staged) / 1e6
        store = open_store(f"s3://{BUCKET}/runs")
        journal = journal_path_for(staged, store)
        mirror = journal_key(RUN, 100)
        times: dict[str, list[float]] = {"baseline": [], "candidate": [], "with_journal": []}
        for _ in range(args.repeats):
            journal.unlink(missing_ok=True)
            started = time.perf_counter()
            first = commit_checkpoint(staged, store, RUN)
            times["baseline"].append(time.perf_counter() - started)
            assert first.num_files_skipped == 0
            started = time.perf_counter()
            again = commit_checkpoint(staged, store, RUN)
            times["with_journal"].append(time.perf_counter() - started)
            assert again.already_committed
            journal.unlink()
            store.remove([mirror])
            started = time.perf_counter()
            recommit = commit_checkpoint(staged, store, RUN)
            times["candidate"].append(time.perf_counter() - started)
            assert recommit.num_files_uploaded == 0 and not recommit.already_committed
            store.remove([store.key(RUN, path) for path in store.list(RUN)])
    baseline_s, candidate_s = median(times["baseline"]), median(times["candidate"])
    print(f"checkpoint: {megabytes:.0f} MB; medians over {args.repeats} repeats")
    print(f"first commit:                    {baseline_s:.3f} s")
    print(f"recommit, no journal (HEADs):    {candidate_s:.3f} s")
    print(f"recommit, journal says COMMITTED: {median(times['with_journal']):.4f} s")
    print(
        json.dumps(
            {
                "bench": "recommit",
                "baseline": {"name": "first commit", "wall_s": baseline_s, "runs_s": times["baseline"]},
                "candidate": {
                    "name": "recommit without a journal",
                    "wall_s": candidate_s,
                    "runs_s": times["candidate"],
                },
                "ratio": round(candidate_s / baseline_s, 4),
                "higher_is_better": False,
                "target": "<= 0.05",
                "with_journal_s": median(times["with_journal"]),
                "with_journal_ratio": round(median(times["with_journal"]) / baseline_s, 5),
                "megabytes": round(megabytes, 1),
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
