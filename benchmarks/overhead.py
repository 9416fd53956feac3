"""Orchestration overhead: the same tiny-preset run through Prefect and through the plain local runner.

    python benchmarks/overhead.py [--rounds 48] [--learners 4] [--out out/] [--prefect sqlite,sqlite-recorded]
                                  [--repeat 3] [--pin]

Side by side on this machine (plain first, then each Prefect variant, same preset, same rounds):

* **plain**: ``atoll.train`` only: M learner processes and the synchronizer loop in this process;
* **prefect**: a local Prefect server (SQLite, or a private PostgreSQL cluster), a process worker
  per pool, atoll's deployments, the training-run flow (one round flow run per round with two
  tasks; ``-nested``: as subflows; ``-recorded``: rounds run inline and their flow runs opened
  Running by the recorder as each round opens and completed as it commits; artifacts from the recorder) and M learner flow
  runs on the two pools.

Reported, from the bucket (learner side) and from timers / Prefect task runs (synchronizer side):

* learner tokens/s: sum over learners of (tokens between their first and last contribution after
  warm-up) / (time between them): the learners' own speed, which orchestration must not slow down
  (target: prefect >= 0.97x plain);
* the effective H next to the configured H: the mean steps since a learner's last sync of a
  fragment when that fragment's contribution is merged (the contributions table's ``steps``); a
  synchronizer that keeps up makes it H, one that falls behind lets it grow (target: within 10%);
* the round wall time (commit to commit) split into waiting for the quorum + grace window, merge +
  storage (load deltas, merge, outer step, write the new fragment and the commit record, evaluate),
  and orchestration (everything else: flow/task run bookkeeping, artifacts, the loop);
* where the machine's CPU went over the same window, in cores, by role (learners, synchronizer or
  training run, Prefect server, workers, database), from /proc: on a machine with fewer cores than
  processes, every core the control plane takes is a core the learners do not get;
* what crossed the wire per round and per token after warm-up, from the commit records (learners'
  own reports and the synchronizer's counts, ``atoll.runs.traffic.WireTracker``), with the
  planner's figure for the same run beside it (``atoll.sim.planner.plan_wire``).

Prints a table and writes ``overhead.png`` under ``--out``. Learner speed on a small shared VM
moves by +-10% from one run to the next, plain runner included, so ``--repeat N`` runs the whole
sequence N times (plain, then each variant, alternating) and reports each repetition's ratio to
the plain run just before it and their median.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

from atoll.runs.goodput import GoodputTracker  # noqa: E402
from atoll.runs.manage import prepare_run  # noqa: E402
from atoll.runs.traffic import WireTracker  # noqa: E402
from atoll.sim.planner import WirePlan, plan_wire  # noqa: E402
from atoll.storage.paths import to_url  # noqa: E402
from atoll.storage.reader import RunReader  # noqa: E402
from atoll.storage.synchronizer_side import SynchronizerStore  # noqa: E402
from atoll.storage.wire import WireCounts  # noqa: E402
from atoll.train.evaluator import Evaluator  # noqa: E402
from atoll.train.local import LocalRun  # noqa: E402
from atoll.train.run import load_recipe  # noqa: E402
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions  # noqa: E402

WARMUP_ROUNDS = 5
PIN = False
"""``--pin``: learners on CPU 0, the control plane on the others (:class:`CpuSampler`)."""
ROLES = ("learners", "synchronizer", "Prefect server", "workers", "database", "other")


def _role(pid: int, cmdline: str, holders: dict[int, str] | None = None) -> str:
    if holders and pid in holders:
        return holders[pid]
    if pid == os.getpid():
        return "synchronizer"  # the plain runner's loop (under Prefect this process only follows)
    if "prefect server" in cmdline or "uvicorn" in cmdline:
        return "Prefect server"
    if "prefect worker" in cmdline:
        return "workers"
    if "postgres" in cmdline:
        return "database"
    if "atoll.train.local" in cmdline:
        return "learners"
    if "prefect.engine" in cmdline:
        return "synchronizer"  # a flow run no lease names: the training run before it takes its lease
    return "other"


def lease_holders(store: RunReader, learner_ids: list[str]) -> dict[int, str]:
    """Pids the bucket's newest leases name: each learner's process, and the synchronizer's (the
    training run under Prefect). Both run as ``python -m prefect.engine`` there."""
    out = {live.lease.pid: "learners" for live in store.learners_liveness(learner_ids).values()
           if live.lease is not None}
    sync = store.synchronizer_liveness()
    if sync.lease is not None:
        out[sync.lease.pid] = "synchronizer"
    return out


class CpuSampler:
    """CPU seconds of this process and all its descendants, by role, sampled every ``every_s`` (Linux
    /proc; elsewhere it records nothing). :meth:`cores` turns a window into cores used per role."""

    def __init__(self, every_s: float = 1.0, holders: Callable[[], dict[int, str]] | None = None,
                 pin: bool = False) -> None:
        """``pin``: also pin each process by role, learners to CPU 0 and everything else (server,
        workers, training run or the plain runner's synchronizer) to the other CPUs, as a fleet
        whose control plane runs on machines of its own (checked every ``every_s``)."""
        self.every_s = every_s
        self.holders = holders
        self.pin = pin and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> dict[int, tuple[str, float]]:
        from atoll.ops.procs import descendants

        out: dict[int, tuple[str, float]] = {}
        holders: dict[int, str] = {}
        if self.holders is not None:
            with contextlib.suppress(Exception):  # no run yet, or a read raced a write
                holders = self.holders()
        for pid in [os.getpid(), *descendants(os.getpid())]:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError):
                continue
            out[pid] = (_role(pid, cmd, holders), (int(stat[11]) + int(stat[12])) / self._tick)  # utime + stime
            if self.pin:
                self._pin(pid, out[pid][0])
        return out

    def _pin(self, pid: int, role: str) -> None:
        cpus = {0} if role == "learners" else set(range(1, os.cpu_count() or 2))
        with contextlib.suppress(OSError):  # gone meanwhile
            # Every thread: setaffinity on a pid moves only its main thread.
            for tid in os.listdir(f"/proc/{pid}/task"):
                if os.sched_getaffinity(int(tid)) != cpus:
                    os.sched_setaffinity(int(tid), cpus)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._sample()))
            self._stop.wait(self.every_s)

    def cores(self, t0: float, t1: float) -> dict[str, float]:
        """Cores used per role between wall times ``t0`` and ``t1``: for each process, its CPU time as
        last seen by ``t1`` less that as last seen by ``t0`` (0 if it started later). A process that
        exits inside the window loses at most its last ``every_s`` of CPU."""
        before: dict[int, tuple[str, float]] = {}
        after: dict[int, tuple[str, float]] = {}
        for t, sample in self.samples:
            if t <= t0:
                before.update(sample)
            if t <= t1:
                after.update(sample)
        used = dict.fromkeys(ROLES, 0.0)
        for pid, (role, cpu) in after.items():
            used[role] += max(0.0, cpu - before.get(pid, (role, 0.0))[1])
        return {role: v / max(t1 - t0, 1e-9) for role, v in used.items()}


@dataclass
class Result:
    name: str
    rounds: int
    wall_s: float
    tokens_per_s: float
    round_s: float
    wait_s: float
    close_s: float
    h: int = 0
    """Configured H (inner steps between two syncs of a fragment)."""
    eff_h: float = 0.0
    """Effective H: mean steps since last sync of the merged contributions, after warm-up."""
    cores: dict[str, float] = field(default_factory=dict)
    """Cores used per role (``ROLES``) between the warm-up round's commit and the last commit."""
    wire: WireFigures | None = None
    """What crossed the wire after warm-up, and the planner's figure."""

    @property
    def orchestration_s(self) -> float:
        return max(0.0, self.round_s - self.wait_s - self.close_s)


@dataclass(frozen=True)
class WireFigures:
    """Traffic of the rounds after warm-up, from the commit records, and the plan for the run."""

    rounds: int
    learners: WireCounts
    """All learners together, as they report it."""
    synchronizer: WireCounts
    learner_tokens: int
    """Tokens the learners trained over the same spans."""
    planned: WirePlan

    def per_token(self, counts: WireCounts) -> float:
        return counts.bytes_total / self.learner_tokens if self.learner_tokens else float("nan")


def wire_figures(store: RunReader) -> WireFigures:
    """The learners' and the synchronizer's traffic in the rounds after warm-up, and
    :func:`~atoll.sim.planner.plan_wire` for this run (tokens per step from the merged counters)."""
    tracker = WireTracker()
    records = store.history(1, store.latest_round())
    for rec in records:
        tracker.add(rec)
    after = [w for r, w in tracker.rounds.items() if r > WARMUP_ROUNDS]
    per_step = [a.c_tokens / a.c_steps for rec in records for a in rec.accepted if a.c_steps]
    shapes = [s for p in range(store.plan.num_fragments) for s in store.manifest.fragment_shapes(p).values()]
    params = sum(math.prod(s) for s in shapes)
    recipe = load_recipe(store)
    planned = plan_wire(store.config, params=params, tensors=len(shapes),
                        tokens_per_step=round(statistics.median(per_step)) if per_step else 1,
                        save_every_steps=recipe.save_every_steps, save_uplink_share=recipe.save_uplink_share,
                        save_moments=recipe.save_moments_dtype)
    return WireFigures(rounds=len(after), learners=sum((w.learners for w in after), WireCounts()),
                       synchronizer=sum((w.synchronizer for w in after), WireCounts()),
                       learner_tokens=sum(w.learner_tokens for w in after), planned=planned)


def learner_tokens_per_s(store: RunReader) -> float:
    """Sum over learners of their training speed, from their contribution records after warm-up."""
    latest = store.latest_round()
    tracker = GoodputTracker(store)
    records = store.history(1, latest)
    tracker.add(records)
    t_warm = records[min(WARMUP_ROUNDS, len(records) - 1)].created_at
    tokens_per_step: dict[str, float] = {}
    for rec in records:
        for a in rec.accepted:
            if a.c_steps:
                tokens_per_step[a.learner_id] = a.c_tokens / a.c_steps
    total = 0.0
    for lid, work in tracker.learners.items():
        events = sorted((t, s) for t, s in work.events if t >= t_warm)
        if len(events) < 2 or events[-1][0] <= events[0][0] or lid not in tokens_per_step:
            continue
        # Only the longest run without a restart (the step counter never goes back).
        steps = events[-1][1] - events[0][1]
        if steps <= 0:
            continue
        total += steps * tokens_per_step[lid] / (events[-1][0] - events[0][0])
    return total


def effective_h(store: RunReader) -> tuple[int, float]:
    """Configured H and the effective H: the mean over merged contributions after warm-up of the
    steps since the learner's last sync of that fragment (``c_steps``; the contributions table's
    ``steps``). A synchronizer that keeps up merges each fragment every H steps of a learner."""
    records = store.history(1, store.latest_round())[WARMUP_ROUNDS:]
    steps = [a.c_steps for r in records for a in r.accepted if a.c_steps > 0]
    return store.config.inner_steps, (statistics.mean(steps) if steps else float("nan"))


def measured_window(store: RunReader) -> tuple[float, float]:
    """Wall times of the warm-up round's commit and the last commit: the window every figure covers."""
    records = store.history(1, store.latest_round())
    return records[min(WARMUP_ROUNDS, len(records) - 1)].created_at, records[-1].created_at


def round_intervals(store: RunReader) -> tuple[float, float, list[int]]:
    """Median commit-to-commit time and median quorum wait after warm-up; the rounds measured."""
    records = store.history(1, store.latest_round())[WARMUP_ROUNDS:]
    gaps = [b.created_at - a.created_at for a, b in zip(records, records[1:], strict=False)]
    waits = [float(r.stats.get("wait_s", 0.0)) for r in records[1:]]
    return statistics.median(gaps), statistics.median(waits), [r.round for r in records[1:]]


def run_plain(bucket: Path, preset: str, learners: int, rounds: int) -> Result:
    url = to_url(str(bucket / "plain"))
    info = prepare_run(url, preset=preset, learners=learners, rounds=rounds)
    t0 = time.monotonic()
    closes: dict[int, float] = {}
    with CpuSampler(pin=PIN) as cpu, LocalRun(url, log_dir=bucket / "plain-logs", threads=1) as run:
        for spec in info.learners:
            run.start_learner(spec["learner_id"])
        store = SynchronizerStore.open(url)
        sync = Synchronizer(store, options=SynchronizerOptions())
        evaluator = Evaluator(store, log=lambda _: None).start()  # as the training run's: a thread
        while not sync.finished:
            polled = sync.poll()
            if isinstance(polled, RoundSummary):
                continue
            if not polled.decision.close:
                wait = (polled.decision.recheck_at_s or 0) - sync.clock()
                time.sleep(min(max(wait, 0.005), sync.options.poll_interval_s))
                continue
            t = time.perf_counter()
            sync.close(polled)
            closes[polled.round] = time.perf_counter() - t
            evaluator.committed(polled.round)
        evaluator.close(final_round=sync.round)
    wall = time.monotonic() - t0
    store = RunReader.open(url)
    round_s, wait_s, measured = round_intervals(store)
    return Result("plain (atoll.train)", store.latest_round(), wall, learner_tokens_per_s(store), round_s, wait_s,
                  statistics.median(closes[r] for r in measured if r in closes), *effective_h(store),
                  cores=cpu.cores(*measured_window(store)), wire=wire_figures(store))


def run_prefect(bucket: Path, preset: str, learners: int, rounds: int, *, database: str = "sqlite",
                nest_rounds: bool = False, record_rounds: bool = False) -> Result:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, TaskRunFilter, TaskRunFilterName

    from atoll.ops.client import follow
    from atoll.ops.deploy import deploy_all, start_training
    from atoll.ops.stack import LocalStack
    from atoll.runs.options import TrainingRunOptions
    from atoll.tasks.queries import run_tag

    name = f"prefect-{database}" + ("-nested" if nest_rounds else "") + ("-recorded" if record_rounds else "")
    url = to_url(str(bucket / name))
    info = prepare_run(url, preset=preset, learners=learners, rounds=rounds)
    stack = LocalStack(home=bucket / f"{name}-home", log_dir=bucket / f"{name}-logs", database=database)
    ids = [spec["learner_id"] for spec in info.learners]
    leases = RunReader.open(url)  # one handle: the sampler reads the leases through it every second
    cpu = CpuSampler(holders=lambda: lease_holders(leases, ids), pin=PIN)
    try:
        stack.start()
        with stack.settings(), cpu:
            deploy_all(stack.pools)
            t0 = time.monotonic()
            fr = start_training(TrainingRunOptions(run_url=url, nest_rounds=nest_rounds, record_rounds=record_rounds))
            state, _ = follow(fr.id, url, every_s=30.0)
            wall = time.monotonic() - t0
            if state != "Completed":
                raise RuntimeError(f"training run ended {state}; logs in {stack.log_dir}")
            store = RunReader.open(url)
            round_s, wait_s, measured = round_intervals(store)
            rounds_filter = FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(info.run_id), "atoll-round"]))
            tasks, runs = [], []
            with get_client(sync_client=True) as client:
                while batch := client.read_task_runs(
                        flow_run_filter=rounds_filter, limit=200, offset=len(tasks),
                        task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="merge-and-commit"))):
                    tasks += batch
                while batch := client.read_flow_runs(flow_run_filter=rounds_filter, limit=200, offset=len(runs)):
                    runs += batch
            round_of = {r.id: int(r.name.split("-")[1]) for r in runs}
            closes = {round_of[t.flow_run_id]: t.total_run_time.total_seconds() for t in tasks
                      if t.flow_run_id in round_of}
            if record_rounds:  # no task runs: the synchronizer's own merge + commit timing (an EMA)
                closes = {rec.round: float((rec.timings or {}).get("sync_s") or 0.0)
                          for rec in store.history(1, store.latest_round())}
    finally:
        stack.stop()
    label = f"prefect {database}" + (" nested" if nest_rounds else "") + (" recorded" if record_rounds else "")
    return Result(label, store.latest_round(), wall, learner_tokens_per_s(store), round_s, wait_s,
                  statistics.median(closes[r] for r in measured if r in closes), *effective_h(store),
                  cores=cpu.cores(*measured_window(store)), wire=wire_figures(store))


