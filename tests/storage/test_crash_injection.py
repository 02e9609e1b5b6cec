"""The committing process SIGKILLed at every phase boundary of a commit, then at random moments, against the real
SeaweedFS.

More trials: `python -m tests.storage.crash_injection --trials 200 [--boundaries]` (see that module).
"""

from __future__ import annotations

import pytest

from tests.storage.crash_injection import run_trials

pytestmark = pytest.mark.s3

RANDOM_KILLS = 6
"""Random moments between the boundaries (inside a request, a write whose answer is lost); each boundary is killed
at exactly once before them, whatever the load."""


def test_a_kill_at_every_phase_and_at_random_never_shows_a_partial_checkpoint_and_always_recovers(
    s3_env, s3_bucket_url, tmp_path
):
    summary = run_trials(s3_bucket_url, tmp_path, num_trials=RANDOM_KILLS, seed=8, env=s3_env.env(), boundaries=True)
    print(summary.to_dict())
    assert summary.failures == []
    # Every event of a commit was killed at, in order: the go, the lease, each upload, the manifest, LATEST, the
    # journal's COMMITTED.
    phases = [event.partition(" ")[0] for event in summary.commit_events]
    assert phases[0] == "lease" and phases[-1] == "committed" and phases.count("uploaded") == 5, phases
    assert {"manifest", "manifest-written", "latest-read", "latest"} <= set(phases), phases
    assert [event.partition(" ")[0] for event in summary.killed_at] == ["go", *phases], summary.killed_at
    trials = len(summary.killed_at) + RANDOM_KILLS
    assert summary.trials == trials and summary.recovered == trials
    assert summary.visible_partial == 0 and summary.latest_moved_back == 0
    assert summary.bytes_reuploaded_complete == 0  # nothing complete is uploaded twice
    # The boundary kills all landed inside commits, and some after data had landed.
    assert summary.killed_mid_commit >= len(summary.killed_at) and summary.bytes_complete_before_retry > 0
    # Every staged byte was complete before the retry, uploaded by it, or landed late from the killed
    # committer's last request (a write applied whose answer was lost; the full verify above read it).
    assert summary.bytes_uploaded_on_retry == (
        summary.bytes_staged - summary.bytes_complete_before_retry - summary.bytes_landed_after_check
    )
