"""The plan's peak memory as the data grows: 10× and 100× the example data, streamed and in memory.

    python -m bench.plan_scale [--repeats 3] [--scales 10 100] [--quick]

The data is the example SFT file (examples/tiny/sft.jsonl, 1,200
conversations) repeated K times: synthetic, with exactly its length
distribution. The config is `examples/tiny_sft.toml` with `train.steps` scaled
by K too (the same fraction of an epoch, 20 steps a segment), so the shards grow
with the data as a real run's would. Each plan runs in a fresh process (a fresh
`run.work_dir`, so nothing comes from the stage cache), which reports its own
peak resident memory (`ru_maxrss`) and its wall time from loading the config
to the last shard written (after the imports, which both sides share): the streamed plan (`build_plan` + `write_plan`) and,
interleaved with it, the plan as it was (bench/_plan_in_memory.py: every
record, token and shard in memory). Figures are medians over the repeats.

The last line is the JSON summary: `baseline` is the streamed plan at the
smaller scale, `candidate` the streamed plan at the larger, and `ratio` their
peak memory (target ≤ 1.5: the peak does not grow with the data);
`in_memory` holds the old plan's figures at both scales, side by side. Each
side's `marginal_conversations_per_s` is the rate the larger scale adds over
the smaller (the data's throughput, without the fixed model checks).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SIDES = ("streamed", "in_memory")
TARGET_RATIO = 1.5


def synthesize(source: Path, scale: int, target: Path) -> int:
    """`source`'s records repeated `scale` times into `target`; returns the number of conversations."""
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    with open(target, "w", encoding="utf-8") as handle:
        for _ in range(scale):
            handle.write("\n".join(lines) + "\n")
    return scale * len(lines)


def overrides(data: Path, scale: int, work: Path) -> list[str]:
    """The `--set` overrides of `examples/tiny_sft.toml` for one plan at `scale` (steps grow with the data)."""
    return [
        f"data.path={data}",
        f"train.steps={60 * scale}",
        "train.steps_per_segment=20",
        f"run.work_dir={work / 'work'}",
        f"storage.url={work / 'store'}",
    ]


def _plan_once(side: str, settings: list[str]) -> dict:
    """In the child: plan once and measure it (this process's peak memory is the plan's)."""
    # Both sides import the same libraries (the model check needs transformers): timed from after the imports.
    import transformers  # noqa: F401

    from bench._plan_in_memory import plan_in_memory, write_in_memory
    from trainer_core.config import load_config
    from trainer_core.run.plan import build_plan, run_dir_for, write_plan

    started = time.perf_counter()
    config = load_config(EXAMPLES / "tiny_sft.toml", settings)
    config.data.eval_path, config.train.eval_every = None, 0  # the in-memory plan predates held-out data
    if side == "streamed":
        plan, shards = build_plan(config)
        write_plan(plan, shards, run_dir_for(config, plan.run_id))
        run_id, conversations = plan.run_id, plan.num_conversations
    else:
        old = plan_in_memory(config)
        write_in_memory(old, Path(config.run.work_dir) / old.run_id / "plan")
        run_id, conversations = old.run_id, old.num_conversations
    wall_s = time.perf_counter() - started
    return {
        "run_id": run_id,
        "conversations": conversations,
        "wall_s": wall_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }


def _run_child(side: str, settings: list[str]) -> dict:
    command = [sys.executable, "-m", "bench.plan_scale", "--child", side, *settings]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side} plan failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, dict[int, list[dict]]], scales: list[int]) -> dict:
    """Medians per side and scale, and the JSON summary (see the module docstring)."""
    small, large = scales[0], scales[-1]

    def figures(side: str, scale: int) -> dict:
        measured = runs[side][scale]
        wall_s = statistics.median(m["wall_s"] for m in measured)
        return {
            "scale": scale,
            "conversations": measured[0]["conversations"],
            "peak_rss_mib": round(statistics.median(m["peak_rss_mib"] for m in measured), 1),
            "conversations_per_s": round(measured[0]["conversations"] / wall_s, 1),
            "wall_s": round(wall_s, 2),
            "runs_peak_rss_mib": [round(m["peak_rss_mib"], 1) for m in measured],
        }

    def marginal(side: str) -> float:
        """Conversations a second the larger scale adds over the smaller: the data's rate, without fixed costs."""
        low, high = figures(side, small), figures(side, large)
        return round((high["conversations"] - low["conversations"]) / max(high["wall_s"] - low["wall_s"], 1e-9), 1)

    baseline, candidate = figures("streamed", small), figures("streamed", large)
    candidate["marginal_conversations_per_s"] = marginal("streamed")
    in_memory = {str(scale): figures("in_memory", scale) for scale in (small, large) if runs["in_memory"].get(scale)}
    ratio = round(candidate["peak_rss_mib"] / baseline["peak_rss_mib"], 3)
    summary = {
        "bench": "plan_scale",
        "baseline": baseline,
        "candidate": candidate,
        "ratio": ratio,
        "higher_is_better": False,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "in_memory": in_memory,
        "same_run_ids": all(
            runs["streamed"][s][0]["run_id"] == runs["in_memory"][s][0]["run_id"]
            for s in scales
            if runs["in_memory"][s]
        ),
    }
    if len(in_memory) == 2:
        in_memory[str(large)]["marginal_conversations_per_s"] = marginal("in_memory")
        summary["in_memory_ratio"] = round(
            in_memory[str(large)]["peak_rss_mib"] / in_memory[str(small)]["peak_rss_mib"], 3
        )
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scales", type=int, nargs=2, default=[10, 100], metavar=("SMALL", "LARGE"))
    parser.add_argument("--quick", action="store_true", help="1× and 3× the data, one repeat")
    parser.add_argument("--no-in-memory", action="store_true", help="leave out the old plan (it holds everything)")
    args = parser.parse_args(argv)
    scales = [1, 3] if args.quick else sorted(args.scales)
    repeats = 1 if args.quick else args.repeats
    sides = ("streamed",) if args.no_in_memory else SIDES
    runs: dict[str, dict[int, list[dict]]] = {side: {scale: [] for scale in scales} for side in SIDES}
    root = Path(tempfile.mkdtemp(prefix="plan-scale-"))
    try:
        data = {scale: root / f"sft-{scale}x.jsonl" for scale in scales}
        for scale, path in data.items():
            synthesize(EXAMPLES / "tiny" / "sft.jsonl", scale, path)
        for repeat in range(repeats):
            for scale in scales:
                for side in sides:
                    work = root / f"{side}-{scale}x-{repeat}"
                    measured = _run_child(side, overrides(data[scale], scale, work))
                    runs[side][scale].append(measured)
                    shutil.rmtree(work, ignore_errors=True)
                    print(
                        f"{side:9s} {scale:>4d}x: peak {measured['peak_rss_mib']:8.1f} MiB, "
                        f"{measured['conversations'] / measured['wall_s']:9.1f} conversations/s "
                        f"({measured['wall_s']:.1f} s)",
                        flush=True,
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarize(runs, scales)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(_plan_once(sys.argv[2], sys.argv[3:])))
    else:
        main()
