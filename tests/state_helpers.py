"""Segments as the pipeline runs them, for tests that drive the stages' functions without a flow."""

from __future__ import annotations

from tasks.outcomes import PlannedRun, SegmentOutcome
from tasks.segment import train_segment_fn
from tasks.state_upload import upload_state_fn


def train_and_store(planned: PlannedRun, segment_index: int, **kwargs) -> SegmentOutcome:
    """Train segment `segment_index` (or reuse it), then its state upload, as the flow does before a checkpoint."""
    outcome = train_segment_fn(planned, segment_index, **kwargs)
    upload_state_fn(planned, segment_index)
    return outcome
