"""The README's example automations are valid Prefect automations that a server accepts."""

from __future__ import annotations

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.events.schemas.automations import AutomationCore

from tests.conftest import EXAMPLES

pytestmark = pytest.mark.flow


def test_example_automations_are_accepted_by_a_prefect_server(prefect_harness):
    documents = yaml.safe_load((EXAMPLES / "automations" / "rankflow.yaml").read_text())["automations"]
    automations = [AutomationCore.model_validate(document) for document in documents]
    assert {e for a in automations for e in a.trigger.expect} == {"rankflow.run.failed", "rankflow.segment.completed"}
    with get_client(sync_client=True) as client:
        created = [client.create_automation(automation) for automation in automations]
        stored = {a.name for a in client.read_automations()}
    assert len(created) == 3 and {a.name for a in automations} <= stored
