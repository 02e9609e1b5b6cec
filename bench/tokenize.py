"""The staged data pipeline vs `apply_chat_template`, one conversation at a time.

    python -m bench.tokenize [--repeats 5]

Both sides tokenize the example SFT data (examples/tiny/sft.jsonl) with the
example tokenizer and the ChatML template. The baseline is what a training
script does without the pipeline: a `PreTrainedTokenizerFast` with
`CHATML_TEMPLATE`, `apply_chat_template(messages, tokenize=True)` per
conversation (token ids only: it does not even produce the loss mask). The
candidate is `prepare`: render → tokenize (one batch) → mask → align →
length limit, with every stage's digest. Throughput in conversations per
second; the sides alternate, and the figures are medians of the repeats. The
last line is the JSON summary; the token ids of both sides are checked equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from trainer_core.data import CHATML_TEMPLATE, DataOptions, load_tokenizer, prepare, read_records

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    records = read_records(EXAMPLE / "sft.jsonl")
    messages = [r.conversation.template_messages() for r in records]
    tokenizer = load_tokenizer(EXAMPLE / "tokenizer.json")
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(EXAMPLE / "tokenizer.json"))
    hf_tokenizer.chat_template = CHATML_TEMPLATE
    options = DataOptions(max_seq_len=512)

    def baseline() -> list[list[int]]:
        return [hf_tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"] for m in messages]

    def candidate() -> list[list[int]]:
        return [d.input_ids.tolist() for d in prepare(records, tokenizer, None, options).documents]

    same = baseline() == candidate()  # warm-up, and the check that both make the same tokens
    num_tokens = sum(len(ids) for ids in candidate())
    times: dict[str, list[float]] = {"baseline": [], "candidate": []}
    for _ in range(args.repeats):
        for name, run in (("baseline", baseline), ("candidate", candidate)):
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    summary = {}
    for name, values in times.items():
        median_s = statistics.median(values)
        summary[name] = {
            "conversations_per_s": round(len(records) / median_s, 1),
            "tokens_per_s": round(num_tokens / median_s, 1),
            "median_s": round(median_s, 5),
            "runs_s": [round(v, 5) for v in values],
        }
        print(f"{name:9s}: {summary[name]['conversations_per_s']:>10.1f} conversations/s  (median of {len(values)})")
    print(
        json.dumps(
            {
                "bench": "tokenize",
                "baseline": summary["baseline"],
                "candidate": summary["candidate"],
                "ratio": round(
                    summary["candidate"]["conversations_per_s"] / summary["baseline"]["conversations_per_s"], 3
                ),
                "higher_is_better": True,
                "target_ratio": 1.0,
                "num_conversations": len(records),
                "num_tokens": num_tokens,
                "identical_token_ids": same,
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
