"""What atoll uses of Prefect beyond its public API (:mod:`atoll.tasks.prefect_private`) still works.

Each test pins one function of that module against the installed Prefect, with no server: the
private names it reaches and what Prefect's own code does with them. A Prefect release that
changes any of it fails here, saying what changed; ``pyproject.toml`` limits Prefect to the
releases this file has passed on.
"""

from __future__ import annotations

import http.server
import inspect
import json
import platform
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from atoll.tasks.prefect_private import emit_task_run_completed, post_once, set_state_body, without_tags


@dataclass
class FakeApi:
    """A loopback HTTP server standing in for Prefect's API: it hands out a CSRF token and answers
    each POST with the next of ``statuses`` (then 200), noting what it got."""

    url: str
    statuses: list[int] = field(default_factory=list)
    posts: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi(url="")

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path.startswith("/api/csrf-token"):
                self._answer(200, {"token": "csrf-token-1", "client": "c", "expiration": "2999-01-01T00:00:00Z"})
            else:
                self._answer(404, {})

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
            fake.posts.append((self.path, dict(self.headers), body))
            self._answer(fake.statuses.pop(0) if fake.statuses else 200, {"id": "answered"})

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}/api"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def test_the_private_names_post_once_reaches_are_there() -> None:
    from prefect.client.base import PrefectHttpxSyncClient
    from prefect.client.orchestration import SyncPrefectClient

    client = SyncPrefectClient("http://127.0.0.1:9/api")
    http_client = getattr(client, "_client", None)
    assert isinstance(http_client, PrefectHttpxSyncClient), (
        f"SyncPrefectClient._client is now {type(http_client)!r}, not Prefect's PrefectHttpxSyncClient: "
        "post_once reaches the client's base URL, auth and CSRF token through it")
    send = getattr(PrefectHttpxSyncClient, "_send_with_retry", None)
    assert send is not None, "PrefectHttpxSyncClient._send_with_retry is gone: post_once sends through it"
    params = inspect.signature(send).parameters
    missing = {"request", "send", "send_args", "send_kwargs"} - set(params)
    assert not missing, f"PrefectHttpxSyncClient._send_with_retry lost its parameters {sorted(missing)}: {params}"
    for name, empty in (("retry_codes", set()), ("retry_exceptions", ())):
        assert name in params and params[name].default == empty, (
            f"PrefectHttpxSyncClient._send_with_retry's {name} no longer defaults to {empty!r} "
            f"({params.get(name)}): post_once relies on that default to send once")


def test_post_once_sends_once_with_prefects_base_url_and_csrf_token(api: FakeApi) -> None:
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api.url) as client:
        assert post_once(client, "/flow_runs/", {"n": 1}).json() == {"id": "answered"}
        api.statuses[:] = [503, 503, 503]
        t0 = time.monotonic()
        with pytest.raises(httpx.HTTPStatusError) as err:
            post_once(client, "/flow_runs/", {"n": 2})
        took_s = time.monotonic() - t0
    assert err.value.response.status_code == 503
    assert [(path, body) for path, _, body in api.posts] == [("/api/flow_runs/", {"n": 1}), ("/api/flow_runs/", {"n": 2})], (
        f"post_once sent {api.posts}: one POST each, to the client's base URL, was expected "
        "(Prefect's retry loop or base URL changed)")
    assert took_s < 1.0, f"post_once took {took_s:.2f} s on a 503: Prefect's retry loop slept"
    for _, headers, _ in api.posts:
        tokens = {k.lower(): v for k, v in headers.items()}
        assert tokens.get("prefect-csrf-token") == "csrf-token-1", (
            f"post_once's request carried no CSRF token ({headers}): _send_with_retry no longer adds it")


def test_set_state_body_is_what_prefects_client_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.states import Completed

    client = SyncPrefectClient("http://127.0.0.1:9/api")
    sent: dict[str, Any] = {}

    class Sent(Exception):
        pass

    def request(method: str, path: str, params: Any = None, path_params: Any = None, **kwargs: Any) -> Any:
        sent.update(method=method, path=path.format(**(path_params or {})), json=kwargs.get("json"))
        raise Sent

    monkeypatch.setattr(client, "request", request)
    flow_run_id = uuid.uuid4()
    state: Any = Completed(message="round 3 (fragment 1) committed in 0.30 s: 2 learners merged, 0 not")
    with pytest.raises(Sent):
        client.set_flow_run_state(flow_run_id, state, force=True)
    ours = set_state_body(flow_run_id, state, force=True)
    theirs = sent["json"]
    assert sent["method"] == "POST" and sent["path"] == f"/flow_runs/{flow_run_id}/set_state", (
        f"Prefect's client now sets a flow run's state with {sent['method']} {sent['path']}; "
        "RoundFlowRuns.complete posts to /flow_runs/{id}/set_state")
    for body in (ours, theirs):
        body["state"]["state_details"].pop("transition_id")  # a fresh one per call
    assert ours == theirs, f"Prefect's client now sends this to set a state:\n{theirs}\nset_state_body sends:\n{ours}"


