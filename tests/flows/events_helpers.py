"""Reading atoll's events back from the Prefect API (the harness's server persists them shortly
after they are emitted: poll until they are there)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any


def read_events(client: Any, name: str, *, resource_id: str | None = None, at_least: int = 1,
                timeout_s: float = 60.0) -> list[Any]:
    """Every persisted event called ``name`` (about ``resource_id``, if given), oldest first, once
    ``at_least`` of them are there (or whatever is there after ``timeout_s``)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.monotonic() + timeout_s
    while True:
        since = datetime.now(timezone.utc) - timedelta(hours=1)
        flt = EventFilter(occurred=EventOccurredFilter(since=since),
                          event=EventNameFilter(name=[name]),
                          resource=EventResourceFilter(id=[resource_id]) if resource_id else None)
        page = client.read_events(filter=flt, limit=50)  # the API's most per page
        events = list(page.events)
        while page.next_page is not None and len(events) < 10_000:
            page = client.read_events_page(page.next_page)
            events += page.events
        if len(events) >= at_least or time.monotonic() > deadline:
            return sorted(events, key=lambda e: e.occurred)
        time.sleep(0.5)
