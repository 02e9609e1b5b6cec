"""A thread that yields the CPU lowers its own priority only: the process's other threads keep theirs."""

from __future__ import annotations

import os
import threading

from trainer_core.thread_priority import YIELDING_NICE, yield_cpu


def test_only_the_calling_thread_is_niced():
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def worker():
        yield_cpu()
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["worker"] == min(19, main + YIELDING_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main


def test_the_state_hashing_pool_yields(tmp_path, monkeypatch):
    """LocalState.digests hashes in threads that yield (the niceness each hashing thread saw)."""
    from trainer_core.run import state_record

    seen = []
    real = state_record.size_and_sha256

    def spy(path):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(path)

    monkeypatch.setattr(state_record, "size_and_sha256", spy)
    state = tmp_path / "segment-0000"
    (state / "base").mkdir(parents=True)
    (state / "base" / "params.safetensors").write_bytes(os.urandom(1000))
    (state / "meta.json").write_text("{}")
    record = state_record.write_record(state)
    assert record is not None
    local = state_record.LocalState.load(state)
    assert local is not None and len(local.digests()) == 2
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and all(nice == min(19, main + YIELDING_NICE) for nice in seen)