def _captured(monkeypatch: pytest.MonkeyPatch, module: str) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(f"{module}.emit_event", lambda **kwargs: calls.append(kwargs))
    return calls


def test_task_run_event_matches_the_engine_and_the_servers_recorder_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prefect's server imports its vendored croniter, which asks on import whether this Python is
    # 32-bit by running `file` on the interpreter; answered here without a process (fast tier).
    monkeypatch.setattr(platform, "architecture", lambda *args, **kwargs: (f"{struct.calcsize('P') * 8}bit", ""))
    from prefect.client.schemas.objects import TaskRun
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.server.services import task_run_recorder
    from prefect.states import Completed, Running
    from prefect.utilities.engine import emit_task_run_state_change_event

    flow_run_id, task_run_id, t0 = uuid.uuid4(), uuid.uuid4(), 1_700_000_000.25
    ours = _captured(monkeypatch, "prefect.events")
    emit_task_run_completed(flow_run_id, task_run_id, name="merge-7", task_key="atoll-round-merge", dynamic_key="7",
                            start_s=t0, end_s=t0 + 1.5)
    engine = _captured(monkeypatch, "prefect.utilities.engine")
    emit_task_run_state_change_event(TaskRun(name="merge-7", task_key="k", dynamic_key="7", flow_run_id=flow_run_id),
                                     initial_state=Running(), validated_state=Completed())
    assert len(ours) == 1 and len(engine) == 1, (ours, engine)
    event, theirs = ours[0], engine[0]
    assert event["event"] == theirs["event"] == "prefect.task-run.Completed", theirs["event"]
    assert set(event["resource"]) <= set(theirs["resource"]), (
        f"Prefect's task engine no longer labels a task-run event with {set(event['resource']) - set(theirs['resource'])}")
    assert set(event["payload"]) == set(theirs["payload"]), (
        f"Prefect's task engine now sends a task-run event's payload with {sorted(theirs['payload'])}, "
        f"emit_task_run_completed with {sorted(event['payload'])}")
    unknown = set(event["payload"]["task_run"]) - set(TaskRun.model_fields)
    assert not unknown, f"TaskRun no longer has the fields {sorted(unknown)} that emit_task_run_completed sends"

    # The server's task-run recorder takes events the client's engine sends, and reads the task run from it.
    source = inspect.getsource(task_run_recorder)
    for gate in ('startswith("prefect.task-run', 'get("prefect.orchestration") == "client"'):
        assert gate in source, f"the server's task-run recorder no longer selects events with {gate!r}"
    task_run = task_run_recorder.task_run_from_event(ReceivedEvent(**event))
    assert (task_run.id, task_run.flow_run_id, task_run.name) == (task_run_id, flow_run_id, "merge-7"), task_run
    assert task_run.start_time is not None and task_run.end_time is not None
    assert (task_run.start_time.timestamp(), task_run.end_time.timestamp()) == (t0, t0 + 1.5), task_run
    assert task_run.state is not None and task_run.state.is_completed(), task_run.state


def test_run_flow_runs_a_flow_run_created_beforehand() -> None:
    from prefect.flow_engine import run_flow

    params = inspect.signature(run_flow).parameters
    missing = {"flow", "flow_run", "parameters"} - set(params)
    assert not missing, f"prefect.flow_engine.run_flow lost its parameters {sorted(missing)}: {params}"
    assert params["return_type"].default == "result", (
        f"prefect.flow_engine.run_flow now returns {params['return_type'].default!r} by default; "
        "run_flow_run returns the round flow's result")


def test_without_tags_clears_the_tags_new_runs_inherit() -> None:
    from prefect import tags
    from prefect.context import TagsContext

    with tags("atoll-run:r", "atoll-round"):
        assert TagsContext.get().current_tags == {"atoll-run:r", "atoll-round"}, (
            f"prefect.tags no longer keeps its tags in TagsContext ({TagsContext.get()!r}): "
            "without_tags clears them there")
        with without_tags():
            assert TagsContext.get().current_tags == set(), TagsContext.get()
        assert TagsContext.get().current_tags == {"atoll-run:r", "atoll-round"}, TagsContext.get()
