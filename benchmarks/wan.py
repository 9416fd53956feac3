"""atoll against torchrun DDP across sites on shaped WAN links (benchmarks/wanlab.py), side by side.

    python benchmarks/wan.py                          # profiles unshaped, 1000, 100, 20 Mbit/s; kills
    python benchmarks/wan.py --quick                  # small budget, profiles 100 and 20, a short kill phase
    python benchmarks/wan.py --profiles 20 --no-kills # one profile
    python benchmarks/wan.py --outages                # partitions, a bucket and a Prefect outage, checked

Per link profile (every site's link shaped to the same rate both ways, one run each):

* **DDP**: ``benchmarks/wan_ddp.py`` under torchrun, one rank per site (gloo over the site's link),
  the recipe's model, data shards and AdamW, global batch = the learners' batches together, for
  ``--ddp-steps`` steps (the token budget). Its validation loss at the budget is the **target**.
* **atoll**: the same recipe as a run of ``--sites`` learners, one per site, the synchronizer in the
  cloud (``--engine prefect``: a Prefect server in the cloud and each site's process worker on its
  own pool, the learners flow runs of it; ``local``: ``python -m atoll.train.local`` processes),
  until its validation loss (the synchronizer's, every ``eval_every_rounds``) reaches the target,
  or ``--cap`` times DDP's time.

Reported per profile and system: time to the target (from launching the processes, start-up
included for both), tokens/s per site (tokens a site trained over the time it trained), bytes on
the wire per site (the kernel's counters of the site's interface: up and down), and link
utilisation (the busier direction's bytes over what the link could carry in that time). Then the
crossover (the bandwidth below which atoll reaches the target sooner) and a plot of time to
target against bandwidth (``wan.png``).

**Kills** (``--kill-profile``, default 100 Mbit/s): both systems train for ``--kill-minutes`` under
one seeded schedule of SIGKILLs of a site's learner / a site's DDP rank. atoll's killed learner is
relaunched (by the training run's fleet, or the local runner) and rejoins; DDP runs under torchrun's
elastic agent (``--max-restarts``), which restarts every rank from the newest checkpoint (every
``--ddp-checkpoint-every`` steps). **Goodput** (the paper's: time in useful training steps over the
time available): atoll's learner-seconds in useful training steps (atoll.runs.goodput.GoodputTracker:
not waiting, not down, not redoing steps lost to a kill) over sites x the window, with the
merged-work share (the part of that training the model kept) beside it; DDP's step time of the
steps that were kept (a step redone after a restart counts once) over the window. The window starts at the first training step.

Latency: the kernel here has no netem; ``--latency-ms`` adds atoll's storage fault hook's delay to
every object-store call of atoll's processes (DDP gets none: that only flatters DDP).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import wanlab  # noqa: E402

CONTROL_POOL = "cloud"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# -- what is trained ----------------------------------------------------------------------------------

def bench_run(sites: Sequence[str], args: argparse.Namespace) -> tuple[Any, Any]:
    """The demo preset with one learner per site (on the site's pool, all at full speed), its
    config's knobs as the flags set them."""
    from atoll.train.recipe import LearnerSpec, demo_recipe

    config, recipe = demo_recipe(len(sites))
    changes: dict[str, Any] = {}
    if args.inner_steps:
        changes["inner_steps"] = args.inner_steps
    if args.compression:
        changes["compression"] = args.compression
    if args.downlink_compression:
        changes["downlink_compression"] = args.downlink_compression
    config = dataclasses.replace(config, **changes)
    learners = tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=args.batch, pool=f"site-{s}")
                     for i, s in enumerate(sites))
    recipe = recipe.replace(learners=learners, max_rounds=10**6, eval_every_rounds=args.eval_every_rounds,
                            checkpoint_every_rounds=0)
    return config, recipe


# -- engines: how atoll's processes are run in the lab ------------------------------------------------

