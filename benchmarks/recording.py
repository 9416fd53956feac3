"""What recording a round costs the Prefect server: API calls and server CPU per recorded round.

    python benchmarks/recording.py [--rounds 24] [--repeat 2]

Trains the smoke preset for ``--rounds`` rounds against a fresh ``prefect_test_harness`` server,
then records every round of it again ``--repeat`` times with the run's
:class:`~atoll.tasks.recorder.RoundRecorder` (as runs of their own: a round's flow run opened and
completed, its artifact, task runs and logs, from the commit records), one round at a time with
the server otherwise idle. Counted in this process (every HTTP request to the API, by wrapping
httpx) and on the server (its process' user + system CPU from /proc, after the events and logs
are drained and the server is idle again, minus its idle rate over the same time). Prints a table
(calls by endpoint, server CPU ms per round).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="atoll-recording-prefect-")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

import httpx  # noqa: E402

from atoll.runs.manage import prepare_run  # noqa: E402
from atoll.runs.options import FleetOptions, TrainingRunOptions  # noqa: E402
from atoll.storage.paths import to_url  # noqa: E402
from atoll.train.local import LocalRun  # noqa: E402

CALLS: collections.Counter[str] = collections.Counter()
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _count() -> None:
    send, asend = httpx.Client.send, httpx.AsyncClient.send

    def counted(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        CALLS[f"{request.method} {request.url.path}"] += 1
        return send(self, request, *a, **k)

    async def acounted(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        CALLS[f"{request.method} {request.url.path}"] += 1
        return await asend(self, request, *a, **k)

    httpx.Client.send = counted  # type: ignore[method-assign]
    httpx.AsyncClient.send = acounted  # type: ignore[method-assign]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (waited for and live ones)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tick
            for t in Path(f"/proc/{p}/task").iterdir():
                pids += [int(c) for c in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def _settle(pid: int, idle_s: float = 3.0) -> float:
    """Wait until the server's CPU is flat again; its idle rate (CPU s per s)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()
    EventsWorker.drain_all()
    last = _cpu_s(pid)
    while True:
        time.sleep(idle_s)
        now = _cpu_s(pid)
        if now - last < 0.05 * idle_s:
            return (now - last) / idle_s
        last = now


def _train(root: Path, name: str, rounds: int) -> str:
    from atoll.flows.training import training_run

    url = to_url(str(root / name))
    info = prepare_run(url, preset="smoke", rounds=rounds)
    with LocalRun(url, log_dir=root / f"{name}-logs") as run:
        for spec in info.learners:
            run.start_learner(spec["learner_id"])
        training_run(TrainingRunOptions(run_url=url, fleet=FleetOptions(manage=False, watch_every_s=5.0)))
    return url


def _phases(record: Any) -> list[tuple[str, float, float]]:
    """A committed round's phases as its commit's stats tell them (for replaying the recorder)."""
    s, end = record.stats, record.created_at
    merge, evaluate = float(s.get("merge_s", 0.01)), float(s.get("eval_s", 0.0))
    closed = end - 0.01 - evaluate - merge
    opened = closed - float(s.get("wait_s", 0.1))
    quorum = min(closed, opened + float(s.get("quorum_s", 0.0)))
    return [("await-quorum", opened, quorum), ("grace", quorum, closed), ("merge", closed, closed + merge),
            ("commit", closed + merge + evaluate, end)]


def _replay(url: str, run_id: str, pid: int) -> tuple[collections.Counter[str], float, int]:
    """Record every committed round of the run at ``url`` again, as flow runs of run ``run_id``,
    the way the training run's recorder does; the calls and server CPU it took."""
    import inspect

    from atoll.storage import RunReader
    from atoll.tasks.queries import ROUND_TAG, run_tag
    from atoll.tasks.recorder import RoundRecorder

    store = RunReader.open(url)
    latest = store.latest_round()
    records = store.history(1, latest)
    rec = RoundRecorder(store, run_id=run_id, max_rounds=latest, inner_steps=store.config.inner_steps,
                        round_run_tags=[run_tag(run_id), ROUND_TAG])
    new = hasattr(rec, "open") and "phases" in inspect.signature(rec.submit).parameters
    rec.tracker.update()  # the goodput so far is read before: the replay measures the API side
    idle = _settle(pid)
    before, cpu0, t0 = CALLS.copy(), _cpu_s(pid), time.monotonic()
    rec.start()  # the writer thread, as in a training run: the run-level artifacts on their own cadence
    for i, record in enumerate(records):
        if new:
            rec.open(record.round)  # type: ignore[attr-defined]
            rec.submit(record.round, None, seconds=0.3, phases=_phases(record))  # type: ignore[call-arg]
        else:
            rec.submit(record.round, None, seconds=0.3)
        while len(rec.recorded) <= i:
            time.sleep(0.01)
    _settle(pid)
    out = CALLS - before, _cpu_s(pid) - cpu0 - idle * (time.monotonic() - t0), latest
    rec.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.testing.utilities import prefect_test_harness

    _count()
    root = Path(tempfile.mkdtemp(prefix="atoll-recording-"))
    with prefect_test_harness(server_startup_timeout=300):
        proc = SubprocessASGIServer().server_process
        assert proc is not None
        url = _train(root, "run", args.rounds)
        cpu, calls, n = [], collections.Counter[str](), 0
        for i in range(args.repeat):
            got, used, rounds = _replay(url, f"replay-{i}", proc.pid)
            calls += got
            n += rounds
            cpu.append(used / rounds)
            print(f"replay {i}: {1000 * cpu[-1]:.1f} ms server CPU per recorded round ({rounds} rounds)")
    by_kind: collections.Counter[str] = collections.Counter()
    for k, v in calls.items():
        by_kind[UUID_RE.sub("{id}", k)] += v
    print(f"\n{'per recorded round':<40} {'calls':>6}")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{k:<40} {v / n:>6.2f}")
    print(f"{'total':<40} {sum(calls.values()) / n:>6.2f}")
    print(f"{'server CPU per round (median, ms)':<40} {1000 * sorted(cpu)[len(cpu) // 2]:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
