"""The real stack on PostgreSQL: the test starts a private cluster through ``LocalStack(database=
"postgres")`` (initdb, pg_ctl on a free loopback port, as an unprivileged user when root), a Prefect
server on it, two process pools with a worker each, moto S3; then a run of 8 learners split over
the two pools, lock-step (K = M, P = 1) so every round merges every learner: many processes write to
Prefect at once, which is what PostgreSQL is for.

Checks: every round committed (the chain verifies), all 8 learners merged, learner flow runs on
both pools, the server's rows are in PostgreSQL (and there is no SQLite file), the cluster is
stopped with the stack and no process is left behind.

The server binaries come from the machine (``make test`` installs them when missing, see the
Makefile's ``postgres`` target). Without them the test skips, unless ``ATOLL_REQUIRE_POSTGRES=1``
(CI sets it in ``.ci/run``), where it fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from atoll.ops.deploy import deploy_all, start_training
from atoll.ops.postgres import LocalPostgres, PostgresNotFound, find_postgres_bin
from atoll.ops.procs import free_port
from atoll.ops.stack import LocalStack
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.storage import RunReader
from atoll.tasks.queries import run_tag
from atoll.train.recipe import LearnerSpec, Recipe, smoke_recipe
from atoll.train.run import create_run

from .stack_helpers import POOLS, flow_runs, logs, processes_with, tear_down, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LEARNERS = 8
ROUNDS = 12


@pytest.fixture(scope="module", autouse=True)
def postgres_binaries() -> Path:
    try:
        return find_postgres_bin()
    except PostgresNotFound as e:
        if os.environ.get("ATOLL_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"ATOLL_REQUIRE_POSTGRES=1 and {e}")
        pytest.skip(str(e))


def _query(url: str, sql: str) -> Any:
    import asyncpg

    async def run() -> Any:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"), timeout=30)
        try:
            return await conn.fetchval(sql)
        finally:
            await conn.close()

    return asyncio.run(run())


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_private_cluster_restarts_on_its_data_and_recovers_from_a_dead_stack(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = LocalPostgres(home / "postgres").start()
    try:
        pid = first.postmaster_pid()
        assert pid is not None and _alive(pid)
        if os.geteuid() == 0:  # PostgreSQL refuses root: it runs as an unprivileged user
            assert os.stat(f"/proc/{pid}").st_uid != 0
            assert os.stat(first.data_dir).st_uid == first.run_as.pw_uid  # type: ignore[union-attr]
        _query(first.url, "CREATE TABLE kept (x int)")
        # The stack that started it dies without stopping it: the next start takes it over.
        second = LocalPostgres(home / "postgres").start()
        assert not _alive(pid) and second.root == first.root
        assert _query(second.url, "SELECT count(*) FROM kept") == 0  # same cluster, same database
        second.stop()
        assert second.postmaster_pid() is None
    finally:
        first.destroy()
    assert not first.root.exists() and not (home / "postgres").exists()


def test_eight_learners_on_two_pools_on_postgres(s3: Any, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    started = time.monotonic()
    marker = uuid.uuid4().hex
    run_id = f"pg-{marker[:8]}"
    url = f"s3://{s3.bucket}/{run_id}"
    config, recipe = smoke_recipe(LEARNERS, max_rounds=ROUNDS)
    # Lock-step (K = M and P = 1, learners wait for the version that merges their work): every round
    # merges all 8 and the learners never run ahead of the synchronizer. With P > 1 learners run free
    # (K = M is then only the synchronizer waiting for all M), and 8 free-running learners on 2 cores
    # starve the training run: 12 rounds took 6.5 min on an idle machine and timed out in CI.
    config = dataclasses.replace(config, min_quorum=LEARNERS, num_fragments=1)
    learners = [LearnerSpec(learner_id=f"learner-{i}", batch_size=4, pool=POOLS[i % 2],
                            slowdown=1.0 if i % 2 == 0 else 1.5) for i in range(LEARNERS)]
    recipe = Recipe.from_dict({**recipe.to_dict(), "learners": [vars(s) for s in learners],
                               "eval_every_rounds": 1000})
    create_run(url, config, recipe, storage_options=s3.storage_options)
    store = RunReader.open(url, s3.storage_options)
    env = {**s3.env, "ATOLL_IT_MARKER": marker}
    home = tmp_path / "prefect"
    # A random port, not 4200-or-next: another stack taking 4200 between our check and our server's
    # start would answer our health check while ours exits.
    stack = LocalStack(home=home, port=free_port(), pools=POOLS, log_dir=tmp_path / "logs", env=env,
                       database="postgres")
    pg_pid: int | None = None
    try:
        stack.start()
        assert stack.postgres is not None
        pg_pid = stack.postgres.postmaster_pid()
        assert pg_pid is not None and pg_pid in processes_with(marker)  # the sweep below covers it too
        print(f"\nstack on PostgreSQL up after {time.monotonic() - started:.1f}s", flush=True)
        with stack.settings(), get_client(sync_client=True) as client:
            deploy_all(POOLS, env=s3.env, supervisor_interval_s=None)
            fleet = FleetOptions(poll_interval_s=0.5, watch_every_s=3.0, startup_grace_s=240.0,
                                 heartbeat_timeout_s=120.0)
            training = start_training(TrainingRunOptions(run_url=url, fleet=fleet), tags=[run_tag(run_id)])

            def finished() -> bool:
                fr = client.read_flow_run(training.id)
                if fr.state is not None and fr.state.is_final() and not fr.state.is_completed():
                    raise AssertionError(f"training run ended {fr.state.type}: {logs(tmp_path)}")
                return fr.state is not None and fr.state.is_completed()

            wait_for(finished, 400, f"the training run completed: {logs(tmp_path)}", every_s=2.0)
            print(f"run finished after {time.monotonic() - started:.1f}s", flush=True)

            def learners_ended() -> list[Any] | None:
                runs = flow_runs(client, run_id, "atoll-learner")
                done = len(runs) >= LEARNERS and all(fr.state is not None and fr.state.is_final() for fr in runs)
                return runs if done else None

            learner_runs = wait_for(learners_ended, 120, "every learner flow run final")
            assert {fr.work_pool_name for fr in learner_runs} == set(POOLS)
            pools_of = {next(t.split(":", 1)[1] for t in fr.tags if t.startswith("atoll-learner:")): fr.work_pool_name
                        for fr in learner_runs}
            assert pools_of == {s.learner_id: s.pool for s in learners}
            rounds = [fr for fr in flow_runs(client, run_id, "atoll-round") if fr.state and fr.state.is_completed()]
            assert len(rounds) >= ROUNDS

        # -- the bucket: every round committed once, every learner merged --------------------------
        report = store.verify()
        assert report.ok, report.problems
        assert report.latest == ROUNDS and not report.void
        history = store.history(1, ROUNDS)
        assert [rec.round for rec in history] == list(range(1, ROUNDS + 1))
        merged = {a.learner_id for rec in history for a in rec.accepted}
        assert merged == {s.learner_id for s in learners}

        # -- Prefect's rows are in PostgreSQL, not in a SQLite file ----------------------------------
        flow_rows = _query(stack.postgres.url, "SELECT count(*) FROM flow_run")
        assert flow_rows >= 1 + ROUNDS + LEARNERS
        tagged = _query(stack.postgres.url,
                        f"SELECT count(*) FROM flow_run WHERE tags @> '[\"{run_tag(run_id)}\"]'::jsonb")
        assert tagged >= 1 + ROUNDS + LEARNERS
        assert not (home / "prefect.db").exists()
    finally:
        left = tear_down(stack, marker)
        if stack.postgres is not None:
            stack.postgres.destroy()
    assert pg_pid is not None and not _alive(pg_pid), "PostgreSQL still running after stack.stop()"
    assert left == {}, f"processes left behind: {left}"
    print(f"PostgreSQL stack test: {time.monotonic() - started:.1f}s", flush=True)