class LocalEngine:
    """``python -m atoll.train.local`` processes: the synchronizer in the cloud, a learner per site;
    a learner that exits is relaunched here (it rejoins from the bucket)."""

    name = "local"

    def __init__(self, lab: wanlab.Lab, moto: wanlab.Moto, env: dict[str, str]) -> None:
        self.lab, self.moto, self.env = lab, moto, env
        self.run: wanlab.LabRun | None = None

    def start(self, url: str, placement: dict[str, str]) -> None:
        self.run = wanlab.LabRun(self.lab, self.moto, url, placement, env=self.env,
                                 learner_args=("--heartbeat-interval-s", "2", "--log-every", "50")).start()

    def tick(self) -> None:
        assert self.run is not None
        self.run.restart_dead()

    def kill(self, learner_id: str, store: Any) -> bool:
        assert self.run is not None
        proc = self.run.learners.get(learner_id)
        if proc is None or proc.poll() is not None:
            return False
        self.run.kill(learner_id)
        return True

    def stop(self, store: Any) -> None:
        if self.run is not None:
            self.run.stop()
        self.run = None

    def close(self) -> None:
        pass


class PrefectEngine:
    """The product: a Prefect server in the cloud, a process worker per site on the site's pool (and
    one in the cloud for the training run); the training run launches each learner as a flow run
    on its site's pool and relaunches it when it dies."""

    name = "prefect"

    def __init__(self, lab: wanlab.Lab, moto: wanlab.Moto, env: dict[str, str], home: Path) -> None:
        from atoll.ops.deploy import deploy_all

        self.lab, self.moto, self.env = lab, moto, env
        pools = {f"site-{s.name}": s.name for s in lab.sites}
        self.stack = wanlab.LabStack(lab, {**pools, CONTROL_POOL: "cloud"}, home=home / "prefect",
                                     log_dir=lab.log_dir, site_env={w: moto.env(w) for w in [*pools.values(), "cloud"]})
        say("prefect: starting the server in the cloud and a worker per site ...")
        self.stack.start()
        with self.stack.settings():
            deploy_all(list(pools), control_pool=CONTROL_POOL, env={**env, **moto.env("cloud")},
                       pool_job_variables={p: {"env": {**env, **moto.env(site)}} for p, site in pools.items()},
                       supervisor_interval_s=None)
        self.flow_run: Any = None

    def start(self, url: str, placement: dict[str, str]) -> None:
        from atoll.ops.deploy import start_training
        from atoll.runs.options import FleetOptions, TrainingRunOptions

        fleet = FleetOptions(watch_every_s=2.0, heartbeat_timeout_s=30.0, relaunch_backoff_s=1.0,
                             startup_grace_s=180.0, max_launches=10**4)
        with self.stack.settings():
            self.flow_run = start_training(TrainingRunOptions(run_url=url, fleet=fleet))

    def tick(self) -> None:
        pass

    def kill(self, learner_id: str, store: Any) -> bool:
        live = store.learner_liveness(learner_id)
        if live.lease is None or live.exited_reason is not None:
            return False
        try:
            os.kill(live.lease.pid, 9)
            return True
        except ProcessLookupError:
            return False

    def stop(self, store: Any) -> None:
        """Mark the run stopped (learners and the training run exit by themselves), then cancel
        what is left."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        store.mark_stopped("benchmark over", by="benchmarks/wan.py")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(store.learner_liveness(lid).exited_reason is not None or store.learner_liveness(lid).lease is None
                   for lid in store.learner_ids()):
                break
            time.sleep(1.0)
        try:
            with self.stack.settings(), get_client(sync_client=True) as client:
                for fr in client.read_flow_runs(limit=200):
                    if fr.state is not None and not fr.state.is_final():
                        client.set_flow_run_state(fr.id, Cancelling(), force=True)
        except Exception as e:  # noqa: BLE001 - the lab's teardown kills what is left anyway
            say(f"prefect: could not cancel flow runs: {e!r}")
        time.sleep(5.0)

    def close(self) -> None:
        self.stack.stop()


# -- one system at one profile ---------------------------------------------------------------------

@dataclass
class SystemResult:
    system: str
    profile: str
    rate_mbit: float | None
    time_to_target_s: float | None
    """Seconds from launch until the validation loss first reached the target (None: not within the cap)."""
    final_loss: float | None
    wall_s: float
    tokens_s: dict[str, float] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    utilisation: dict[str, float | None] = field(default_factory=dict)
    curve: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since launch, validation loss)."""
    extra: dict[str, Any] = field(default_factory=dict)


