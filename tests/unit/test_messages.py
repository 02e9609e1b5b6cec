"""What a new user reads (issue 31, item 14): each message names the key, variable or field the user wrote, and
the fix, on one line where one will do. The references are the sources themselves: the config key that sets a
limit, the environment variable botocore would read, the field name in the user's own file."""

from __future__ import annotations

from infra.launch.failures import FailureClass, diagnose_launch
from infra.launch.launcher import LaunchResult
from tasks.nodes.failure import failure_from_message


def _timed_out() -> LaunchResult:
    return LaunchResult(returncode=-9, wall_s=2.0, timed_out=True, tail=("t",))


def test_a_launch_timeout_names_its_config_key_and_how_to_raise_it():
    export = diagnose_launch(_timed_out(), "export", 1.5)
    assert export.cause is FailureClass.LAUNCH_TIMEOUT and export.rank is None
    headline = export.headline()
    assert headline.startswith("export failed: launch_timeout (the launch ran past export.timeout_s = 1.5 s")
    assert "--set export.timeout_s=SECONDS" in headline and "no single rank" not in headline
    segment = diagnose_launch(_timed_out(), "segment", 600).headline()
    assert "train.segment_timeout_s = 600 s" in segment and "--set train.segment_timeout_s=SECONDS" in segment
    # A deployed node's diagnosis travels as its state message and is read back from the headline.
    read_back = failure_from_message(f"LaunchError: {headline}\nmore", stage="export")
    assert read_back is not None and (read_back.cause, read_back.rank, read_back.detail) == (
        export.cause,
        None,
        export.detail,
    )


def test_a_later_stages_error_names_the_field_as_a_sharegpt_or_pair_file_spells_it(tmp_path):
    """Rendering, lengths and positions see the messages format; their errors are respelled by the record's own
    format: ShareGPT's `conversations` (turn I after a top-level system is message I + 1), a pair's fields."""
    import json

    import pytest

    from trainer_core.data import DataError
    from trainer_core.data.records import open_source

    shared = tmp_path / "chat.jsonl"
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    shared.write_text(
        json.dumps({"conversations": turns}) + "\n" + json.dumps({"conversations": turns, "system": "be brief"}) + "\n"
    )
    source = open_source(str(shared))

    def raised(message: str) -> str:
        with pytest.raises(DataError) as caught, source.fields_as_written():
            raise DataError(message)
        return str(caught.value)

    assert raised(f"{shared}:1: field messages: 40 tokens, over data.max_seq_len=16; raise it") == (
        f"{shared}:1: field conversations: 40 tokens, over data.max_seq_len=16; raise it"
    )
    assert raised(f"{shared}:1: field messages.1.content: x").startswith(f"{shared}:1: field conversations.1.value: x")
    assert raised(f"{shared}:2: field messages.2.content: x").startswith(f"{shared}:2: field conversations.1.value: x")
    assert raised(f"{shared}:2: field messages.0: x").startswith(f"{shared}:2: field system: x")
    assert raised(f"{shared}:2: field reward: x") == f"{shared}:2: field reward: x"  # not a message's field

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "hi", "completion": "hello", "system": "s"}) + "\n")
    source = open_source(str(pairs))
    assert raised(f"{pairs}:1: field messages.2: x") == f"{pairs}:1: field completion: x"
    assert raised(f"{pairs}:1: field messages: x") == f"{pairs}:1: field prompt/completion: x"

    messages = tmp_path / "messages.jsonl"
    messages.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    source = open_source(str(messages))
    assert raised(f"{messages}:1: field messages.0: x") == f"{messages}:1: field messages.0: x"
