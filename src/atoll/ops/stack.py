"""The embedded local stack: a Prefect server (SQLite or PostgreSQL) and one process worker per local pool.

Used by ``atoll up``, ``make demo``, the integration test and the overhead benchmark. Every
process is started with :class:`subprocess.Popen` in its own session, so :meth:`LocalStack.stop`
can stop it and everything it started (learner flow processes included), also on Ctrl-C.

The server's database: SQLite in its Prefect home (the default), PostgreSQL at a URL you give
(``database_url``), or a private PostgreSQL cluster the stack starts and stops itself
(``database="postgres"``, :mod:`atoll.ops.postgres`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from atoll.ops.defaults import DEFAULT_POOLS, DEFAULT_PORT
from atoll.ops.postgres import LocalPostgres, normalize_database_url
from atoll.ops.procs import descendants, free_port, kill_quietly, signal_group
from atoll.ops.signals import deferred_stop

__all__ = ["LocalStack", "free_port", "prefect_env", "descendants", "QUIET_PREFECT_ENV"]

QUIET_PREFECT_ENV: dict[str, str] = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_WORKER_QUERY_SECONDS": "1",
    "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    "PREFECT_WORKER_PREFETCH_SECONDS": "1",
}
"""Settings every process of the local stack gets: no telemetry, fast worker polling."""



def prefect_env(api_url: str | None = None, home: str | os.PathLike[str] | None = None,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **QUIET_PREFECT_ENV, **dict(extra or {})}
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    if api_url is not None:
        env["PREFECT_API_URL"] = api_url
    env.pop("PREFECT_PROFILE", None)
    return env


class LocalStack:
    """Start/stop a local Prefect server and process workers (one per pool)."""

    def __init__(
        self,
        *,
        home: str | os.PathLike[str] | None = None,
        port: int | None = None,
        pools: Sequence[str] = DEFAULT_POOLS,
        log_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        database: str = "sqlite",
        database_url: str | None = None,
    ) -> None:
        """``database``: ``"sqlite"`` (the server's own file in its home) or ``"postgres"`` (a private
        cluster under ``<home>/postgres``, started with the server and stopped with it);
        ``database_url``: a database you run yourself (``postgresql+asyncpg://…``), which wins."""
        if database not in ("sqlite", "postgres"):
            raise ValueError(f"database must be 'sqlite' or 'postgres', not {database!r}")
        self.home = Path(home) if home else None
        self.host = host
        self.port = port or free_port(DEFAULT_PORT)
        self.pools = list(pools)
        self.log_dir = Path(log_dir) if log_dir else (self.home / "logs" if self.home else None)
        self.extra_env = dict(env or {})
        self.server: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []
        self.database = "postgres" if database_url else database
        self.database_url = normalize_database_url(database_url) if database_url else None
        self.postgres: LocalPostgres | None = None

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.ui_url}/api"

    def env(self) -> dict[str, str]:
        return prefect_env(self.api_url, self.home, self.extra_env)

    def _popen(self, args: list[str], name: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        out: Any = subprocess.DEVNULL
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(out)
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def prefect_home(self) -> Path:
        if self.home is not None:
            return self.home
        return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()

    def start_database(self) -> str | None:
        """The server's connection URL: ``None`` for SQLite; starts the private cluster if asked."""
        if self.database_url is not None:
            return self.database_url
        if self.database == "postgres":
            self.postgres = LocalPostgres(self.prefect_home() / "postgres", env=self.env())
            self.postgres.start()
            return self.postgres.url
        return None

    def start_server(self, timeout_s: float = 120.0) -> None:
        env = self.env()
        env.pop("PREFECT_API_URL", None)
        env["PREFECT_UI_API_URL"] = self.api_url
        url = self.start_database()
        if url is not None:
            env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)  # the legacy name would be read first
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = url
        with deferred_stop():  # a stop signal between the start and the record would orphan the server
            self.server = self._popen([sys.executable, "-m", "prefect", "server", "start", "--host", self.host,
                                       "--port", str(self.port)], "server", env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.server.returncode} (logs in {self.log_dir})")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"prefect server at {self.api_url} not healthy after {timeout_s:.0f}s")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:  # noqa: S310 - loopback
                return r.status == 200
        except OSError:
            return False

    def create_pools(self) -> None:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from atoll.ops.deploy import ensure_pools

        with temporary_settings({PREFECT_API_URL: self.api_url}):
            ensure_pools(self.pools)

    def start_worker(self, pool: str) -> subprocess.Popen[bytes]:
        with deferred_stop():  # started and recorded for stop() as one step
            proc = self._popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type",
                                "process", "--name", f"atoll-{pool}-{os.getpid()}"], f"worker-{pool}", self.env())
            self.workers[pool] = proc
        return proc

    def exited(self) -> str | None:
        """The first of the stack's processes that has exited ("server", "worker cpu-fast"), or None."""
        for name, p in [("server", self.server), *((f"worker {k}", w) for k, w in self.workers.items())]:
            if p is not None and p.poll() is not None:
                return f"{name} (status {p.returncode})"
        return None

    def start(self) -> LocalStack:
        self.start_server()
        self.create_pools()
        for pool in self.pools:
            self.start_worker(pool)
        return self

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """Point this process's Prefect client at the stack."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url}):
            yield

    def stop(self, timeout_s: float = 20.0) -> None:
        """Workers first (with the flow processes they started), then the server."""
        procs = [*self.workers.values(), *([self.server] if self.server else [])]
        # Flow processes may run in sessions of their own: find them through the process tree.
        children = [pid for p in self.workers.values() for pid in descendants(p.pid)]
        for pid in children:
            kill_quietly(pid, signal.SIGTERM)
        for p in procs:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in children:
            kill_quietly(pid, signal.SIGKILL)
        for p in procs:  # whatever is left, in every group, goes now
            signal_group(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        if self.postgres is not None:  # after the server: it holds connections until it exits
            self.postgres.stop()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> LocalStack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()





def run_stack_forever(*, port: int = DEFAULT_PORT, pools: Sequence[str] = DEFAULT_POOLS,
                      home: str | None = None, deploy: bool = True, database: str = "sqlite",
                      database_url: str | None = None) -> int:
    """``atoll up``: start the stack, register the deployments, print where to look, stop on Ctrl-C."""
    stack = LocalStack(home=home, port=free_port(port), pools=pools,
                       log_dir=Path(home) / "logs" if home else Path("out") / "stack-logs",
                       database=database, database_url=database_url)
    print(f"starting Prefect server on {stack.ui_url} (logs in {stack.log_dir}) ...", flush=True)
    try:
        stack.start()
        if stack.postgres is not None:
            print(f"database: private PostgreSQL on 127.0.0.1:{stack.postgres.port} "
                  f"(cluster in {stack.postgres.root}, log {stack.postgres.log_file})", flush=True)
        elif stack.database_url is not None:
            print(f"database: {stack.database_url.split('@')[-1]}", flush=True)
        if deploy:
            from atoll.ops.deploy import deploy_all

            with stack.settings():
                names = deploy_all(pools)
            print("deployments: " + ", ".join(names), flush=True)
        print(f"Prefect UI: {stack.ui_url}\nworkers: {', '.join(pools)} (process pools)\n"
              f"in another shell: export PREFECT_API_URL={stack.api_url}; atoll train --preset demo\n"
              "Ctrl-C (or SIGTERM) stops the server, the workers and the flow runs they started.", flush=True)
        while not (gone := stack.exited()):
            time.sleep(1.0)
        print(f"{gone} exited; stopping the stack", flush=True)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM under atoll.ops.signals.stop_on_signals (the CLI)
        pass
    finally:
        print("stopping the local stack ...", flush=True)
        stack.stop()
    return 0
