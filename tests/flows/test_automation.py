"""The example automation in infra/automations is a valid Prefect automation on atoll's own events."""

from __future__ import annotations

from pathlib import Path

import yaml

from atoll.tasks.events import EVENT_NAMES, ROUND_STALLED, run_resource

ROOT = Path(__file__).resolve().parents[2]


def test_example_automation_validates_and_matches_atoll_events() -> None:
    from prefect.events.schemas.automations import AutomationCore, EventTrigger

    data = yaml.safe_load((ROOT / "infra" / "automations" / "round-stalled.yaml").read_text())
    [raw] = data["automations"]
    automation = AutomationCore.model_validate(raw)
    trigger = automation.trigger
    assert isinstance(trigger, EventTrigger)
    assert set(trigger.expect) <= set(EVENT_NAMES) and trigger.expect == {ROUND_STALLED}
    # Its match covers the resource atoll's events are about.
    resource = run_resource("run-1a2b", "s3://b/runs/run-1a2b")
    pattern = trigger.match.root["prefect.resource.id"]
    pattern = pattern if isinstance(pattern, str) else pattern[0]
    assert pattern.endswith("*") and resource["prefect.resource.id"].startswith(pattern[:-1])
    assert [a.type for a in automation.actions] == ["send-notification"]