def table(results: list[Result]) -> str:
    base = results[0].tokens_per_s
    lines = [f"{'runner':<22}{'rounds':>7}{'wall s':>8}{'learner tok/s':>15}{'vs plain':>10}{'round s':>9}"
             f"{'quorum+grace':>14}{'merge+storage':>15}{'orchestration':>15}{'H':>4}{'eff. H':>8}{'eff/H':>7}"]

    def share(x: float, total: float) -> str:
        return f"{x:6.2f}s {100 * x / total:3.0f}%" if total else "-"

    for r in results:
        lines.append(f"{r.name:<22}{r.rounds:>7}{r.wall_s:>8.0f}{r.tokens_per_s:>15.0f}"
                     f"{r.tokens_per_s / base:>9.3f}x{r.round_s:>9.2f}{share(r.wait_s, r.round_s):>14}"
                     f"{share(r.close_s, r.round_s):>15}{share(r.orchestration_s, r.round_s):>15}"
                     f"{r.h:>4}{r.eff_h:>8.1f}{r.eff_h / r.h if r.h else float('nan'):>6.2f}x")
    return "\n".join(lines)


def summary_table(reps: list[list[Result]]) -> str:
    """Per variant over the repetitions: each one's throughput ratio to its own plain run, the
    median, and the median effective H; the learners' cores and tokens per learner core-second."""
    lines = [f"over {len(reps)} repetitions (each ratio against the plain run of the same repetition):",
             f"{'runner':<24}{'tok/s vs plain, each':>30}{'median':>8}{'eff. H, each':>20}{'median':>8}"
             f"{'learner cores':>15}{'tok per learner core-s vs plain':>33}"]
    for i, name in enumerate(r.name for r in reps[0]):
        rows = [rep[i] for rep in reps]
        ratios = [r.tokens_per_s / rep[0].tokens_per_s for r, rep in zip(rows, reps, strict=True)]
        per_core = [(r.tokens_per_s / max(1e-9, r.cores.get("learners", 0.0)))
                    / (rep[0].tokens_per_s / max(1e-9, rep[0].cores.get("learners", 0.0)))
                    for r, rep in zip(rows, reps, strict=True)]
        lines.append(f"{name:<24}{', '.join(f'{x:.3f}' for x in ratios):>30}{statistics.median(ratios):>7.3f}x"
                     f"{', '.join(f'{r.eff_h:.1f}' for r in rows):>20}{statistics.median(r.eff_h for r in rows):>8.1f}"
                     f"{statistics.median(r.cores.get('learners', 0.0) for r in rows):>15.2f}"
                     f"{statistics.median(per_core):>32.3f}x")
    return "\n".join(lines)


