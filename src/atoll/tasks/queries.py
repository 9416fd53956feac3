"""Reading flow runs from Prefect: by flow name and tags, every page of them.

Prefect's API answers at most ``limit`` rows per call. A run has one training-run flow run per
(re)launch, one round flow run per round and one learner flow run per learner incarnation, all
tagged with the run: after 10^5 rounds, a query by the run tag alone with a limit would see only
rounds. So every lookup names the flow and pages through all results.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterName,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort

__all__ = ["PAGE_SIZE", "read_flow_runs_paged", "newest_first", "flow_id", "ACTIVE_STATE_TYPES", "TRAINING_FLOW_NAME",
           "ROUND_FLOW_NAME", "LEARNER_FLOW_NAME", "SUPERVISOR_FLOW_NAME", "RUN_TAG_PREFIX", "run_id_of",
           "DEFAULT_TRAINING_DEPLOYMENT", "ROUND_TAG", "SEGMENT_RUN_TAG", "SEGMENT_TAG", "SEGMENT_OF_TAG", "HANDED_OVER_TAG",
           "run_tag", "learner_tag", "pool_tag"]

PAGE_SIZE = 200
"""Rows per API call when paging. ``$ATOLL_QUERY_PAGE_SIZE`` overrides it (tests use a small page so a
short run already spans several pages)."""

ACTIVE_STATE_TYPES = (StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED,
                      StateType.CANCELLING)


def read_flow_runs_paged(client: Any, *, flow_names: Sequence[str], tags: Sequence[str] = (),
                         state_types: Sequence[StateType] | None = None, since: datetime | None = None,
                         names: Sequence[str] | None = None, max_rows: int = 1_000_000,
                         page_size: int | None = None) -> list[FlowRun]:
    """Every flow run of these flows carrying all of ``tags`` (and in ``state_types``, and named
    one of ``names``, if given).

    Pages newest first; a run created while paging may shift rows by one, so rows are de-duplicated
    by id (a shift never skips a row: new rows enter at the top). ``since``: only flow runs expected
    to start after this moment."""
    run_filter = FlowRunFilter(
        tags=FlowRunFilterTags(all_=list(tags)) if tags else None,
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(state_types))) if state_types else None,
        expected_start_time=FlowRunFilterExpectedStartTime(after_=cast(Any, since)) if since is not None else None,
        name=FlowRunFilterName(any_=list(names)) if names is not None else None,
    )
    if page_size is None:
        page_size = int(os.environ.get("ATOLL_QUERY_PAGE_SIZE", PAGE_SIZE))
    seen: dict[Any, FlowRun] = {}
    offset = 0
    while offset < max_rows:
        page = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=list(flow_names))),
                                     flow_run_filter=run_filter, sort=FlowRunSort.EXPECTED_START_TIME_DESC,
                                     limit=page_size, offset=offset)
        for fr in page:
            seen.setdefault(fr.id, fr)
        if len(page) < page_size:
            break
        offset += page_size
    return newest_first(seen.values())


def flow_id(client: Any, name: str) -> str:
    """The id of flow ``name`` (created if new): one ``POST /flows/``, which Prefect answers with
    the existing flow when the name is taken. For flow runs created with the API (round flow runs)."""
    from prefect.client.schemas.actions import FlowCreate

    resp = client.request("POST", "/flows/", json=FlowCreate(name=name).model_dump(mode="json"))
    return str(resp.json()["id"])


def newest_first(runs: Any) -> list[FlowRun]:
    """Flow runs sorted by creation time, newest first."""
    return sorted(runs, key=lambda fr: fr.created.timestamp() if fr.created else 0.0, reverse=True)


TRAINING_FLOW_NAME = "atoll-training-run"
ROUND_FLOW_NAME = "atoll-round"
LEARNER_FLOW_NAME = "atoll-learner"
SUPERVISOR_FLOW_NAME = "atoll-supervisor"
RUN_TAG_PREFIX = "atoll-run:"
DEFAULT_TRAINING_DEPLOYMENT = "atoll-training-run/default"
"""Where a training run that was not started from a deployment is relaunched or continued."""

ROUND_TAG = "atoll-round"
SEGMENT_RUN_TAG = "atoll-segment-run:"
"""``atoll-segment-run:<training flow run id>``: on a round flow run, the training-run flow run (segment) that ran it."""
SEGMENT_TAG = "atoll-segment"
"""Tag of a training-run flow run that continues its run after another one's segment."""
SEGMENT_OF_TAG = "atoll-segment-of:"
"""``atoll-segment-of:<flow run id>``: the segment a continuing flow run follows."""
HANDED_OVER_TAG = "atoll-handed-over"
"""Tag of a training-run flow run that completed its segment and launched the next one: Completed,
but the run is not finished (the supervisor looks at the run's newest flow run instead)."""


def run_id_of(flow_run: FlowRun) -> str | None:
    """The run a flow run belongs to, from its ``atoll-run:<id>`` tag."""
    for t in flow_run.tags:
        if t.startswith(RUN_TAG_PREFIX):
            return t[len(RUN_TAG_PREFIX):]
    return None


def run_tag(run_id: str) -> str:
    """The tag every flow run of a run carries (training run, rounds, learners)."""
    return f"{RUN_TAG_PREFIX}{run_id}"


def learner_tag(learner_id: str) -> str:
    return f"atoll-learner:{learner_id}"


def pool_tag(pool: str) -> str:
    return f"atoll-pool:{pool}"
