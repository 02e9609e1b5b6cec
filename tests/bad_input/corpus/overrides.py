"""Bad-input cases: --set overrides."""

from __future__ import annotations

from .common import Case, set_case

CASES: list[Case] = [
    set_case(
        "set_unknown_key", "train.stepz=3", r": train\.stepz \(from --set\): unknown key", r"did you mean 'steps'\?"
    ),
    set_case(
        "set_bad_value",
        "train.steps=abc",
        r": train\.steps \(from --set\): must be a whole number \(got 'abc'\)",
        r"write a whole number",
    ),
    set_case(
        "set_lease_wait_negative",
        "run.lease_wait_s=-5",
        r": run\.lease_wait_s \(from --set\): must be >= 0 \(got -5\)",
        r"set a value >= 0",
    ),
    set_case(
        "set_inf",
        "train.learning_rate=inf",
        r": train\.learning_rate \(from --set\): must be a finite number",
        r"set a finite value",
    ),
    set_case(
        "set_without_equals",
        "train.steps",
        r"--set 'train\.steps': expected dotted\.key=value",
        r"e\.g\. --set train\.steps=10",
    ),
    set_case(
        "set_into_a_value",
        "train.steps.x=1",
        r"--set train\.steps\.x=1: 'steps' is a value, not a section",
        r"set train\.steps itself",
    ),
    set_case(
        "set_empty_key_segment",
        "train..steps=1",
        r"--set train\.\.steps=1: empty key segment",
        r"write it as section\.key=value",
    ),
    set_case(
        "set_section_to_a_value",
        "train=5",
        r": train \(from --set\): must be a table of keys \(got 5\)",
        r"write it as a \[train\] section",
    ),
    set_case("set_unknown_section", "trian.steps=3", r": trian \(from --set\): unknown key", r"did you mean 'train'\?"),
]
