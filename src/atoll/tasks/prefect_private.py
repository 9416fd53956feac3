"""Every use atoll makes of Prefect beyond its public, documented API, each behind one function.

atoll relies on these to record a round the way its user sees it in the UI at the pace rounds
come (docs/prefect.md, "Recorded rounds"), and to run a round flow run it created itself. No
public API does any of them; each is pinned by ``tests/flows/test_prefect_contract.py``, which
fails naming what changed when a Prefect release changes it, and the Prefect range in
``pyproject.toml`` is what that test has passed on.

* :func:`post_once`: ``SyncPrefectClient._client`` (Prefect's httpx client: base URL, auth, CSRF
  token) and ``PrefectHttpxSyncClient._send_with_retry`` called with no retry codes, to send one
  request with no retry loop. Every public call of the client goes through that loop, which
  sleeps 2 s, 4 s, ... after a 503, even after its last try; a state call that waits is a round
  timed wrong (the server stamps a state with its own clock).
* :func:`set_state_body`: the body Prefect's client sends to ``POST /flow_runs/{id}/set_state``
  (``to_state_create``, a fresh ``transition_id``, ``serialize_as_any``), so that
  :func:`post_once` can send a state. The public ``set_flow_run_state`` builds it only to send it
  through the retry loop.
* :func:`emit_task_run_completed`: a ``prefect.task-run.Completed`` event as Prefect's task
  engine sends it (its resource labels and payload), which the server's task-run recorder turns
  into a task run. A task run with a start and end of its own choosing, and no HTTP call, has no
  public API: the task-run endpoints stamp states with the server's clock, one call each.
* :func:`run_flow_run`: ``prefect.flow_engine.run_flow``, which runs a flow run created
  beforehand (one ``POST /flow_runs/``) in this process. Calling a flow, the public way, creates
  its own flow run first (a parent task run and a look-up, ~9 calls, docs/prefect.md).
* :func:`without_tags`: ``prefect.context.TagsContext`` entered with no tags, which Prefect's
  docs say users should not touch. The public ``prefect.tags`` only adds tags, and a round's flow
  run and task runs must not inherit the training run's.
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any
from uuid import UUID

__all__ = ["emit_task_run_completed", "post_once", "run_flow_run", "set_state_body", "without_tags"]


def post_once(client: Any, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` to ``path`` of the API with Prefect's sync client ``client`` (its base URL,
    auth and CSRF token), once: not through its retry loop. Returns the ``httpx.Response``;
    raises ``httpx.HTTPStatusError`` for an error status."""
    http = client._client  # Prefect's httpx client: its base URL, auth and CSRF token
    request = http.build_request("POST", path, json=body)
    send_once = getattr(http, "_send_with_retry", None)
    if send_once is None:  # another Prefect: its own loop, then
        return http.send(request).raise_for_status()
    response = send_once(request=request, send=super(type(http), http).send, send_args=(), send_kwargs={})
    return response.raise_for_status()


def set_state_body(flow_run_id: UUID, state: Any, *, force: bool) -> dict[str, Any]:
    """The body of ``POST /flow_runs/{flow_run_id}/set_state`` that sets ``state`` (a Prefect
    ``State``), as Prefect's client builds it."""
    from prefect.states import to_state_create

    create = to_state_create(state)
    create.state_details.flow_run_id = flow_run_id
    create.state_details.transition_id = uuid.uuid4()
    return {"state": create.model_dump(mode="json", serialize_as_any=True), "force": force}


def _utc(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc)


def emit_task_run_completed(flow_run_id: UUID, task_run_id: UUID, *, name: str, task_key: str, dynamic_key: str,
                            start_s: float, end_s: float) -> None:
    """Task run ``task_run_id`` of ``flow_run_id``, Completed, running from ``start_s`` to
    ``end_s`` (seconds since the epoch): one ``prefect.task-run.Completed`` event (over the events
    websocket, no HTTP call) as Prefect's task engine sends it, which the server's task-run
    recorder turns into the task run."""
    from prefect.events import emit_event

    state: dict[str, Any] = {"type": "COMPLETED", "name": "Completed", "message": None, "state_details": {}, "data": None}
    emit_event(
        event="prefect.task-run.Completed", occurred=_utc(end_s), id=uuid.uuid4(),
        resource={"prefect.resource.id": f"prefect.task-run.{task_run_id}", "prefect.resource.name": name,
                  "prefect.state-name": "Completed", "prefect.state-type": "COMPLETED",
                  "prefect.state-timestamp": _utc(end_s).isoformat(), "prefect.orchestration": "client",
                  "prefect.run-count": "1"},
        related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}],
        payload={"intended": {"from": "RUNNING", "to": "COMPLETED"},
                 "initial_state": {"type": "RUNNING", "name": "Running", "message": "", "state_details": {}},
                 "validated_state": state,
                 "task_run": {"name": name, "task_key": task_key,
                              "dynamic_key": dynamic_key, "run_count": 1, "flow_run_run_count": 1,
                              "expected_start_time": _utc(start_s).isoformat(), "start_time": _utc(start_s).isoformat(),
                              "end_time": _utc(end_s).isoformat(), "total_run_time": end_s - start_s,
                              "tags": [], "labels": {}, "task_inputs": {}, "empirical_policy": {}}})


def run_flow_run(flow: Any, flow_run: Any, parameters: dict[str, Any]) -> Any:
    """Run ``flow_run`` (a ``FlowRun`` of ``flow``, created beforehand, Pending) here, in this
    process, with Prefect's engine; its result. Exceptions propagate as from a subflow."""
    from prefect.flow_engine import run_flow

    return run_flow(flow, flow_run=flow_run, parameters=parameters)


def without_tags() -> Any:
    """A context manager inside which the flow runs and task runs created inherit no tags from
    those around it (``prefect.tags``, the flow run's own)."""
    from prefect.context import TagsContext

    return TagsContext(current_tags=set())
