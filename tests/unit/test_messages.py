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


def test_artifact_links_are_urls_that_lead_to_the_stored_files(tmp_path):
    """A local store's files are linked as file:// URLs (percent-encoded: the store's path has a space and a `#`)
    that resolve back to the very files; an S3 store's objects keep their s3:// URLs."""
    import re
    from urllib.parse import urlsplit
    from urllib.request import url2pathname

    from infra.launch.failures import Failure
    from infra.publication.commit import CommitOutcome
    from tasks.failure_report import failure_markdown
    from tasks.outcomes import PlannedRun
    from tasks.report import summary_markdown
    from trainer_core.config import StorageSection

    store = tmp_path / "my store #1"
    files = {name: store / "run" / name for name in ("ledger.jsonl", "loss_curve.png", "step-00000003")}
    for file in files.values():
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(b"\x89PNG")

    planned = PlannedRun(
        run_id="run", digest="d" * 64, run_dir=str(tmp_path), segment_steps=[(0, 3)], storage=StorageSection()
    )
    commit = CommitOutcome(str(files["step-00000003"]), 3, 1, 0, 4, True, 0.1)
    locations = {name: str(path) for name, path in files.items()}
    markdown = summary_markdown(planned, [commit], locations, files["loss_curve.png"])
    links = re.findall(r"\[([^\]]+)\]\(([^)]+)\)", markdown.split("![")[0])
    assert len(links) == 3
    for text, url in links:
        assert text == url and urlsplit(url).scheme == "file" and " " not in url
        assert url2pathname(urlsplit(url).path) in {str(path) for path in files.values()}

    on_s3 = {name: f"s3://bucket/runs/run/{name}" for name in ("ledger.jsonl", "loss_curve.png")}
    markdown = summary_markdown(planned, [], on_s3, files["loss_curve.png"])
    assert "[s3://bucket/runs/run/ledger.jsonl](s3://bucket/runs/run/ledger.jsonl)" in markdown

    log = files["ledger.jsonl"]
    failure = Failure("export", FailureClass.LAUNCH_TIMEOUT, None, "d", log_file=str(log))
    (url,) = re.findall(r"traceback:\*\* \[[^\]]+\]\(([^)]+)\)", failure_markdown("run", failure))
    assert url2pathname(urlsplit(url).path) == str(log)
