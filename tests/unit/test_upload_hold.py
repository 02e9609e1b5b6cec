"""Holding a state upload until the next segment's first step: released by that step, by the segment task's end
(however it ends), by the flow; a hold never released lapses."""

from __future__ import annotations

import threading

import pytest

from tasks import state_upload, upload_hold
from tests.unit.test_state_record import planned  # noqa: F401 - the fixture

JOIN_S = 300.0
"""How long a released waiter may take to end on a loaded machine: it ends at once on a quiet one."""


def _waiting(run_dir, segment_index, limit_s=upload_hold.HOLD_LIMIT_S):
    out: dict = {}
    thread = threading.Thread(
        target=lambda: out.update(waited=upload_hold.wait_for_release(run_dir, segment_index, limit_s))
    )
    thread.start()
    return thread, out


def test_a_held_upload_waits_for_the_next_segment_s_first_step_not_its_ready(tmp_path):
    upload_hold.hold(tmp_path, 0)
    thread, out = _waiting(tmp_path, 0)
    release = upload_hold.ReleaseAtFirstStep(tmp_path, 0)
    release([{"event": "ready"}])
    release([])
    thread.join(0.3)
    assert thread.is_alive()  # ready is not enough: the first step is where the state has been read
    release([{"event": "step", "step": 3}])
    thread.join(JOIN_S)
    assert not thread.is_alive() and out["waited"] >= 0.3


def test_an_upload_not_held_does_not_wait(tmp_path):
    assert upload_hold.wait_for_release(tmp_path, 0) == 0.0
    upload_hold.hold(tmp_path, 1)
    assert upload_hold.wait_for_release(tmp_path, 0) == 0.0  # another segment's hold
    upload_hold.release(tmp_path, 1)
    assert upload_hold.wait_for_release(tmp_path, 1) == 0.0


def test_a_hold_never_released_lapses_and_is_gone(tmp_path):
    upload_hold.hold(tmp_path, 0)
    waited_s = upload_hold.wait_for_release(tmp_path, 0, limit_s=0.3)
    assert 0.3 <= waited_s < upload_hold.HOLD_LIMIT_S  # it lapsed at its own limit, not the default's 600 s
    assert upload_hold.wait_for_release(tmp_path, 0) == 0.0


def test_release_all_lets_go_of_one_run_s_holds_only(tmp_path):
    one, other = tmp_path / "one", tmp_path / "other"
    upload_hold.hold(one, 0)
    upload_hold.hold(one, 1)
    upload_hold.hold(other, 0)
    upload_hold.release_all(one)
    assert upload_hold.wait_for_release(one, 0) == 0.0 and upload_hold.wait_for_release(one, 1) == 0.0
    assert upload_hold.wait_for_release(other, 0, limit_s=0.2) >= 0.2


def test_a_hold_taken_again_keeps_its_waiter_and_a_lapse_leaves_a_newer_hold_alone(tmp_path):
    upload_hold.hold(tmp_path, 0)
    thread, out = _waiting(tmp_path, 0)
    upload_hold.hold(tmp_path, 0)  # a retried submission: the same hold
    upload_hold.release(tmp_path, 0)
    thread.join(JOIN_S)
    assert not thread.is_alive()
    upload_hold.hold(tmp_path, 1)
    lapsing, _ = _waiting(tmp_path, 1, limit_s=0.2)
    lapsing.join(JOIN_S)
    upload_hold.hold(tmp_path, 1)  # after the lapse: a new hold, which the lapse must not have taken
    assert upload_hold.wait_for_release(tmp_path, 1, limit_s=0.2) >= 0.2


def test_a_run_directory_named_through_a_link_is_the_same_run(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    upload_hold.hold(tmp_path / "link", 0)
    upload_hold.release(tmp_path / "run", 0)
    assert upload_hold.wait_for_release(tmp_path / "link", 0) == 0.0


class _Future:
    def result(self):
        return {}

    @property
    def state(self):
        class _State:
            def is_failed(self):
                return False

            def is_crashed(self):
                return False

        return _State()


class _Submitted:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def submit(self, planned_run, segment_index, wait_for=None):
        self.calls.append(segment_index)
        return _Future()


def test_the_flow_holds_each_upload_a_segment_follows_and_lets_go_when_it_waits_or_leaves(planned, monkeypatch):  # noqa: F811
    monkeypatch.setattr(state_upload, "upload_state", _Submitted())
    assert planned.num_segments >= 2
    last = planned.num_segments - 1
    with state_upload.StateUploads(planned) as uploads:
        uploads.after(0)
        assert upload_hold.wait_for_release(planned.run_dir, 0, limit_s=0.2) >= 0.2  # held, and lapsed by this wait
        uploads.after(0)
        uploads.wait()  # a checkpoint to publish: nothing is held any more
        assert upload_hold.wait_for_release(planned.run_dir, 0) == 0.0
        uploads.after(last)  # no segment follows the last: never held
        assert upload_hold.wait_for_release(planned.run_dir, last) == 0.0
        uploads.after(0)
    assert upload_hold.wait_for_release(planned.run_dir, 0) == 0.0  # the flow left: let go


class _Stop(Exception):
    pass


def _saved_result():
    from tests.unit.test_state_record import RESULT

    return RESULT.model_copy(update={"segment": 1, "start_step": 3, "end_step": 6})


@pytest.mark.parametrize("ends", ["fails", "reused"])
def test_the_next_segment_s_task_lets_the_upload_go_however_it_ends(planned, monkeypatch, ends):  # noqa: F811
    from tasks import segment as segment_task

    upload_hold.hold(planned.run_dir, 0)
    thread, out = _waiting(planned.run_dir, 0)
    if ends == "fails":

        def inputs(planned_run, segment_index):
            raise _Stop

        monkeypatch.setattr(segment_task, "fetch_segment_inputs", inputs)
        monkeypatch.setattr(segment_task, "read_ahead", lambda state_dir, moments: None)
        with pytest.raises(_Stop):
            segment_task.train_segment_fn(planned, 1, on_line=lambda _line: None)
    else:  # its own state is saved already: nothing is trained, nothing read
        monkeypatch.setattr(segment_task, "stored_segment_result", lambda planned_run, index: _saved_result())
        segment_task.train_segment_fn(planned, 1, on_line=lambda _line: None)
    thread.join(JOIN_S)
    assert not thread.is_alive() and out["waited"] < upload_hold.HOLD_LIMIT_S  # let go, not lapsed