def _traffic(lab: wanlab.Lab, before: dict[str, tuple[int, int]], wall_s: float,
             result: SystemResult) -> None:
    for site, (up0, down0) in before.items():
        up1, down1 = lab.counters(site)
        result.bytes_up[site], result.bytes_down[site] = up1 - up0, down1 - down0
        rate = lab.rates.get(site)
        busier = max(up1 - up0, down1 - down0)
        result.utilisation[site] = None if rate is None or wall_s <= 0 else busier * 8 / (rate * 1e6 * wall_s)


def run_ddp(lab: wanlab.Lab, recipe: Any, out: Path, args: argparse.Namespace, profile: str) -> SystemResult:
    sites = [s.name for s in lab.sites]
    before = {s: lab.counters(s) for s in sites}
    t_launch = time.time()
    ddp = wanlab.DDPRun(lab, sites, recipe, out, steps=args.ddp_steps,
                        eval_every=max(1, args.ddp_steps // args.ddp_evals)).start()
    ok = ddp.wait(args.ddp_timeout_s)
    ddp.stop()
    tl = ddp.timeline()
    if not ok or not any(e["kind"] == "done" for e in tl):
        raise RuntimeError(f"DDP at {profile} did not finish in {args.ddp_timeout_s:.0f}s\n{lab.log_tail(2000)}")
    evals = [e for e in tl if e["kind"] == "eval"]
    steps = [e for e in tl if e["kind"] == "step"]
    eval_s = 0.0
    curve = []
    for e in evals:  # evaluation is not training: the time before each point leaves earlier evals out
        curve.append((e["t"] - e["dur"] - t_launch - eval_s, float(e["val_loss"])))
        eval_s += e["dur"]
    start = next(e for e in tl if e["kind"] == "start")
    per_rank_tokens = start["tokens_per_step"] / len(sites)
    step_time = sum(e["dur"] for e in steps)
    result = SystemResult("DDP", profile, lab.rates[sites[0]], time_to_target_s=curve[-1][0],
                          final_loss=curve[-1][1], wall_s=curve[-1][0], curve=curve)
    result.tokens_s = {s: per_rank_tokens * len(steps) / step_time for s in sites}
    result.extra["step_s"] = step_time / len(steps)
    _traffic(lab, before, result.wall_s, result)
    return result


def run_atoll(lab: wanlab.Lab, engine: Any, store_of: Callable[[str], Any], config: Any, recipe: Any, target: float,
              cap_s: float, profile: str, args: argparse.Namespace) -> SystemResult:
    from atoll.train.run import create_run

    sites = [s.name for s in lab.sites]
    url = f"s3://{wanlab.BUCKET}/wan-{profile}-{time.time_ns() % 10**9}"
    create_run(url, config, recipe, storage_options=engine.moto.options())
    store = store_of(url)
    placement = {spec.learner_id: site for spec, site in zip(recipe.learners, sites, strict=True)}
    before = {s: lab.counters(s) for s in sites}
    t_launch = time.time()
    engine.start(url, placement)
    reached: float | None = None
    curve: list[tuple[float, float]] = []
    seen = 0
    try:
        while time.time() - t_launch < cap_s and reached is None:
            time.sleep(2.0)
            engine.tick()
            latest = store.latest_round()
            if latest > seen:
                for rec in store.history(seen + 1, latest):
                    loss = rec.stats.get("val_loss")
                    if isinstance(loss, int | float) and math.isfinite(loss):
                        curve.append((rec.created_at - t_launch, float(loss)))
                        if loss <= target and reached is None:
                            reached = rec.created_at - t_launch
                seen = latest
        wall = time.time() - t_launch
        steps = {lid: _learner_step(store, lid) for lid in placement}
        started = {lid: _learner_started(store, lid, t_launch) for lid in placement}
    finally:
        engine.stop(store)
    result = SystemResult("atoll", profile, lab.rates[sites[0]], time_to_target_s=reached,
                          final_loss=curve[-1][1] if curve else None, wall_s=wall, curve=curve)
    context = recipe.context_for(recipe.model_factory()())
    for spec, site in zip(recipe.learners, sites, strict=True):
        # Over the time it trained: from its first lease (the process is up) to the end.
        result.tokens_s[site] = (steps[spec.learner_id] * spec.batch_size * context
                                 / max(1e-9, t_launch + wall - started[spec.learner_id]))
    result.extra["rounds"] = seen
    _traffic(lab, before, wall, result)
    return result


def _learner_started(store: Any, learner_id: str, default: float) -> float:
    """When the learner's first incarnation took its lease (the store's clock where it reports one)."""
    from atoll.storage import paths

    infos = store.store.list_info(paths.learner_leases_prefix(learner_id))
    times = [i.modified_s for i in infos if i.modified_s is not None]
    return min(times) if times else default


def _learner_step(store: Any, learner_id: str) -> int:
    live = store.learner_liveness(learner_id)
    return int(live.heartbeat.step or 0) if live.heartbeat is not None else 0


# -- kills -------------------------------------------------------------------------------------------

@dataclass
class KillResult:
    system: str
    window_s: float
    kills: int
    skipped: int
    useful_s: float
    goodput: float
    extra: dict[str, Any] = field(default_factory=dict)


def kill_schedule(seed: int, window_s: float, sites: int, kills: int) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    return sorted((rng.uniform(0.1 * window_s, 0.9 * window_s), rng.randrange(sites)) for _ in range(kills))


def ddp_under_kills(lab: wanlab.Lab, recipe: Any, out: Path, schedule: list[tuple[float, int]],
                    args: argparse.Namespace) -> KillResult:
    sites = [s.name for s in lab.sites]
    ddp = wanlab.DDPRun(lab, sites, recipe, out, steps=10**6, checkpoint_every=args.ddp_checkpoint_every,
                        max_restarts=10**3).start()
    window = args.kill_minutes * 60
    kills = skipped = 0
    killed_at: list[float] = []
    try:
        t0 = _wait_first(lambda: next((e["t"] for e in ddp.timeline() if e["kind"] == "step"), None), 600)
        for at, target in schedule:
            time.sleep(max(0.0, t0 + at - time.time()))
            if ddp.kill_rank(sites[target]):
                kills += 1
                killed_at.append(time.time() - t0)
                say(f"DDP: t+{time.time() - t0:5.0f}s SIGKILL rank at {sites[target]}")
            else:
                skipped += 1
        time.sleep(max(0.0, t0 + window - time.time()))
    finally:
        ddp.stop()
    kept: dict[int, tuple[float, float]] = {}
    timeline = ddp.timeline()
    restarts = 0
    for e in timeline:
        if e["kind"] == "start" and e["t"] > t0:
            restarts += 1
        if e["kind"] == "step" and e["t"] <= t0 + window:
            kept[e["step"]] = (e["t"], e["dur"])  # a step done again after a restart replaces the lost one
    useful = sum(d for _, d in kept.values())
    # Down time after each kill: until the next step of a restarted group (or the window's end).
    down = []
    for at in killed_at:
        nxt = [e["t"] for e in timeline if e["kind"] == "step" and e["t"] > t0 + at
               and any(s["kind"] == "start" and t0 + at < s["t"] < e["t"] for s in timeline)]
        down.append(min(nxt, default=t0 + window) - (t0 + at))
    return KillResult("torchrun elastic DDP", window, kills, skipped, useful, useful / window,
                      {"restarts": restarts, "steps kept": len(kept), "down s per kill": [round(d) for d in down]})


def atoll_under_kills(lab: wanlab.Lab, engine: Any, store_of: Callable[[str], Any], config: Any, recipe: Any,
                      schedule: list[tuple[float, int]], args: argparse.Namespace) -> KillResult:
    from atoll.runs.goodput import GoodputTracker
    from atoll.train.run import create_run

    sites = [s.name for s in lab.sites]
    url = f"s3://{wanlab.BUCKET}/wan-kills-{time.time_ns() % 10**9}"
    create_run(url, config, recipe, storage_options=engine.moto.options())
    store = store_of(url)
    ids = [spec.learner_id for spec in recipe.learners]
    engine.start(url, dict(zip(ids, sites, strict=True)))
    window = args.kill_minutes * 60
    kills = skipped = 0
    try:
        t0 = _wait_first(lambda: store.read_commit(1).created_at if store.latest_round() >= 1 else None, 600,
                         tick=engine.tick)
        for at, target in schedule:
            while time.time() < t0 + at:
                engine.tick()
                time.sleep(min(1.0, max(0.0, t0 + at - time.time())))
            if engine.kill(ids[target], store):
                kills += 1
                say(f"atoll: t+{time.time() - t0:5.0f}s SIGKILL {ids[target]} at {sites[target]}")
            else:
                skipped += 1
        while time.time() < t0 + window:
            engine.tick()
            time.sleep(1.0)
    finally:
        engine.stop(store)
    tracker = GoodputTracker(store)
    latest = store.latest_round()
    in_window = [r for r in store.history(1, latest) if r.created_at <= t0 + window]
    tracker.add(in_window)
    report = tracker.report()
    # The paper's goodput: time in useful training steps over the time available (sites x window);
    # the merged-work share says how much of that training the model kept.
    available = len(sites) * window
    return KillResult("atoll", window, kills, skipped, report.useful_s, report.useful_s / available,
                      {"rounds": len(in_window), "merged-work share": report.merged_share,
                       "merged s / available": round(report.merged_s / available, 3)})


def _wait_first(fn: Callable[[], Any], timeout_s: float, tick: Callable[[], None] | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value is not None:
            return value
        if tick is not None:
            tick()
        time.sleep(1.0)
    raise RuntimeError(f"nothing started within {timeout_s:.0f}s")


# -- report --------------------------------------------------------------------------------------------

def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def profile_table(results: list[SystemResult], sites: Sequence[str]) -> str:
    head = (f"{'profile':<10}{'system':<8}{'to target s':>12}{'final loss':>11}  "
            + "".join(f"{'tok/s ' + s:>11}" for s in sites)
            + "".join(f"{'MB up/down ' + s:>20}" for s in sites) + f"{'link util':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        util = [u for u in r.utilisation.values() if u is not None]
        lines.append(
            f"{r.profile:<10}{r.system:<8}"
            f"{'-' if r.time_to_target_s is None else f'{r.time_to_target_s:.0f}':>12}"
            f"{'-' if r.final_loss is None else f'{r.final_loss:.3f}':>11}  "
            + "".join(f"{r.tokens_s.get(s, 0):>11,.0f}" for s in sites)
            + "".join(f"{_mb(r.bytes_up.get(s, 0)) + ' / ' + _mb(r.bytes_down.get(s, 0)):>20}" for s in sites)
            + f"{(f'{100 * max(util):.0f}%' if util else '-'):>11}")
    return "\n".join(lines)


def crossover(results: list[SystemResult]) -> str:
    """The bandwidth below which atoll reaches the target sooner, interpolated on a log scale."""
    pairs = []
    for profile in dict.fromkeys(r.profile for r in results):
        d = next((r for r in results if r.profile == profile and r.system == "DDP"), None)
        a = next((r for r in results if r.profile == profile and r.system == "atoll"), None)
        if d is None or a is None or d.rate_mbit is None or d.time_to_target_s is None:
            continue
        ratio = (a.time_to_target_s / d.time_to_target_s) if a.time_to_target_s else math.inf
        pairs.append((d.rate_mbit, ratio))
    if not pairs:
        return "crossover: no shaped profile with both systems"
    pairs.sort()
    lines = ["atoll time / DDP time to target: " + ", ".join(f"{r:g} Mbit/s {x:.2f}x" for r, x in pairs)]
    wins = [r for r, x in pairs if x < 1]
    if not wins:
        lines.append("crossover: atoll did not reach the target sooner at any measured bandwidth")
    elif len(wins) == len(pairs):
        lines.append(f"crossover: at or above the highest bandwidth measured, {pairs[-1][0]:g} Mbit/s "
                     "(atoll was sooner at every one)")
    else:
        for (r0, x0), (r1, x1) in zip(pairs, pairs[1:], strict=False):
            if x0 < 1 <= x1 and math.isfinite(x1):
                f = math.log(x0) / (math.log(x0) - math.log(x1))
                cross = math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
                lines.append(f"crossover: about {cross:.0f} Mbit/s per site (atoll sooner below it)")
                break
        else:
            lines.append("crossover: not monotone over the measured bandwidths (see the ratios)")
    return "\n".join(lines)


def kill_table(results: list[KillResult]) -> str:
    head = f"{'system':<24}{'window s':>9}{'kills':>7}{'skipped':>8}{'useful s':>10}{'goodput':>9}  details"
    lines = [head, "-" * len(head)]
    for r in results:
        detail = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.extra.items())
        lines.append(f"{r.system:<24}{r.window_s:>9.0f}{r.kills:>7}{r.skipped:>8}{r.useful_s:>10.0f}"
                     f"{100 * r.goodput:>8.1f}%  {detail}")
    return "\n".join(lines)


def plot(results: list[SystemResult], out: Path, unshaped_at: float = 10_000.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, marker in (("DDP", "s"), ("atoll", "o")):
        rows = sorted(((r.rate_mbit or unshaped_at), r.time_to_target_s) for r in results
                      if r.system == system and r.time_to_target_s is not None)
        a.plot([x for x, _ in rows], [y for _, y in rows], marker=marker, label=system)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel(f"link per site, Mbit/s each way (unshaped drawn at {unshaped_at:g})")
    a.set_ylabel("seconds to DDP's loss at its budget")
    a.set_title("time to target against bandwidth")
    a.legend()
    for r in results:
        if r.curve:
            b.plot([t for t, _ in r.curve], [v for _, v in r.curve], label=f"{r.system} {r.profile}",
                   ls="-" if r.system == "atoll" else "--")
    b.set_xlabel("seconds since launch")
    b.set_ylabel("validation loss")
    b.set_title("validation loss over time")
    b.legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "wan.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- main ------------------------------------------------------------------------------------------------

def parse_profiles(text: str) -> list[tuple[str, float | None]]:
    out: list[tuple[str, float | None]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        out.append((part, None) if part == "unshaped" else (f"{float(part):g}M", float(part)))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profiles", default="unshaped,1000,100,20", help="Mbit/s per site (each way), or 'unshaped'")
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--engine", choices=("prefect", "local"), default="prefect")
    p.add_argument("--batch", type=int, default=8, help="sequences per step per site (learner and DDP rank)")
    p.add_argument("--ddp-steps", type=int, default=300, help="DDP's token budget in steps (global batch each)")
    p.add_argument("--ddp-evals", type=int, default=6, help="validation points along DDP's run")
    p.add_argument("--ddp-timeout-s", type=float, default=3600.0)
    p.add_argument("--cap", type=float, default=3.0, help="atoll stops at this many times DDP's time to target")
    p.add_argument("--eval-every-rounds", type=int, default=8, help="atoll's validation cadence (rounds)")
    p.add_argument("--inner-steps", type=int, default=0, help="H (0: the demo preset's)")
    p.add_argument("--compression", default="", help="uplink codec: fp32, bf16, int4 ('': the preset's)")
    p.add_argument("--downlink-compression", default="", help="downlink codec ('': the preset's)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="mean delay per object-store call of atoll's")
    p.add_argument("--kills", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kill-profile", type=float, default=100.0, help="Mbit/s per site during the kill phase")
    p.add_argument("--kill-minutes", type=float, default=10.0)
    p.add_argument("--kill-count", type=int, default=6)
    p.add_argument("--ddp-checkpoint-every", type=int, default=20)
    p.add_argument("--outages", action="store_true", help="partitions and outages instead (benchmarks/wan_outages.py)")
    p.add_argument("--scenarios", default="partition-2m,partition-10m,bucket-2m,prefect-2m",
                   help="with --outages: which ones")
    p.add_argument("--outage-scale", type=float, default=1.0, help="with --outages: fault durations x this")
    p.add_argument("--ddp-partition", action=argparse.BooleanOptionalAction, default=True,
                   help="with --outages: DDP with a site cut off as long as partition-2m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="profiles 100,20; 60 DDP steps; a 3-minute kill phase with 3 kills")
    p.add_argument("--out", default="out/wan")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        args.profiles, args.ddp_steps, args.ddp_evals = "100,20", 60, 3
        args.kill_minutes, args.kill_count, args.ddp_checkpoint_every = 3.0, 3, 10
        args.outage_scale = 0.25
    if args.outages:
        import wan_outages

        return int(wan_outages.main(args))
    why = wanlab.unavailable()
    if why:
        print(f"benchmarks/wan.py: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = parse_profiles(args.profiles)
    site_names = [f"s{i}" for i in range(args.sites)]
    specs = [wanlab.SiteSpec(name=s) for s in site_names]
    results: list[SystemResult] = []
    kill_results: list[KillResult] = []
    env = wanlab.storage_latency_env(args.latency_ms)
    with wanlab.Lab(specs, log_dir=out / "logs", trap_signals=True, log=say) as lab:
        moto = wanlab.Moto(lab)
        from atoll.storage import RunReader

        def store_of(url: str) -> Any:
            return RunReader.open(url, moto.options())

        engine: Any = (PrefectEngine(lab, moto, env, out) if args.engine == "prefect" else LocalEngine(lab, moto, env))
        config, recipe = bench_run(site_names, args)
        say(f"{len(site_names)} sites, engine {engine.name}; H={config.inner_steps} P={config.num_fragments} "
            f"uplink {config.compression}, downlink {getattr(config, 'downlink_compression', 'fp32')}; "
            f"DDP budget {args.ddp_steps} steps")
        try:
            for profile, rate in profiles:
                for s in site_names:
                    lab.shape(s, rate)
                say(f"{profile}: DDP ...")
                ddp = run_ddp(lab, recipe, out / f"ddp-{profile}", args, profile)
                results.append(ddp)
                say(f"{profile}: DDP reached {ddp.final_loss:.3f} in {ddp.time_to_target_s:.0f}s "
                    f"({ddp.extra['step_s']:.2f} s/step); atoll ...")
                atoll = run_atoll(lab, engine, store_of, config, recipe, ddp.final_loss or 0.0,
                                  args.cap * (ddp.time_to_target_s or 60.0), profile, args)
                results.append(atoll)
                say(f"{profile}: atoll {'reached it in ' + format(atoll.time_to_target_s, '.0f') + 's' if atoll.time_to_target_s else 'did not reach it'}")
                print(profile_table(results, site_names), flush=True)
                _save(out, results, kill_results)
            if args.kills:
                for s in site_names:
                    lab.shape(s, args.kill_profile)
                schedule = kill_schedule(args.seed, args.kill_minutes * 60, len(site_names), args.kill_count)
                say(f"kills at {args.kill_profile:g} Mbit/s: {len(schedule)} SIGKILLs over {args.kill_minutes:g} min")
                kill_results.append(atoll_under_kills(lab, engine, store_of, config, recipe, schedule, args))
                _save(out, results, kill_results)
                print(kill_table(kill_results), flush=True)
                kill_results.append(ddp_under_kills(lab, recipe, out / "ddp-kills", schedule, args))
                _save(out, results, kill_results)
        finally:
            engine.close()
    print()
    print(f"{len(site_names)} sites, one learner / DDP rank each; tiny GPT; engine {engine.name}; "
          f"DDP budget {args.ddp_steps} steps; latency added to atoll's storage calls: {args.latency_ms:g} ms")
    print(profile_table(results, site_names))
    print(crossover(results))
    if kill_results:
        print()
        print(f"kills at {args.kill_profile:g} Mbit/s per site, seed {args.seed}:")
        print(kill_table(kill_results))
    if results:
        print(f"plot: {plot(results, out)}")
    return 0


def _save(out: Path, results: list[SystemResult], kills: list[KillResult]) -> None:
    (out / "wan.json").write_text(json.dumps({"profiles": [dataclasses.asdict(r) for r in results],
                                              "kills": [dataclasses.asdict(k) for k in kills]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
