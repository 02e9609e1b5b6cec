"""Golden files for the data stages: fixture records in, each stage's output pinned.

`cases/NAME.jsonl` holds the records of one case (disjoint cases: single turn,
multi turn, tool calls, system prompt, truncation, per-message train flags, RL
with logprobs, several documents in one packed row, a tokenizer's own chat
template). `expected/NAME/STAGE.json` holds what each stage makes of them, in
a form a reviewer can read: the rendered text, every token with its text, the
masks as 0/1 strings, the aligned logprobs and advantages, the packed rows.

    python -m tests.golden.regenerate          # rewrite expected/, print the diff
    python -m tests.golden.regenerate --check  # print the diff only; exit 1 if any

Review the diff before committing it: a changed golden file means a changed
token, mask or alignment in training data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer_core.data import (
    DataOptions,
    align,
    fit_length,
    load_tokenizer,
    mask,
    pack,
    read_records,
    render,
    resolve_advantages,
    tokenize,
)
from trainer_core.data.shards import round_up, unpacked_steps

GOLDEN_DIR = Path(__file__).resolve().parent
CASES_DIR = GOLDEN_DIR / "cases"
EXPECTED_DIR = GOLDEN_DIR / "expected"
TOKENIZER = GOLDEN_DIR.parent.parent / "examples" / "tiny" / "tokenizer.json"
STAGES = ("render", "tokenize", "mask", "align", "pack")


@dataclass(frozen=True)
class Case:
    name: str
    options: DataOptions = DataOptions(max_seq_len=256)
    template_file: str | None = None
    num_rows: int | None = None
    """Packed cases: rows to pack into (None: one document per row, unpacked)."""


CASES = (
    Case("single_turn"),
    Case("multi_turn"),
    Case("system_prompt"),
    Case("tool_calls"),
    Case("train_flags"),
    Case("truncation", options=DataOptions(max_seq_len=24, overflow="truncate")),
    Case("rl_logprobs"),
    Case("packed", options=DataOptions(max_seq_len=48, pack=True), num_rows=2),
    Case("chat_template", template_file="chat_template.jinja"),
)


def _floats(values: np.ndarray) -> list[float]:
    # str(float32) is the shortest text that reads back to the same float32.
    return [float(str(v)) for v in values.astype(np.float32)]


def _bits(values: np.ndarray) -> str:
    return "".join("1" if v else "0" for v in values)


def _where(where: str) -> str:
    return where.rsplit("/", 1)[-1]


def stage_outputs(case: Case) -> dict[str, object]:
    """Run every stage over a case's records; the JSON-ready value of each stage."""
    tokenizer = load_tokenizer(TOKENIZER)
    template = (CASES_DIR / case.template_file).read_text() if case.template_file else None
    records = read_records(CASES_DIR / f"{case.name}.jsonl")
    conversations = [r.conversation for r in records]
    wheres = [_where(r.where) for r in records]
    rendered = [render(c, template, where=w) for c, w in zip(conversations, wheres)]
    tokenized = tokenize(tokenizer, rendered)
    masked = [mask(t, r) for t, r in zip(tokenized, rendered)]
    is_rl = conversations[0].is_trajectory
    advantages = (
        resolve_advantages(conversations, wheres, case.options.advantage_normalization)[0]
        if is_rl
        else [None] * len(records)
    )
    aligned = [align(m, c, a, where=w) for m, c, a, w in zip(masked, conversations, advantages, wheres)]

    out: dict[str, object] = {}
    out["render"] = [
        {
            "where": w,
            "text": r.text,
            "loss_spans": [list(s) for s in r.loss_spans],
            "span_messages": list(r.span_messages),
            "loss_text": [r.text[s:e] for s, e in r.loss_spans],
            "digest": r.digest(),
        }
        for w, r in zip(wheres, rendered)
    ]
    out["tokenize"] = [
        {
            "where": w,
            "input_ids": t.input_ids.tolist(),
            "tokens": [r.text[s:e] for s, e in t.offsets.tolist()],
            "offsets": t.offsets.tolist(),
            "digest": t.digest(),
        }
        for w, t, r in zip(wheres, tokenized, rendered)
    ]
    out["mask"] = [
        {
            "where": w,
            "loss_mask": _bits(m.loss_mask),
            "message_index": m.message_index.tolist(),
            "loss_tokens_by_message": {
                str(i): "".join(r.text[s:e] for (s, e), k in zip(t.offsets.tolist(), m.message_index) if k == i)
                for i in sorted(set(m.message_index.tolist()) - {-1})
            },
            "digest": m.digest(),
        }
        for w, m, t, r in zip(wheres, masked, tokenized, rendered)
    ]
    out["align"] = [
        {
            "where": w,
            "rl": a.advantages is not None,
            **(
                {
                    "policy_version": a.policy_version,
                    "behaviour_logprobs": _floats(a.behaviour_logprobs[a.loss_mask]),
                    "advantages": _floats(a.advantages[a.loss_mask]),
                }
                if a.advantages is not None
                else {}
            ),
            "digest": a.digest(),
        }
        for w, a in zip(wheres, aligned)
    ]
    documents, kept, truncated, dropped = fit_length(aligned, wheres, case.options.max_seq_len, case.options.overflow)
    if case.num_rows is None:
        (rows,) = unpacked_steps(documents, np.arange(len(documents))[None], pad_id=0)
    else:
        rows, used = pack(documents, case.num_rows, round_up(case.options.max_seq_len), pad_id=0)
        kept = kept[:used]
    arrays = rows.arrays()
    out["pack"] = {
        "fit": {
            "max_seq_len": case.options.max_seq_len,
            "overflow": case.options.overflow,
            "kept": kept,
            "num_truncated": truncated,
            "num_dropped": dropped,
        },
        "rows": [
            {
                "documents": [kept[i] for i in rows.documents[r]],
                **{
                    name: (
                        _bits(values[r])
                        if values.dtype == bool
                        else _floats(values[r])
                        if values.dtype.kind == "f"
                        else values[r].tolist()
                    )
                    for name, values in arrays.items()
                },
            }
            for r in range(len(rows.documents))
        ],
        "digest": rows.digest(),
    }
    return out


def _format(value: object, indent: int = 0) -> str:
    """JSON with one line per list of scalars (a token sequence reads as one line)."""
    pad = "  " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{pad}  {json.dumps(k)}: {_format(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if (
        isinstance(value, list)
        and any(isinstance(v, (dict, list)) for v in value)
        and not all(
            isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v) and len(v) <= 2 for v in value
        )
    ):
        items = [f"{pad}  {_format(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value, ensure_ascii=False)


def expected_path(case: Case, stage: str) -> Path:
    return EXPECTED_DIR / case.name / f"{stage}.json"


def rendered_files(case: Case) -> dict[str, str]:
    """The text each golden file of `case` should hold."""
    outputs = stage_outputs(case)
    return {stage: _format(outputs[stage]) + "\n" for stage in STAGES}
