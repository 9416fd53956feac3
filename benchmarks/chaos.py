"""Chaos soak on the real stack, with goodput: Decoupled DiLoCo (K = 1 + grace) against lock-step
(K = M) under the same seeded kill schedule.

    python benchmarks/chaos.py [--minutes 12] [--learner-kills 100] [--run-kills 10] [--out out/]
    python benchmarks/chaos.py --quick        # a few minutes: the same machinery, fewer kills

Each mode runs on a stack of its own, started here for real: a Prefect server (its own SQLite),
a process worker on each of two pools (``cpu-fast``, ``cpu-slow``), the supervisor flow, atoll's
deployments, and a moto S3 server on loopback (a process of its own) as the bucket. A training run with M learners (two
per pool, the ``cpu-slow`` ones 1.5x slower) trains for ``--minutes`` of wall time, while a
schedule drawn from ``--seed`` (the same times and targets in both modes):

* SIGKILLs learner processes (the training run's healing relaunches them on their pools);
* SIGKILLs the training-run process, half of the time between a round's payload writes and its
  commit (the commit is armed to hold there: ``ATOLL_FAULT_HOLD_WHEN_ARMED``), otherwise at a
  random moment (the supervisor relaunches it; the new one resumes from the bucket);
* injects storage faults into every process of the run (``ATOLL_FAULT_STORAGE``: transient errors
  before operations, lost replies after writes, random latency), which the retry policy absorbs.

Reported per mode, from the bucket and from Prefect:

* rounds committed, lost (a gap in the verified commit chain) and duplicated (a round with more
  than one Completed round flow run): goal 0 and 0;
* duplicate live learner copies (sampled every second: leases whose process runs and heartbeats,
  per learner): goal 0;
* relaunch latency of learners and of the training run (SIGKILL -> a newer incarnation
  heartbeats), p50 / p95;
* goodput, as the paper defines it (``atoll status``): time in useful training steps over the
  time learners were available (not waiting, not down or redoing steps after a restart); the
  merged-work share (the part of that training the model kept); and merged learner-seconds
  (merged steps / P x the learner's step time) over the learner-seconds the run had (M x its wall
  time from the first commit), about the product of the two;
* contributors per round.

Prints the table and writes ``chaos.png`` (cumulative goodput and contributors per round, over
time, both modes). For reference, the paper's heterogeneous ablation (no failures) has 100%
goodput for K = 1 + grace against 84% for K = M.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

from atoll.ops import observe  # noqa: E402

POOLS = ("cpu-fast", "cpu-slow")
HEARTBEAT_TIMEOUT_S = 20.0
LEARNER_NICE = 10
"""Learner processes run at this niceness (set by the watcher once they hold a lease): in a real
fleet each learner has its own machine and the control plane (training run, server, workers) has
its own; on one small machine, free-running learners would otherwise take the cores the training
run needs to close rounds (6 learners on 2 cores: ~5 s a round, where the plain runner takes 0.3 s)."""
BUCKET = "atoll-chaos"
MOTO_S3 = Path(__file__).resolve().parents[1] / "tests" / "moto_s3.py"
"""moto's S3 server with atomic create-once (plain moto lets two racing creates of a key both win)."""
PLOT_GOODPUT_AFTER_S = 60.0


# -- the schedule -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kill:
    at_s: float
    """Seconds after the run's first commit."""
    kind: str
    """"learner", "run" (anywhere) or "run-before-commit"."""
    target: int = 0
    """Learner index (a learner kill); another live learner is taken if that one is down."""


def kill_schedule(seed: int, *, minutes: float, learners: int, learner_kills: int, run_kills: int) -> list[Kill]:
    """The seeded schedule both modes run: uniform times over the soak (the first and last 5%
    spared), learners drawn uniformly, training-run kills alternating before-commit / anywhere."""
    rng = random.Random(seed)
    span = minutes * 60.0
    lo, hi = 0.05 * span, 0.95 * span
    out = [Kill(rng.uniform(lo, hi), "learner", rng.randrange(learners)) for _ in range(learner_kills)]
    out += [Kill(rng.uniform(lo, hi), "run-before-commit" if i % 2 == 0 else "run") for i in range(run_kills)]
    return sorted(out, key=lambda k: k.at_s)


