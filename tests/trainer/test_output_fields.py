"""Output names are written once (`training/outputs.py`); every table derived from it says what the old ones did."""

import pytest
import torch

from trainer_core.training.graphs import ManagedOutputs
from trainer_core.training.outputs import (
    FIELD_OF,
    FIELDS,
    HEAD_PREFIX,
    IMPORTANCE_WEIGHTED,
    OUTPUT_KINDS,
    RECORDED,
    is_leaf_field,
)


def test_the_derived_tables_are_the_ones_each_module_wrote_before():
    # The copies that lived in trainer.py, ranks/commands.py, memory/replay.py and outputs.py before issue 15.
    assert {k: f for k, f in FIELD_OF.items() if k != "topk_ids"} == {
        "logprobs": "logprobs",
        "topk": "topk_logprobs",
        "logits": "logits",
        "hidden": "hidden_states",
    }
    assert FIELDS == ("logprobs", "topk_logprobs", "topk_ids", "logits", "hidden_states")
    assert IMPORTANCE_WEIGHTED == {"logprobs", "topk"}
    assert RECORDED == ("logprobs", "topk", "topk_ids")
    assert OUTPUT_KINDS == ("logprobs", "topk", "logits", "hidden", "heads")
    assert HEAD_PREFIX == "head:"
    assert [f for f in FIELDS if not is_leaf_field(f)] == ["topk_ids"]
    assert is_leaf_field(HEAD_PREFIX + "value")


def test_managed_outputs_by_field_name_round_trip():
    out = ManagedOutputs(graph_id=None, versions={})
    values = {name: torch.full((1,), float(i)) for i, name in enumerate([*FIELDS, HEAD_PREFIX + "value"])}
    for name, value in values.items():
        out.set_field(name, value)
    assert out.heads == {"value": values[HEAD_PREFIX + "value"]} and out.topk_logprobs is values["topk_logprobs"]
    assert list(out.fields()) == list(values)
    assert all(out.get_field(name) is value for name, value in values.items())
    with pytest.raises(KeyError, match="unknown output field 'topk'"):
        out.set_field("topk", values["logprobs"])  # a kind, not a field
