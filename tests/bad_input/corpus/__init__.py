"""The corpus of bad input: one case per kind a user can give, with what the message must say.

Each case is a small file set over the shipped tiny example (see tests/bad_input/harness.py)
and two regexes: what the message must name (the file and line, or the config
key) and the fix it must give. `tests/bad_input/test_corpus.py` runs the real
CLI on every case and asserts exit 2, one message, no traceback and nothing
written. One module per kind of input; add a case to its module whenever a new kind of bad input is found.
"""

from __future__ import annotations

from . import (
    config_file,
    data_file,
    data_formats,
    device_memory,
    held_out,
    model_config,
    model_path,
    overrides,
    plan_size,
    records,
    serve,
    sharding,
    storage,
    tokenizer,
)
from .common import GOOD_SFT

__all__ = ["BY_NAME", "CASES", "GOOD_SFT"]

CASES = [
    *config_file.CASES,
    *storage.CASES,
    *overrides.CASES,
    *model_config.CASES,
    *model_path.CASES,
    *tokenizer.CASES,
    *data_file.CASES,
    *data_formats.CASES,
    *held_out.CASES,
    *plan_size.CASES,
    *device_memory.CASES,
    *sharding.CASES,
    *serve.CASES,
    *records.CASES,
]
BY_NAME = {case.name: case for case in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"
