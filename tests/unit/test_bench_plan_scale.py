"""`python -m bench.plan_scale`'s pure parts: the synthetic data keeps the example's lengths, the overrides scale
the steps with it, and the summary's ratio is the larger scale's median peak over the smaller's."""

from __future__ import annotations

from bench import plan_scale
from tests.conftest import EXAMPLES
from trainer_core.config import load_config


def test_the_synthetic_data_is_the_example_repeated(tmp_path):
    source = EXAMPLES / "tiny" / "sft.jsonl"
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    target = tmp_path / "sft-3x.jsonl"
    assert plan_scale.synthesize(source, 3, target) == 3 * len(lines)
    assert target.read_text().splitlines() == lines * 3


def test_the_overrides_scale_the_steps_and_isolate_the_work_dir(tmp_path):
    (tmp_path / "d.jsonl").write_text((EXAMPLES / "tiny" / "sft.jsonl").read_text())
    config = load_config(EXAMPLES / "tiny_sft.toml", plan_scale.overrides(tmp_path / "d.jsonl", 10, tmp_path / "w"))
    assert (config.train.steps, config.train.steps_per_segment) == (600, 20)
    assert config.run.work_dir == str(tmp_path / "w" / "work") and config.data.path == str(tmp_path / "d.jsonl")


def _run(peak, wall, conversations, run_id="r"):
    return {"peak_rss_mib": peak, "wall_s": wall, "conversations": conversations, "run_id": run_id}


def test_the_summary_is_medians_and_the_peak_ratio():
    runs = {
        "streamed": {10: [_run(400, 10, 1000), _run(500, 12, 1000), _run(420, 11, 1000)], 100: [_run(430, 101, 10000)]},
        "in_memory": {10: [_run(600, 9, 1000)], 100: [_run(1800, 90, 10000)]},
    }
    summary = plan_scale.summarize(runs, [10, 100])
    assert summary["baseline"]["peak_rss_mib"] == 420 and summary["candidate"]["peak_rss_mib"] == 430
    assert summary["ratio"] == round(430 / 420, 3) and summary["meets_target"] and not summary["higher_is_better"]
    assert summary["baseline"]["conversations_per_s"] == round(1000 / 11, 1)
    assert summary["candidate"]["marginal_conversations_per_s"] == round(9000 / 90, 1)
    assert summary["in_memory_ratio"] == 3.0 and summary["same_run_ids"]