# -- watching the processes ---------------------------------------------------------------------------

MARKER_VAR = "ATOLL_CHAOS_MARKER"
"""Every process of a soak's stack carries ``ATOLL_CHAOS_MARKER=<marker>`` (atoll.ops.observe)."""


def processes_with(marker: str) -> list[int]:
    return observe.processes_with(MARKER_VAR, marker)


def live_copies(store: Any, holder: str, marker: str) -> list[int]:
    """Incarnations of ``holder`` whose process runs on this machine and heartbeats as alive."""
    return observe.live_copies(store, holder, env_var=MARKER_VAR, marker=marker,
                               heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)


alive = observe.alive
"""The newest incarnation's liveness (None: not newer than ``newer_than``, or not heartbeating)."""


class Watcher(threading.Thread):
    """Every second: live copies per learner (the worst seen), and relaunch latencies of the
    processes killed (until a newer incarnation heartbeats)."""

    def __init__(self, store: Any, learners: list[str], marker: str) -> None:
        super().__init__(daemon=True, name="chaos-watcher")
        self.store, self.learners, self.marker = store.sibling(), learners, marker
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.worst: dict[str, int] = {lid: 0 for lid in learners}
        self.pending: list[tuple[str | None, int, float]] = []  # (holder, incarnation killed, when)
        self.relaunch_s: dict[str, list[float]] = {"learner": [], "run": []}
        self.samples = 0
        self.reniced: set[int] = set()

    def renice(self, pid: int) -> None:
        """Every thread of ``pid`` to ``LEARNER_NICE`` (Linux niceness is per thread; threads it starts
        later inherit it)."""
        if pid in self.reniced:
            return
        self.reniced.add(pid)
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            return
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, LEARNER_NICE)
            except OSError:
                pass  # exited meanwhile

    def killed(self, holder: str | None, incarnation: int, at: float) -> None:
        with self.lock:
            self.pending.append((holder, incarnation, at))

    def run(self) -> None:
        while not self.stop.wait(1.0):
            for lid in self.learners:
                try:
                    n = len(live_copies(self.store, lid, self.marker))
                    live = alive(self.store, lid)
                except Exception:  # noqa: BLE001 - a flaky read is not a finding
                    continue
                self.worst[lid] = max(self.worst[lid], n)
                if live is not None and live.lease is not None:
                    self.renice(live.lease.pid)
            self.samples += 1
            with self.lock:
                pending = list(self.pending)
            for item in pending:
                holder, inc, at = item
                try:
                    back = alive(self.store, holder, newer_than=inc)
                except Exception:  # noqa: BLE001
                    continue
                if back is not None:
                    with self.lock:
                        self.pending.remove(item)
                        self.relaunch_s["learner" if holder else "run"].append(time.time() - at)


# -- one mode -----------------------------------------------------------------------------------------

@dataclass
class ModeResult:
    name: str
    wall_s: float
    rounds: int
    lost: int
    duplicated: int
    chain_ok: bool
    problems: list[str]
    worst_copies: int
    learner_kills: int
    run_kills: int
    run_kills_before_commit: int
    skipped: int
    relaunch_s: dict[str, list[float]]
    not_back: int
    goodput_wall: float
    work_share: float | None
    """The merged-work share: merged training over training run."""
    faults: dict[str, int]
    timeline: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds since the first commit, contributors, cumulative goodput) per round."""
    contributors: float = 0.0
    goodput: float | None = None
    """The paper's goodput: time in useful training steps over time available."""
    unrecorded: int = 0
    """Committed rounds with no Completed round flow run (a person could not open them in the UI)."""


class MotoProcess:
    """moto's S3 server in a process of its own: in this one it would share a GIL with the watcher
    (which reads every learner's lease and heartbeat each second), and every object-store call of
    the run would wait for that."""

    def __init__(self) -> None:
        import subprocess
        import urllib.request

        from atoll.ops.procs import free_port

        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, str(MOTO_S3), "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's server did not start on {self.endpoint}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def moto_server() -> tuple[Any, str]:
    import boto3

    server = MotoProcess()
    boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return server, server.endpoint


