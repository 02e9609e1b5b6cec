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
