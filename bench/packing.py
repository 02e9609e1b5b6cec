"""Padding with packing vs padding each sequence to the longest, on the example data.

    python -m bench.packing [--seeds 5]

Both sides build the plans of `examples/tiny_sft.toml` and
`examples/tiny_rl.toml` in memory: the baseline lays out one conversation per row,
padded to the longest of its segment (rounded up to 8), the candidate packs
conversations into rows of `data.max_seq_len` by first fit. The figure is the
fraction of padding tokens in the shards (lower is better); the sides
alternate over several data-order seeds and the medians are reported. The last
line is the JSON summary: `ratio` is the SFT figure, `rl` holds the RL one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from trainer_core.config import load_config
from trainer_core.run.plan import build_plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _measure(config, pack: bool) -> dict[str, float]:
    started = time.perf_counter()
    config.data.pack = pack
    _, shards = build_plan(config)
    wall_s = time.perf_counter() - started
    total = real = loss = documents = 0
    for tensors in shards.values():
        attention = tensors["attention_mask"]
        total += attention.numel()
        real += int(attention.sum())
        loss += int(tensors["loss_mask"].sum())
        documents += int(tensors["document_ids"].amax(-1).sum()) if pack else attention.shape[0] * attention.shape[1]
    return {
        "pad_fraction": 1 - real / total,
        "tokens_per_step": real / config.train.steps,
        "documents_per_step": documents / config.train.steps,
        "loss_tokens_per_step": loss / config.train.steps,
        "plan_s": wall_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    datasets = {"sft": EXAMPLES / "tiny_sft.toml", "rl": EXAMPLES / "tiny_rl.toml"}
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {"baseline": [], "candidate": []} for name in datasets
    }
    for seed in range(args.seeds):
        for name, config_file in datasets.items():
            config = load_config(config_file, [f"run.seed={seed}"])
            results[name]["baseline"].append(_measure(config, pack=False))
            results[name]["candidate"].append(_measure(config, pack=True))

    def medians(runs: list[dict[str, float]]) -> dict[str, float]:
        return {key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]}

    summary = {name: {side: medians(runs) for side, runs in sides.items()} for name, sides in results.items()}
    for name, sides in summary.items():
        print(
            f"{name}: padding {sides['baseline']['pad_fraction']:.1%} padded to the longest -> "
            f"{sides['candidate']['pad_fraction']:.1%} packed; documents per step "
            f"{sides['baseline']['documents_per_step']:.0f} -> {sides['candidate']['documents_per_step']:.1f}"
        )
    print(
        json.dumps(
            {
                "bench": "packing",
                "baseline": summary["sft"]["baseline"],
                "candidate": summary["sft"]["candidate"],
                "ratio": round(
                    summary["sft"]["candidate"]["pad_fraction"] / summary["sft"]["baseline"]["pad_fraction"], 4
                ),
                "higher_is_better": False,
                "metric": "pad_fraction",
                "rl": {
                    **summary["rl"],
                    "ratio": round(
                        summary["rl"]["candidate"]["pad_fraction"] / summary["rl"]["baseline"]["pad_fraction"], 4
                    ),
                },
                "seeds": args.seeds,
            }
        )
    )


if __name__ == "__main__":
    main()