def s3_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1"}


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def make_run(url: str, storage_options: dict[str, Any], *, learners: int, lockstep: bool) -> tuple[Any, Any]:
    from atoll.core.config import DilocoConfig
    from atoll.train.recipe import LearnerSpec, smoke_recipe
    from atoll.train.run import create_run

    _, recipe = smoke_recipe(learners, max_rounds=10**6)
    # Micro GPT, P = 2, H = 8: a fragment every 4 steps per learner; the cpu-slow pool's learners
    # take 1.5x longer per step (older chips). Lock-step: every round waits for all M, no grace.
    config = DilocoConfig(num_learners=learners, num_fragments=2, inner_steps=8, overlap_steps=1,
                          min_quorum=learners if lockstep else 1, initial_grace_s=0.5,
                          grace_factor=0.0 if lockstep else 0.5)
    specs = [LearnerSpec(learner_id=f"learner-{i}", batch_size=4, pool=POOLS[i % 2],
                         slowdown=3.0 if i % 2 else 2.0) for i in range(learners)]
    recipe = dataclasses.replace(recipe, learners=tuple(specs), eval_every_rounds=10**6)
    create_run(url, config, recipe, storage_options=storage_options)
    return config, recipe


def run_mode(name: str, *, lockstep: bool, schedule: list[Kill], args: argparse.Namespace, endpoint: str,
             root: Path, log: Callable[[str], None]) -> ModeResult:
    from prefect.client.orchestration import get_client

    from atoll.ops.deploy import deploy_all, start_supervisor, start_training
    from atoll.ops.stack import LocalStack
    from atoll.runs.options import FleetOptions, TrainingRunOptions
    from atoll.storage import SynchronizerStore
    from atoll.storage.liveness import FAULT_ARMED_ENV, FAULT_HOLD_ENV, FAULT_SIGNAL_DIR_ENV
    from atoll.storage.store import StorageFaults
    from atoll.tasks.queries import read_flow_runs_paged, run_tag

    marker = uuid.uuid4().hex
    run_id = f"chaos-{'lockstep' if lockstep else 'decoupled'}-{marker[:6]}"
    url = f"s3://{BUCKET}/{run_id}"
    options = s3_options(endpoint)
    make_run(url, options, learners=args.learners, lockstep=lockstep)
    store = SynchronizerStore.open(url, options)  # it marks the run stopped at the end
    learner_ids = [f"learner-{i}" for i in range(args.learners)]
    slug = "lockstep" if lockstep else "decoupled"
    fault_dir = root / f"{slug}-faults"
    fault_dir.mkdir(parents=True)
    env = {**s3_env(endpoint), MARKER_VAR: marker,
           FAULT_HOLD_ENV: "30", FAULT_SIGNAL_DIR_ENV: str(fault_dir), FAULT_ARMED_ENV: "1"}
    if args.storage_faults:
        env[StorageFaults.ENV] = args.storage_faults
    stack = LocalStack(home=root / f"{slug}-prefect", pools=POOLS, log_dir=root / f"{slug}-logs", env=env)
    watcher = Watcher(store, learner_ids, marker)
    kills = {"learner": 0, "run": 0, "run-before-commit": 0, "skipped": 0}
    t0 = t_end = 0.0
    try:
        stack.start()
        with stack.settings():
            deploy_all(POOLS, env=env, supervisor_interval_s=None)
            start_supervisor(parameters={"check_every_s": 2.0, "lifetime_s": args.minutes * 60 + 600,
                                         "relaunch_backoff_s": 1.0, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                                         "max_relaunches": 10**6})
            fleet = FleetOptions(watch_every_s=2.0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, relaunch_backoff_s=1.0,
                                 startup_grace_s=120.0, max_launches=10**6)
            start_training(TrainingRunOptions(run_url=url, fleet=fleet, record_rounds=args.record_rounds),
                           tags=[run_tag(run_id)])
            deadline = time.monotonic() + 300
            while store.latest_round() < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: no round committed in 300 s; logs in {stack.log_dir}")
                time.sleep(1.0)
            t0 = time.time()
            log(f"{name}: first round committed; soak of {args.minutes:g} min with {len(schedule)} kills")
            watcher.start()
            rng = random.Random(args.seed + 1)
            for k in schedule:
                time.sleep(max(0.0, t0 + k.at_s - time.time()))
                if k.kind == "learner":
                    order = [learner_ids[k.target]] + rng.sample(learner_ids, len(learner_ids))
                    target = next((lid for lid in order if alive(store, lid) is not None), None)
                    live = alive(store, target) if target else None
                    if live is None or not _kill(live.lease.pid):
                        kills["skipped"] += 1
                        continue
                    watcher.killed(target, live.incarnation, time.time())
                    kills["learner"] += 1
                else:
                    live = alive(store, None)
                    if live is None:
                        kills["skipped"] += 1
                        continue
                    pid, before_commit = live.lease.pid, False
                    if k.kind == "run-before-commit":
                        seen = set(fault_dir.glob("payloads-written-*"))
                        (fault_dir / "arm").write_text("")
                        held = _wait(lambda seen=seen: set(fault_dir.glob("payloads-written-*")) - seen, 20.0)
                        if held:
                            path = sorted(held)[0]
                            pid, before_commit = int(path.read_text().strip() or pid), True
                        else:  # no commit armed in 20 s (rounds stalled): kill anywhere
                            (fault_dir / "arm").unlink(missing_ok=True)
                    if not _kill(pid):
                        kills["skipped"] += 1
                        continue
                    watcher.killed(None, live.incarnation, time.time())
                    kills["run-before-commit" if before_commit else "run"] += 1
                log(f"{name}: t+{time.time() - t0:6.0f}s {k.kind} kill; round {store.latest_round()}")
            time.sleep(max(0.0, t0 + args.minutes * 60 - time.time()))
            t_end = time.time()
            (fault_dir / "arm").unlink(missing_ok=True)
            store.mark_stopped("chaos soak over", by="benchmarks/chaos.py")
            log(f"{name}: soak over at round {store.latest_round()}; stopping the run")
            _wait(lambda: all(alive(store, lid) is None for lid in learner_ids), 60.0)
            # The training run records its last rounds before it exits (its recorder drains first).
            _wait(lambda: alive(store, None) is None, 90.0)
            watcher.stop.set()
            watcher.join(timeout=10)
            with get_client(sync_client=True) as client:
                completed: dict[str, int] = {}
                for fr in read_flow_runs_paged(client, flow_names=["atoll-round"], tags=[run_tag(run_id)]):
                    if fr.state is not None and fr.state.is_completed():
                        completed[fr.name] = completed.get(fr.name, 0) + 1
    finally:
        watcher.stop.set()
        _tear_down(stack, marker)
    result = analyse(name, store, watcher, kills, completed, t0, t_end, fault_dir, args)
    try:
        drop_prefix(endpoint, run_id)
    except Exception as e:  # noqa: BLE001 - the mode's results are in hand; memory is the next mode's problem
        log(f"{name}: could not delete the run's objects: {e!r}")
    return result


