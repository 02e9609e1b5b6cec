"""python -m bench.boundary: a segment boundary with the state upload beside the next segment vs before it.

A boundary is the time from the last optimizer step of segment K to the first
of segment K+1, read from the progress records rank 0 writes (so it holds the
save, the launch's exit, what the orchestrator does in between, the next
launch's start, its state load and its first step). Two sides, interleaved,
against a local SeaweedFS, at each state size (a wider Qwen3 per size; 12
bytes per parameter: FP32 weights and two AdamW moments):

- baseline, today's sequential path: segment K saves, then its state is
  hashed and uploaded, then segment K+1 verifies its input by hashing it
  against the stored manifest, then launches. (The same code as the
  candidate, with the save's local record removed: every step then hashes as
  before records.)
- candidate: segment K saves (fsync'd, fingerprinted); segment K+1 starts at
  once from the local state (its record's trust rule: no hashing) while the
  state upload runs beside it (hashing once; held until K+1's first step, as
  a run's is: `tasks.upload_hold`), its ranks forked by the run's warm
  process as a run's are (`infra.launch.warm_ranks`; the baseline's ranks
  import by themselves, as before).

Each segment runs two steps: the next segment's second step is a step's own
compute. The boundary holds the first step's compute, which is not time a
GPU sits idle; the critical path (`idle_s`) is the time from the last step
of K until K+1 is ready to step (its `ready` record: state loaded), plus
what its first step takes beyond a step's own compute (one-time costs such
as the moments still being read), which is the shorter of K's last step and
K+1's second (the upload starts at K+1's first step: its second runs beside
it and alone would hide those costs).

Printed: each side's boundary and critical path in seconds and seconds per
GB at each size, the pieces (save, hash, upload, verify, launch to ready
with its load, first step), and straight-line fits over the sizes, whose
slopes are the seconds per GB a larger state adds. The last line is the
JSON summary; `ratio` is candidate / baseline boundary at the largest size
(target ≤ 0.5) and `critical_path_s_per_gb` the slope of the candidate's
critical path (target ≤ 1.0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BYTES_PER_PARAM = 12
"""FP32 weights, AdamW's two moments."""
VOCAB = 1024
"""The example tokenizer's vocabulary."""
SIZES_GB = (0.1, 0.5, 2.0)
HEAD_DIM = 64


def qwen3_params(hidden: int, layers: int, vocab: int = VOCAB) -> int:
    """Parameters of the benchmark's Qwen3 (intermediate 3×hidden, one KV head per query head, untied head)."""
    intermediate = 3 * hidden
    attention = 4 * hidden * hidden + 2 * HEAD_DIM  # q, k, v, o; q_norm and k_norm
    mlp = 3 * hidden * intermediate
    per_layer = attention + mlp + 2 * hidden  # two RMSNorms
    return 2 * vocab * hidden + layers * per_layer + hidden  # embeddings, lm_head, layers, the final norm


def model_for(gigabytes: float) -> dict:
    """The model config overrides whose state is closest to `gigabytes` (hidden 256 below 0.05 GB, 512 below
    0.3 GB, else 1024; at least 2 layers: the memory check's activation fit builds two)."""
    hidden = 256 if gigabytes < 0.05 else 512 if gigabytes < 0.3 else 1024
    target = gigabytes * 1e9 / BYTES_PER_PARAM
    layers = min(range(2, 64), key=lambda n: abs(qwen3_params(hidden, n) - target))
    heads = hidden // HEAD_DIM
    return {
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": HEAD_DIM,
        "layer_types": ["full_attention"] * layers,
    }


def state_gb(overrides: dict) -> float:
    return qwen3_params(overrides["hidden_size"], overrides["num_hidden_layers"]) * BYTES_PER_PARAM / 1e9


def boundary_s(records_k: list[dict], records_next: list[dict]) -> float:
    """Last optimizer step of segment K to the first of K+1, from their progress records."""
    last = max(r["time"] for r in records_k if r["event"] == "step")
    first = min(r["time"] for r in records_next if r["event"] == "step")
    return first - last


