"""Committing a checkpoint to SeaweedFS vs a raw s3fs put of the same files.

    python -m bench.commit_throughput [--repeats 7] [--shards 4] [--shard-mb 50]

Both sides upload the same staged checkpoint (default 4 × 50 MB shards plus
an index, a config and a 2 MB tokenizer: about 202 MB) to a fresh prefix of
one local SeaweedFS, alternating, several times. The baseline is s3fs's own
batched `put` of the files (concurrent put_file, multipart past its
threshold); the candidate is `commit_checkpoint`: lease, journal, HEADs,
sha256 of every byte as it is read (a staged file that changed is refused),
the digest stored with each object, manifest last, LATEST. The figure is
MB/s; the ratio is candidate/baseline (higher is better, target >= 0.90).
"""

from __future__ import annotations

import json
import time

from bench._storage import BUCKET, checkpoint_arguments, median, seaweedfs, stage_checkpoint, staged_bytes
from infra.publication.commit import commit_checkpoint
from infra.publication.journal import journal_path_for
from infra.store import open_store
from infra.store.s3_client import bounded_s3_filesystem


def main(argv: list[str] | None = None) -> None:
    args = checkpoint_arguments(__doc__.splitlines()[0]).parse_args(argv)
    with seaweedfs() as (_, tmp):
        staged = stage_checkpoint(tmp / "staging", "bench-run", 100, args.shards, args.shard_mb * 10**6)
        num_bytes = staged_bytes(staged)
        files = sorted(p for p in staged.rglob("*") if p.is_file())
        store = open_store(f"s3://{BUCKET}/runs")
        fs = bounded_s3_filesystem(store.timeouts)  # the baseline: the same bounded s3fs client, used raw
        times: dict[str, list[float]] = {"baseline": [], "candidate": []}
        for repeat in range(args.repeats):
            for side in ("baseline", "candidate") if repeat % 2 == 0 else ("candidate", "baseline"):
                run_id = "bench-run" if side == "candidate" else f"raw-{repeat}"
                if side == "baseline":
                    remote = [store.path(run_id, "raw", p.relative_to(staged).as_posix()) for p in files]
                    started = time.perf_counter()
                    fs.put([str(p) for p in files], remote)
                    times[side].append(time.perf_counter() - started)
                else:
                    # A fresh journal each time: every file is uploaded, as in a first commit.
                    journal_path_for(staged, store).unlink(missing_ok=True)
                    started = time.perf_counter()
                    outcome = commit_checkpoint(staged, store, run_id)
                    times[side].append(time.perf_counter() - started)
                    assert outcome.num_files_skipped == 0  # a first commit: everything uploaded
                fs.rm(store.path(run_id), recursive=True)  # a fresh prefix each time; bounded disk use
    baseline_s, candidate_s = median(times["baseline"]), median(times["candidate"])
    megabytes = num_bytes / 1e6
    print(f"checkpoint: {megabytes:.0f} MB in {len(files)} files; medians over {args.repeats} repeats")
    print(f"raw s3fs put:       {baseline_s:.2f} s  ({megabytes / baseline_s:.0f} MB/s)")
    print(f"commit_checkpoint:  {candidate_s:.2f} s  ({megabytes / candidate_s:.0f} MB/s)")
    print(
        json.dumps(
            {
                "bench": "commit_throughput",
                "baseline": {
                    "name": "s3fs put",
                    "wall_s": baseline_s,
                    "mb_per_s": round(megabytes / baseline_s, 1),
                    "runs_s": times["baseline"],
                },
                "candidate": {
                    "name": "commit_checkpoint",
                    "wall_s": candidate_s,
                    "mb_per_s": round(megabytes / candidate_s, 1),
                    "runs_s": times["candidate"],
                },
                "ratio": round(baseline_s / candidate_s, 4),
                "higher_is_better": True,
                "target": ">= 0.90",
                # The same figure per interleaved pair, whose median shrugs off a load spike on a shared machine.
                "paired_ratio_median": median([b / c for b, c in zip(times["baseline"], times["candidate"])]),
                "megabytes": round(megabytes, 1),
                "num_files": len(files),
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