def drop_prefix(endpoint: str, prefix: str) -> None:
    """Delete a measured mode's objects: moto keeps every object in this process's memory (~0.3 GB a
    minute at 6 learners), and the next mode shares the server."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


def analyse(name: str, store: Any, watcher: Watcher, kills: dict[str, int], completed: dict[str, int],
            t0: float, t_end: float, fault_dir: Path, args: argparse.Namespace) -> ModeResult:
    from atoll.runs.goodput import GoodputTracker
    from atoll.runs.names import round_flow_name

    report = store.verify()
    latest = report.latest
    history = store.history(1, latest)
    rounds = [rec.round for rec in history]
    lost = len(set(range(1, latest + 1)) - set(rounds))
    tracker = GoodputTracker(store)
    timeline = []
    m = args.learners
    for rec in history:
        tracker.add([rec])
        useful = tracker.report().merged_s
        elapsed = max(1e-9, rec.created_at - t0)
        timeline.append((rec.created_at - t0, len(rec.accepted), useful / (m * elapsed) if rec.created_at > t0 else 0.0))
    final = tracker.report()
    in_soak = [t for t in timeline if 0 < t[0] <= t_end - t0]
    useful_in_soak = final.merged_s
    return ModeResult(
        name=name, wall_s=t_end - t0, rounds=latest, lost=lost,
        duplicated=sum(1 for n in completed.values() if n > 1), chain_ok=report.ok,
        problems=[str(p) for p in report.problems][:5], worst_copies=max(watcher.worst.values(), default=0),
        learner_kills=kills["learner"], run_kills=kills["run"] + kills["run-before-commit"],
        run_kills_before_commit=kills["run-before-commit"], skipped=kills["skipped"],
        relaunch_s=watcher.relaunch_s, not_back=len(watcher.pending),
        goodput_wall=useful_in_soak / (m * max(1e-9, t_end - t0)), work_share=final.merged_share, goodput=final.goodput,
        faults=_fault_counts(fault_dir), timeline=timeline,
        contributors=statistics.mean(c for _, c, _ in in_soak) if in_soak else 0.0,
        unrecorded=sum(1 for r in range(1, latest + 1) if round_flow_name(r) not in completed))


def _fault_counts(fault_dir: Path) -> dict[str, int]:
    return {"held commits": len(list(fault_dir.glob("payloads-written-*")))}


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _wait(cond: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    return None


def _tear_down(stack: Any, marker: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    try:
        with stack.settings(), get_client(sync_client=True) as client:
            for fr in client.read_flow_runs(limit=200):
                if fr.state is not None and not fr.state.is_final():
                    client.set_flow_run_state(fr.id, Cancelling(), force=True)
    except Exception:  # noqa: BLE001 - the server may be gone; the sweep below still runs
        pass
    stack.stop()
    for pid in processes_with(marker):
        _kill(pid)


# -- report ---------------------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    return f"{s[min(len(s) - 1, round(q * (len(s) - 1)))]:.1f}"


def table(results: list[ModeResult]) -> str:
    rows: list[tuple[str, Callable[[ModeResult], str], str]] = [
        ("soak wall time from the first commit (s)", lambda r: f"{r.wall_s:.0f}", ""),
        ("rounds committed", lambda r: str(r.rounds), ">= 300"),
        ("rounds lost (gaps in the chain)", lambda r: str(r.lost), "0"),
        ("rounds duplicated (>1 Completed round flow run)", lambda r: str(r.duplicated), "0"),
        ("committed rounds with no Completed flow run", lambda r: str(r.unrecorded), "0"),
        ("commit chain verifies", lambda r: "yes" if r.chain_ok else f"NO: {r.problems}", "yes"),
        ("duplicate live learner copies (worst)", lambda r: str(max(0, r.worst_copies - 1)), "0"),
        ("learner SIGKILLs", lambda r: str(r.learner_kills), ">= 100"),
        ("training-run SIGKILLs (before a commit)", lambda r: f"{r.run_kills} ({r.run_kills_before_commit})", ">= 10"),
        ("kills skipped (target already down)", lambda r: str(r.skipped), ""),
        ("learner relaunch s, p50 / p95", lambda r: f"{pct(r.relaunch_s['learner'], .5)} / "
                                                    f"{pct(r.relaunch_s['learner'], .95)}", ""),
        ("training-run relaunch s, p50 / p95", lambda r: f"{pct(r.relaunch_s['run'], .5)} / "
                                                         f"{pct(r.relaunch_s['run'], .95)}", ""),
        ("killed and never back by the end", lambda r: str(r.not_back), "0"),
        ("contributors per round (mean)", lambda r: f"{r.contributors:.2f}", ""),
        ("goodput (paper): useful training s / available", lambda r: "-" if r.goodput is None
         else f"{100 * r.goodput:.1f}%", ""),
        ("merged-work share: merged / trained", lambda r: "-" if r.work_share is None
         else f"{100 * r.work_share:.1f}%", ""),
        ("merged learner-s / wall learner-s", lambda r: f"{100 * r.goodput_wall:.1f}%", ""),
        ("commits held for a kill", lambda r: str(r.faults.get("held commits", 0)), ""),
    ]
    head = f"{'measure':<50}" + "".join(f"{r.name:>22}" for r in results) + f"{'goal':>10}"
    lines = [head, "-" * len(head)]
    for label, cell, goal in rows:
        lines.append(f"{label:<50}" + "".join(f"{cell(r):>22}" for r in results) + f"{goal:>10}")
    return "\n".join(lines)


def plot(results: list[ModeResult], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for r in results:
        # Goodput so far is useful over available learner time: over the first seconds that window
        # is nearly empty and the ratio meaningless (thousands of percent), so the line starts later.
        late = [(t, g) for t, _, g in r.timeline if t >= PLOT_GOODPUT_AFTER_S]
        a.plot([t for t, _ in late], [g * 100 for _, g in late], label=r.name)
        b.plot([t for t, _, _ in r.timeline if t > 0], [c for t, c, _ in r.timeline if t > 0], ".", ms=2,
               label=r.name, alpha=0.6)
    a.set_ylim(0, 100)
    a.set_ylabel(f"merged learner-s / wall (%, from t = {PLOT_GOODPUT_AFTER_S:g} s)")
    a.set_title("chaos soak: merged work and contributors per round (same kill schedule)")
    a.legend()
    b.set_ylabel("contributors merged")
    b.set_xlabel("seconds since the first commit")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "chaos.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=12.0, help="soak length of each mode (wall time)")
    p.add_argument("--learners", type=int, default=4, help="M (two pools, half each)")
    p.add_argument("--learner-kills", type=int, default=100)
    p.add_argument("--run-kills", type=int, default=10, help="training-run SIGKILLs (half before a commit)")
    p.add_argument("--storage-faults", default="error=0.01,lost=0.005,latency_s=0.02",
                   help="ATOLL_FAULT_STORAGE for every process of the run ('' = none)")
    p.add_argument("--modes", default="decoupled,lockstep", help="decoupled (K = 1 + grace), lockstep (K = M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record-rounds", action=argparse.BooleanOptionalAction, default=True,
                   help="record_rounds (the product's default): rounds run inline, each one's flow run opened "
                        "Running as it opens and completed as it commits; --no-record-rounds: each round a flow run executed by Prefect's engine")
    p.add_argument("--quick", action="store_true", help="3 minutes, 12 learner kills, 2 training-run kills")
    p.add_argument("--out", default="out")
    p.add_argument("--replot", default=None, metavar="CHAOS_JSON",
                   help="only redraw chaos.png (under --out) from a chaos.json this script wrote")
    args = p.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        print(f"plot: {plot([ModeResult(**r) for r in saved], Path(args.out))}")
        return 0
    if args.quick:
        args.minutes, args.learner_kills, args.run_kills = 3.0, 12, 2
    schedule = kill_schedule(args.seed, minutes=args.minutes, learners=args.learners,
                             learner_kills=args.learner_kills, run_kills=args.run_kills)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("decoupled", "lockstep"):
            raise SystemExit(f"--modes: unknown mode {mode!r} (decoupled, lockstep)")
    out = Path(args.out)
    server, endpoint = moto_server()
    results = []
    failed: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="atoll-chaos-") as tmp:
            for mode in modes:
                name = "K=1+grace" if mode == "decoupled" else "lock-step K=M"
                try:
                    results.append(run_mode(name, lockstep=mode == "lockstep", schedule=schedule, args=args,
                                            endpoint=endpoint, root=Path(tmp), log=lambda s: print(s, flush=True)))
                    out.mkdir(parents=True, exist_ok=True)  # each mode's results as soon as it has them
                    (out / "chaos.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
                    print(table(results), flush=True)
                except Exception as e:  # noqa: BLE001 - one mode failing must not lose the other's results
                    # Keep that mode's logs (the temporary folder goes away) and go on.
                    kept = out / f"chaos-{mode}-logs"
                    shutil.rmtree(kept, ignore_errors=True)
                    logs = Path(tmp) / f"{mode}-logs"
                    if logs.exists():
                        shutil.copytree(logs, kept)
                    print(f"{name}: FAILED: {e!r}; its logs: {kept}", flush=True)
                    failed.append(name)
    finally:
        server.stop()
    if not results:
        return 1
    print()
    print(f"M = {args.learners} learners on {len(POOLS)} pools (cpu-slow 1.5x slower), micro GPT, P = 2, H = 8; "
          f"storage faults: {args.storage_faults or 'none'}; seed {args.seed}")
    print(table(results))
    if failed:
        print(f"failed (no results): {', '.join(failed)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    print(f"plot: {plot(results, out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
