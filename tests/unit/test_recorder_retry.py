"""The recorder's state calls are tried again within tens of milliseconds while the API is busy
(503, 429, unreachable): the server stamps a state with its own clock, so a call that waits
seconds (Prefect's client backs off 2 s, 4 s, ...) is a round timed wrong."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest

from atoll.tasks.round_runs import soon


@pytest.fixture
def api() -> Iterator[tuple[str, list[int]]]:
    """A loopback HTTP server answering each request with the next status of ``statuses``."""
    statuses: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(statuses.pop(0) if statuses else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", statuses
    finally:
        server.shutdown()
        server.server_close()


def post(url: str, calls: list[int]) -> int:
    calls.append(1)
    return httpx.post(url).raise_for_status().status_code


def test_busy_answers_are_tried_again_soon(api: tuple[str, list[int]]) -> None:
    url, statuses = api
    statuses[:] = [503, 429, 503]
    calls: list[int] = []
    assert soon(lambda: post(url, calls)) == 200
    assert len(calls) == 4


def test_other_errors_and_the_last_busy_answer_are_raised(api: tuple[str, list[int]]) -> None:
    url, statuses = api
    statuses[:] = [409]
    calls: list[int] = []
    with pytest.raises(httpx.HTTPStatusError):
        soon(lambda: post(url, calls))
    assert len(calls) == 1
    statuses[:] = [503] * 3
    with pytest.raises(httpx.HTTPStatusError):
        soon(lambda: post(url, calls), tries=3)
    assert len(calls) == 4
