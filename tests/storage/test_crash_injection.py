"""The committing process SIGKILLed at random points, 40 times, against the real SeaweedFS.

More trials: `python -m tests.storage.crash_injection --trials 200` (see that module).
"""

from __future__ import annotations

import pytest

from tests.storage.crash_injection import run_trials

pytestmark = pytest.mark.s3


def test_forty_random_kills_never_show_a_partial_checkpoint_and_always_recover(s3_env, s3_bucket_url, tmp_path):
    summary = run_trials(s3_bucket_url, tmp_path, num_trials=40, seed=8, env=s3_env.env())
    print(summary.to_dict())
    assert summary.failures == []
    assert summary.trials == 40 and summary.recovered == 40
    assert summary.visible_partial == 0 and summary.latest_moved_back == 0
    assert summary.bytes_reuploaded_complete == 0  # nothing complete is uploaded twice
    # The kills really landed inside commits, and some after data had landed.
    assert summary.killed_mid_commit >= 15 and summary.bytes_complete_before_retry > 0
    # Every staged byte was complete before the retry, uploaded by it, or landed late from the killed
    # committer's last request (a write applied whose answer was lost; the full verify above read it).
    assert summary.bytes_uploaded_on_retry == (
        summary.bytes_staged - summary.bytes_complete_before_retry - summary.bytes_landed_after_check
    )