def wire_table(results: list[Result]) -> str:
    """Per runner, learners (all together) and synchronizer: requests, bytes up and down per round,
    bytes (up + down) per token trained, and the plan's bytes per token for the same run (the
    learners' with their inner-state saves)."""
    lines = [f"{'runner':<22}{'who':<14}{'req/round':>10}{'up/round':>12}{'down/round':>12}{'B/token':>10}"
             f"{'planned':>10}"]
    for r in results:
        w = r.wire
        if w is None or not w.rounds:
            continue
        plan = w.planned
        m = plan.learners
        tokens_per_round = m * plan.steps_per_round * plan.tokens_per_step
        rows = (("learners", w.learners, plan.up_bytes_per_token + plan.down_bytes_per_token + plan.save_bytes_per_token),
                ("synchronizer", w.synchronizer,
                 (plan.sync_up_bytes_per_round + plan.sync_down_bytes_per_round) / tokens_per_round))
        for who, c, planned_token in rows:
            lines.append(f"{r.name:<22}{who:<14}{c.requests / w.rounds:>10.1f}{c.bytes_up / w.rounds:>12,.0f}"
                         f"{c.bytes_down / w.rounds:>12,.0f}{w.per_token(c):>10.1f}{planned_token:>10.1f}")
    return "\n".join(lines)