def critical_path_s(records_k: list[dict], records_next: list[dict]) -> float:
    """What a GPU would sit idle: the last step of K until K+1 is ready to step, plus what K+1's first step takes
    beyond a step's own compute (one-time costs). A step's own compute is the shorter of K's last step and K+1's
    second: K+1's second runs beside the upload, which starts at its first step, and would hide those costs."""
    last = max(r["time"] for r in records_k if r["event"] == "step")
    ready = max(r["time"] for r in records_next if r["event"] == "ready")
    first, second = sorted(r["time"] for r in records_next if r["event"] == "step")[:2]
    before_last, last_k = sorted(r["time"] for r in records_k if r["event"] == "step")[-2:]
    step_s = min(last_k - before_last, second - first)
    return ready - last + max(0.0, (first - ready) - step_s)


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(fixed, per-unit) of the least-squares line through the points (one point: no fixed part)."""
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def medians(runs: list[dict]) -> dict:
    """The median of each figure over repetitions."""
    return {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}


# -- measurement (a real launch, a real store) --------------------------------------------------


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Timer:
    """Seconds spent inside the wrapped functions (patched for one side's boundary)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def wrapping(self, module, name: str, label: str) -> Iterator[None]:
        real = getattr(module, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started

        setattr(module, name, timed)
        try:
            yield
        finally:
            setattr(module, name, real)


def _planned(root: Path, overrides: dict, store_url: str):
    from tasks.plan import plan_run_fn
    from trainer_core.config import config_from_dict

    model = json.loads((EXAMPLES / "tiny" / "model_config.json").read_text()) | overrides
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_config.json").write_text(json.dumps(model))
    tree = {
        "run": {"name": "boundary", "seed": 1, "work_dir": str(root / "work")},
        "model": {"config": str(root / "model_config.json")},
        "tokenizer": {"path": str(EXAMPLES / "tiny" / "tokenizer.json")},
        "data": {"path": str(EXAMPLES / "tiny" / "sft.jsonl"), "max_seq_len": 64, "overflow": "truncate"},
        # Two steps per segment, two rows of 64 tokens: the boundary, not the steps, is what is measured; the
        # next segment's second step gives the step's own compute, which the boundary's first step holds too.
        "train": {
            "steps": 4,
            "steps_per_segment": 2,
            "global_batch_size": 2,
            "logical_dp": 1,
            "nproc_per_node": 1,
            "learning_rate": 1e-4,
            "segment_timeout_s": 1800,
            "stall_timeout_s": 1800,
        },
        "storage": {"url": store_url},
    }
    return plan_run_fn(config_from_dict(tree, config_dir=root))


def measure(root: Path, overrides: dict, store_url: str, side: str) -> dict:
    """One boundary (segment 0 → 1) on one side; returns its figures in seconds."""
    from infra.launch.warm_ranks import warm_ranks
    from infra.runs import run_state as infra_run_state
    from tasks import run_state, segment, upload_hold
    from tasks.state_upload import upload_state_fn
    from trainer_core.run import state_record
    from trainer_core.run.progress import progress_path
    from trainer_core.run.state import state_dir_for

    planned = _planned(root, overrides, store_url)
    run_dir = Path(planned.run_dir)
    quiet = {"on_line": lambda _line: None}
    timer = _Timer()
    with (
        warm_ranks() if side == "candidate" else contextlib.nullcontext(),
        timer.wrapping(segment, "fetch_segment_inputs", "verify_s"),
        timer.wrapping(infra_run_state, "_entries", "hash_s"),
        timer.wrapping(state_record.LocalState, "digests", "hash_s"),
    ):
        segment.train_segment_fn(planned, 0, **quiet)
        exited = time.time()
        if side == "baseline":
            state_record.record_path(state_dir_for(run_dir, 0)).unlink()  # as before records: hash everything
            started = time.perf_counter()
            run_state.publish_segment_state(planned, 0)
            upload_s = time.perf_counter() - started
            next_called = time.time()
            segment.train_segment_fn(planned, 1, **quiet)
        else:
            upload: dict = {}
            upload_hold.hold(run_dir, 0)  # as a run's flow does (`StateUploads.after`): segment 1 releases it
            uploader = threading.Thread(target=lambda: upload.update(upload_state_fn(planned, 0)))
            uploader.start()
            next_called = time.time()
            segment.train_segment_fn(planned, 1, **quiet)
            uploader.join()
            upload_s = upload["upload_s"]
    records_k, records_next = _records(progress_path(run_dir, 0)), _records(progress_path(run_dir, 1))
    event = {r["event"]: r for r in records_k} | {f"next_{r['event']}": r for r in records_next}
    next_steps = sorted(r["time"] for r in records_next if r["event"] == "step")
    first_step = next_steps[0]
    step_s = next_steps[1] - next_steps[0]
    figures = {
        "boundary_s": boundary_s(records_k, records_next),
        "idle_s": critical_path_s(records_k, records_next),
        "step_s": step_s,
        "save_s": event["saved"]["time"] - event["saving"]["time"],
        "exit_s": exited - event["saved"]["time"],
        "hash_s": timer.seconds.get("hash_s", 0.0),
        "upload_s": upload_s,
        "verify_s": timer.seconds.get("verify_s", 0.0),
        # From the next segment's task starting (its input check included) to its rank being ready.
        "launch_to_ready_s": event["next_ready"]["time"] - next_called,
        "load_setup_s": event["next_ready"]["setup_s"],
        "first_step_s": first_step - event["next_ready"]["time"],
    }
    shutil.rmtree(root, ignore_errors=True)
    return figures


def _print_size(gigabytes: float, sides: dict[str, dict]) -> None:
    print(f"state {gigabytes:.3f} GB:")
    for name, figures in sides.items():
        pieces = ", ".join(f"{key[:-2]} {value:.2f}" for key, value in figures.items() if key != "boundary_s")
        print(
            f"  {name:9s} boundary {figures['boundary_s']:.2f} s ({figures['boundary_s'] / gigabytes:.2f} s/GB): {pieces}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.boundary", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=list(SIZES_GB))
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per side and size")
    parser.add_argument("--quick", action="store_true", help="smoke run: 0.02 and 0.05 GB, 1 repetition")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes_gb, args.reps = [0.02, 0.05], 1
    if any(size <= 0 for size in args.sizes_gb) or args.reps < 1:
        parser.exit(2, "bench.boundary: --sizes-gb must be positive and --reps at least 1\n")
    from bench._segments import machine
    from bench._storage import BUCKET, seaweedfs

    results: dict[float, dict[str, dict]] = {}
    for size in args.sizes_gb:
        overrides = model_for(size)
        gigabytes = state_gb(overrides)
        runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
        for rep in range(args.reps):
            order = ("baseline", "candidate") if rep % 2 == 0 else ("candidate", "baseline")
            for side in order:
                # A fresh store each time, removed after: the uploads of earlier measurements would otherwise fill
                # the page cache, and on these machines memory then comes back slowly (up to 6 s/GB to touch).
                with seaweedfs() as (_server, tmp):
                    url = f"s3://{BUCKET}/{side}-{size}-{rep}"
                    runs[side].append(measure(tmp / f"{side}-{size}-{rep}", overrides, url, side))
                print(f"{size} GB rep {rep + 1}/{args.reps} {side}: {runs[side][-1]['boundary_s']:.2f} s", flush=True)
        results[gigabytes] = {side: medians(side_runs) for side, side_runs in runs.items()}
        _print_size(gigabytes, results[gigabytes])
    sizes = sorted(results)
    summary = {}
    for side in ("baseline", "candidate"):
        boundaries = [results[size][side]["boundary_s"] for size in sizes]
        fixed_s, per_gb = linear_fit(sizes, boundaries)
        idle_fixed_s, idle_per_gb = linear_fit(sizes, [results[size][side]["idle_s"] for size in sizes])
        summary[side] = {
            "name": "save, upload, then launch" if side == "baseline" else "launch beside the upload",
            "boundary_s": boundaries[-1],
            "s_per_gb": {f"{size:.3f}": round(results[size][side]["boundary_s"] / size, 3) for size in sizes},
            "fit_fixed_s": round(fixed_s, 3),
            "fit_s_per_gb": round(per_gb, 3),
            "idle_fit_fixed_s": round(idle_fixed_s, 3),
            "idle_fit_s_per_gb": round(idle_per_gb, 3),
            "pieces_at_largest": results[sizes[-1]][side],
        }
        print(
            f"{side}: boundary ≈ {fixed_s:.2f} s + {per_gb:.2f} s/GB; "
            f"less the step's compute ≈ {idle_fixed_s:.2f} s + {idle_per_gb:.2f} s/GB"
        )
    result = {
        "bench": "boundary",
        "baseline": summary["baseline"],
        "candidate": summary["candidate"],
        "ratio": round(summary["candidate"]["boundary_s"] / summary["baseline"]["boundary_s"], 4),
        "higher_is_better": False,
        "target": "ratio <= 0.5 at the largest size; critical_path_s_per_gb <= 1.0",
        "critical_path_s_per_gb": summary["candidate"]["idle_fit_s_per_gb"],
        "state_gb": [round(size, 3) for size in sizes],
        "reps": args.reps,
        "machine": machine(),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
