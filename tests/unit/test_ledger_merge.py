"""The stored ledger keeps the run's history when a fresh worker (an empty work dir) uploads its own."""

from __future__ import annotations

import json

from infra.runs import ledger


def test_a_fresh_workers_ledger_is_merged_into_the_stored_one_in_time_order(tmp_path):
    first, fresh = tmp_path / "first", tmp_path / "fresh"
    ledger.record(first, "segment", "completed", segment=0)
    ledger.record(fresh, "segment", "reused", segment=0)
    ledger.record(first, "segment", "completed", segment=1)
    stored = (first / ledger.LEDGER_FILE).read_bytes()
    merged = ledger.merge(stored, (fresh / ledger.LEDGER_FILE).read_bytes())
    entries = [json.loads(line) for line in merged.decode().splitlines()]
    assert [(e["status"], e["segment"]) for e in entries] == [("completed", 0), ("reused", 0), ("completed", 1)]
    assert ledger.merge(merged, merged) == merged  # uploading the same entries again adds nothing
    assert ledger.merge(b"", stored) == stored
