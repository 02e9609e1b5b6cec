"""Bad-input cases: held-out data (`data.eval_path`, `data.eval_fraction`) and `train.eval_every`.

The held-out files go through every check `data.path` does: a message names the file and line, or `data.eval_path`
for a file that is missing or of the wrong kind."""

from __future__ import annotations

from pathlib import Path

from .common import GOOD_SFT, Case

RL_RECORD = (Path(__file__).resolve().parents[3] / "examples" / "tiny" / "rl.jsonl").read_text().splitlines()[0] + "\n"
FIX_EVAL_FILES = r"point (it|data\.eval_path) at a JSONL file, or at Parquet or Arrow files"


def _with_eval(eval_text: str, **data) -> dict:
    return {
        "files": {"train.jsonl": GOOD_SFT * 4, "eval.jsonl": eval_text},
        "config": {"data": {"path": "{dir}/train.jsonl", "eval_path": "{dir}/eval.jsonl", **data}},
    }


CASES: list[Case] = [
    Case(
        "eval_path_missing",
        "data-file",
        r"data\.eval_path='{dir}/held_out\.jsonl' does not exist",
        FIX_EVAL_FILES,
        files={"train.jsonl": GOOD_SFT},
        config={"data": {"path": "{dir}/train.jsonl", "eval_path": "held_out.jsonl"}},
    ),
    Case(
        "eval_path_bad_record",
        "data-record",
        r"{dir}/eval\.jsonl:2: field messages",
        r"",
        **_with_eval(GOOD_SFT + '{"messages": []}\n'),
    ),
    Case(
        "eval_path_empty_file",
        "data-file",
        r"{dir}/eval\.jsonl: no conversations found",
        r"add records to it, or leave it out of data\.eval_path",
        **_with_eval(""),
    ),
    Case(
        "eval_path_of_another_kind",
        "data-record",
        r"{dir}/eval\.jsonl: data\.eval_path holds RL trajectories, and the run trains data\.kind='sft'",
        r"hold out data of the kind the run trains on",
        **_with_eval(RL_RECORD),
    ),
    Case(
        "eval_path_and_fraction",
        "config-value",
        r"data\.eval_path and data\.eval_fraction=0\.1 both say what to evaluate",
        r"keep eval_path \(held-out files\) or eval_fraction",
        **_with_eval(GOOD_SFT, eval_fraction=0.1),
    ),
    Case(
        "eval_fraction_one",
        "config-value",
        r"data\.eval_fraction",
        r"set a value < 1",
        config={"data": {"eval_fraction": 1.0}},
    ),
    Case(
        "eval_fraction_leaves_nothing_to_train",
        "data-record",
        r"{dir}/data\.jsonl: data\.eval_fraction=0\.9 of 2 conversation\(s\) leaves none to train on",
        r"lower eval_fraction, add conversations, or hold out files of their own with data\.eval_path",
        files={"data.jsonl": GOOD_SFT * 2},
        config={"data": {"path": "{dir}/data.jsonl", "eval_fraction": 0.9}},
    ),
    Case(
        "eval_every_without_held_out_data",
        "config-value",
        r"train\.eval_every=5 but there is nothing to evaluate",
        r"set data\.eval_path \(held-out files\) or data\.eval_fraction",
        config={"train": {"eval_every": 5}},
    ),
]