def cpu_table(results: list[Result]) -> str:
    """Cores used per role over each runner's measured window (the machine has ``os.cpu_count()``)."""
    lines = [f"{'runner':<22}" + "".join(f"{role:>16}" for role in ROLES) + f"{'total':>8}"]
    for r in results:
        lines.append(f"{r.name:<22}" + "".join(f"{r.cores.get(role, 0.0):>16.2f}" for role in ROLES)
                     + f"{sum(r.cores.values()):>8.2f}")
    return "\n".join(lines)


def plot(results: list[Result], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(6 + 3 * len(results), 4))
    names = [r.name for r in results]
    colors = ["#888", "#2b6cb0", "#2f855a", "#b7791f", "#6b46c1"][:len(results)]
    a.bar(names, [r.tokens_per_s for r in results], color=colors)
    a.set_ylabel("learner tokens/s (all learners)")
    a.set_title("learner throughput")
    bottom = [0.0] * len(results)
    for label, vals, color in (("quorum + grace", [r.wait_s for r in results], "#9ae6b4"),
                               ("merge + storage", [r.close_s for r in results], "#f6ad55"),
                               ("orchestration", [r.orchestration_s for r in results], "#fc8181")):
        b.bar(names, vals, bottom=bottom, label=label, color=color)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    b.set_ylabel("seconds per round (median)")
    b.set_title("where a round's wall time goes")
    b.legend()
    c.bar(names, [r.eff_h for r in results], color=colors)
    if results and results[0].h:
        c.axhline(results[0].h, color="k", linestyle="--", label=f"configured H = {results[0].h}")
        c.axhline(1.1 * results[0].h, color="#c53030", linestyle=":", label="goal: within 10%")
        c.legend()
    c.set_ylabel("mean steps since last sync of a fragment")
    c.set_title("effective H")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "overhead.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--rounds", type=int, default=48)
    p.add_argument("--out", default="out")
    p.add_argument("--prefect", default="sqlite,sqlite-recorded",
                   help="comma-separated Prefect variants to run after the plain runner: sqlite, postgres "
                        "(the stack's database), each optionally with -nested (round flow runs as subflows) or "
                        "-recorded (record_rounds: rounds inline, their flow runs recorded as they open and commit)")
    p.add_argument("--keep", default=None, help="work in this folder (buckets, Prefect home, logs) and keep it")
    p.add_argument("--pin", action="store_true",
                   help="learners on CPU 0 and the control plane (server, workers, training run / synchronizer) on "
                        "the other CPUs, in every runner: what orchestration costs the learners themselves when the "
                        "control plane has machines of its own")
    p.add_argument("--repeat", type=int, default=1, help="run the whole sequence this many times, alternating")
    args = p.parse_args(argv)
    global PIN
    PIN = args.pin
    import torch

    torch.set_num_threads(1)  # like the plain runner's synchronizer process (and the training-run job)
    reps: list[list[Result]] = []
    for rep in range(args.repeat):
        with (tempfile.TemporaryDirectory(prefix="atoll-overhead-") if args.keep is None
              else contextlib.nullcontext(str(Path(args.keep).absolute() / f"rep-{rep}"))) as tmp:
            os.environ["PREFECT_HOME"] = str(Path(tmp) / "prefect-home")
            results = [run_plain(Path(tmp), args.preset, args.learners, args.rounds)]
            print(f"plain done in {results[0].wall_s:.0f}s", flush=True)
            for variant in args.prefect.split(","):
                database, _, mode = variant.strip().partition("-")
                results.append(run_prefect(Path(tmp), args.preset, args.learners, args.rounds, database=database,
                                           nest_rounds=mode == "nested", record_rounds=mode == "recorded"))
                print(f"{results[-1].name} done in {results[-1].wall_s:.0f}s", flush=True)
        reps.append(results)
        print()
        print(f"{args.preset} preset, {args.learners} learners, {args.rounds} rounds, {os.cpu_count()} CPUs"
              + ("; learners pinned to CPU 0, the control plane to the rest" if PIN else "")
              + (f"; repetition {rep + 1} of {args.repeat}" if args.repeat > 1 else "")
              + f"; medians after {WARMUP_ROUNDS} warm-up rounds")
        print(table(results))
        print()
        print(f"where the CPU went, in cores ({os.cpu_count()} on this machine), over the same window:")
        print(cpu_table(results))
        print()
        print("what crossed the wire per round after warm-up (bytes; B/token: up + down per token trained):")
        print(wire_table(results))
        for r in results[1:]:
            print(f"learner throughput, {r.name}: {r.tokens_per_s / results[0].tokens_per_s:.3f}x the plain runner "
                  "(target >= 0.97x)")
        for r in results:
            print(f"effective H, {r.name}: {r.eff_h:.1f} steps between syncs of a fragment for H = {r.h} "
                  f"({r.eff_h / r.h:.2f}x; target within 1.10x; {r.eff_h / results[0].eff_h:.2f}x the plain runner's)")
        print(flush=True)
    if args.repeat > 1:
        print(summary_table(reps))
    print(f"plot: {plot(reps[-1], Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
