"""Partitions and outages in the WAN lab, each with its outcome checked and timed (``python
benchmarks/wan.py --outages``; ``--scenarios``, ``--outage-scale``, ``--engine``).

Scenarios, each on a fresh run of the same recipe (one learner per site, Prefect stack by default):

* ``partition-2m`` / ``partition-10m``: the last site's link goes down (no carrier) for 2 / 10
  minutes mid-run, then comes back;
* ``bucket-2m``: the bucket is unreachable from every site for 2 minutes (its address is gone;
  the cloud, where the synchronizer runs, still reaches it);
* ``prefect-2m``: the Prefect server is stopped for 2 minutes and started again (SQLite: its
  state survives).

Checked for each (printed as ok / FAILED with the evidence): every cut-off learner is merged again
after the fault ends (how long it took); the cut-off learner kept training or was fenced and
relaunched (its step counter and incarnation before and after); never two live copies of a
learner (sampled every second: the lease's process runs in the lab and heartbeats as alive, on the
store's clock); nothing committed lost (the commit chain verifies, rounds contiguous); rounds go
on during the fault where the design says they do (a site partition, a Prefect outage).

DDP in the same cases: a site partition is measured (``--ddp-partition``): the all-reduce blocks
on the missing rank (gloo's timeout is 30 minutes; TCP keeps retrying), so no rank steps until the
link is back. A bucket or Prefect outage does not touch a DDP job that neither checkpoints to the
bucket nor is orchestrated by Prefect (torchrun's own rendezvous store stands in for both).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import wan
import wanlab

SCENARIOS: dict[str, tuple[str, float]] = {
    "partition-2m": ("partition", 120.0),
    "partition-10m": ("partition", 600.0),
    "bucket-2m": ("bucket", 120.0),
    "prefect-2m": ("prefect", 120.0),
}
MARKER_VAR = "ATOLL_WAN_MARKER"
LIVE_TIMEOUT_S = 30.0
"""A heartbeat older than this (store's clock) is not alive (the fleet's heartbeat_timeout_s here)."""


@dataclass
class Outcome:
    scenario: str
    fault_s: float
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, bool(ok), detail))
        wan.say(f"{self.scenario}: {'ok' if ok else 'FAILED'}: {name} ({detail})")


class Sampler(threading.Thread):
    """Every second: the newest round, and per learner its live copies and its newest lease."""

    def __init__(self, store: Any, learners: list[str], marker: str) -> None:
        super().__init__(daemon=True, name="wan-sampler")
        self.store, self.learners, self.marker = store.sibling(), learners, marker
        self.stop = threading.Event()
        self.worst: dict[str, int] = dict.fromkeys(learners, 0)
        self.rounds: list[tuple[float, int]] = []

    def run(self) -> None:
        from atoll.ops import observe

        while not self.stop.wait(1.0):
            try:
                self.rounds.append((time.time(), self.store.latest_round()))
                for lid in self.learners:
                    n = len(observe.live_copies(self.store, lid, env_var=MARKER_VAR, marker=self.marker,
                                                heartbeat_timeout_s=LIVE_TIMEOUT_S))
                    self.worst[lid] = max(self.worst[lid], n)
            except Exception:  # noqa: BLE001 - a read that fails during an outage is not a finding
                continue

    def rounds_between(self, t0: float, t1: float) -> int:
        inside = [r for t, r in self.rounds if t0 <= t <= t1]
        return (max(inside) - min(inside)) if inside else 0


def _state(store: Any, lid: str) -> tuple[int, int]:
    """(incarnation, step of its last heartbeat) of a learner, from the bucket."""
    live = store.learner_liveness(lid)
    return live.incarnation, int(live.heartbeat.step or 0) if live.heartbeat is not None else 0


def _merged_learners(store: Any) -> set[str]:
    latest = store.latest_round()
    return {a.learner_id for rec in store.history(1, latest) for a in rec.accepted} if latest else set()


def _first_merge_after(store: Any, lid: str, t: float, cap_s: float, tick: Any) -> float | None:
    """Seconds from ``t`` until a round that merged ``lid`` was committed after ``t`` (None: not within cap)."""
    seen = max(0, store.latest_round())
    while time.time() < t + cap_s:
        tick()
        latest = store.latest_round()
        for rec in store.history(seen + 1, latest) if latest > seen else []:
            if rec.created_at >= t and any(a.learner_id == lid for a in rec.accepted):
                return rec.created_at - t
        seen = max(seen, latest)
        time.sleep(1.0)
    return None


def run_scenario(name: str, lab: wanlab.Lab, engine: Any, store_of: Any, config: Any, recipe: Any,
                 scale: float, marker: str) -> Outcome:
    from atoll.train.run import create_run

    kind, duration = SCENARIOS[name]
    duration *= scale
    out = Outcome(name, duration)
    sites = [s.name for s in lab.sites]
    ids = [spec.learner_id for spec in recipe.learners]
    url = f"s3://{wanlab.BUCKET}/wan-{name}-{time.time_ns() % 10**9}"
    create_run(url, config, recipe, storage_options=engine.moto.options())
    store = store_of(url)
    engine.start(url, dict(zip(ids, sites, strict=True)))
    sampler = Sampler(store, ids, marker)
    affected = {"partition": [ids[-1]], "bucket": ids, "prefect": []}[kind]
    try:
        wan._wait_first(lambda: True if _merged_learners(store) >= set(ids) else None, 900, tick=engine.tick)
        sampler.start()
        time.sleep(10)
        before = {lid: _state(store, lid) for lid in ids}
        t_fault = time.time()
        wan.say(f"{name}: fault on for {duration:.0f}s (round {store.latest_round()})")
        _fault(kind, lab, engine, sites, on=True)
        while time.time() < t_fault + duration:
            engine.tick()
            time.sleep(1.0)
        t_heal = time.time()
        _fault(kind, lab, engine, sites, on=False)
        wan.say(f"{name}: fault off (round {store.latest_round()})")
        during = sampler.rounds_between(t_fault, t_heal)
        out.timings["rounds during the fault"] = during
        if kind in ("partition", "prefect"):
            out.check("rounds go on during the fault", during > 0, f"{during} rounds committed")
        for lid in affected or ids:
            back = _first_merge_after(store, lid, t_heal, 900, engine.tick)
            out.timings[f"{lid} merged again after s"] = None if back is None else round(back, 1)
            out.check(f"{lid} merged again after the fault", back is not None,
                      "not within 900 s" if back is None else f"{back:.0f} s after it ended")
        time.sleep(5)
        after = {lid: _state(store, lid) for lid in ids}
        for lid in affected or ids:
            (inc0, step0), (inc1, step1) = before[lid], after[lid]
            how = "relaunched (fenced the old copy)" if inc1 > inc0 else "kept training"
            out.timings[f"{lid} incarnation"] = f"{inc0} -> {inc1}"
            out.check(f"{lid} kept training or was relaunched", step1 > step0 or inc1 > inc0,
                      f"{how}: step {step0} -> {step1}, incarnation {inc0} -> {inc1}")
        if kind == "prefect":
            sync = store.synchronizer_liveness()
            age = sync.heartbeat_age_s(time.time())
            out.check("training run alive after the server is back", age is not None and age < LIVE_TIMEOUT_S,
                      f"synchronizer incarnation {sync.incarnation}, heartbeat {age if age is None else round(age)} s old")
    finally:
        sampler.stop.set()
        sampler.join(timeout=10)
        engine.stop(store)
    worst = max(sampler.worst.values(), default=0)
    out.check("never two live copies of a learner", worst <= 1, f"most copies seen at once: {worst}")
    report = store.verify()
    latest = store.latest_round()
    contiguous = [r.round for r in store.history(1, latest)] == list(range(1, latest + 1))
    out.check("nothing committed lost", report.ok and contiguous,
              f"{latest} rounds, chain {'verifies' if report.ok else 'BROKEN'}, "
              f"{'contiguous' if contiguous else 'GAPS'}")
    return out


def _fault(kind: str, lab: wanlab.Lab, engine: Any, sites: list[str], *, on: bool) -> None:
    if kind == "partition":
        (lab.link_down if on else lab.link_up)(sites[-1])
    elif kind == "bucket":
        (lab.bucket_down if on else lab.bucket_up)()
    elif on:
        engine.stack.stop_server()
    else:
        engine.stack.start_server()


def ddp_partition(lab: wanlab.Lab, recipe: Any, out: Path, duration_s: float) -> dict[str, Any]:
    """DDP with the last site cut off for ``duration_s``: steps during the cut, and how long after
    it the group steps again."""
    sites = [s.name for s in lab.sites]
    ddp = wanlab.DDPRun(lab, sites, recipe, out, steps=10**6).start()
    try:
        t0 = wan._wait_first(lambda: next((e["t"] for e in ddp.timeline() if e["kind"] == "step"), None), 600)
        time.sleep(max(0.0, t0 + 20 - time.time()))
        t_cut = time.time()
        lab.link_down(sites[-1])
        time.sleep(duration_s)
        t_heal = time.time()
        lab.link_up(sites[-1])
        deadline = t_heal + max(300.0, duration_s)
        resumed = None
        while time.time() < deadline and resumed is None:
            time.sleep(1.0)
            resumed = next((e["t"] for e in ddp.timeline() if e["kind"] == "step" and e["t"] > t_heal), None)
        steps_during = sum(1 for e in ddp.timeline() if e["kind"] == "step" and t_cut + 5 < e["t"] <= t_heal)
    finally:
        ddp.stop()
    return {"cut s": round(t_heal - t_cut), "steps during the cut": steps_during,
            "steps again after s": None if resumed is None else round(resumed - t_heal, 1)}


def table(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        lines.append(f"{o.scenario} ({o.fault_s:.0f} s):")
        for name, ok, detail in o.checks:
            lines.append(f"  {'ok    ' if ok else 'FAILED'} {name}: {detail}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import uuid

    why = wanlab.unavailable()
    if why:
        print(f"benchmarks/wan.py --outages: {why}")
        return 2
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for n in names:
        if n not in SCENARIOS:
            raise SystemExit(f"--scenarios: unknown {n!r} (one of {', '.join(SCENARIOS)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    site_names = [f"s{i}" for i in range(args.sites)]
    specs = [wanlab.SiteSpec(name=s, rate_mbit=args.kill_profile) for s in site_names]
    marker = uuid.uuid4().hex
    outcomes: list[Outcome] = []
    ddp: dict[str, Any] = {}
    with wanlab.Lab(specs, log_dir=out / "logs", trap_signals=True, log=wan.say) as lab:
        moto = wanlab.Moto(lab)
        from atoll.storage import RunReader

        def store_of(url: str) -> Any:
            return RunReader.open(url, moto.options())

        env = {**wanlab.storage_latency_env(args.latency_ms), MARKER_VAR: marker}
        engine: Any = (wan.PrefectEngine(lab, moto, env, out) if args.engine == "prefect"
                       else wan.LocalEngine(lab, moto, env))
        config, recipe = wan.bench_run(site_names, args)
        try:
            for n in names:
                if SCENARIOS[n][0] == "prefect" and engine.name != "prefect":
                    wan.say(f"{n}: skipped (needs --engine prefect)")
                    continue
                outcomes.append(run_scenario(n, lab, engine, store_of, config, recipe, args.outage_scale, marker))
                (out / "outages.json").write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1))
            if args.ddp_partition:
                cut = SCENARIOS["partition-2m"][1] * args.outage_scale
                wan.say(f"DDP: the last site cut off for {cut:.0f}s ...")
                ddp = ddp_partition(lab, recipe, out / "ddp-partition", cut)
        finally:
            engine.close()
    print()
    print(f"{len(site_names)} sites at {args.kill_profile:g} Mbit/s, engine {engine.name}, "
          f"fault durations x {args.outage_scale:g}")
    print(table(outcomes))
    if ddp:
        print("DDP (torchrun, gloo) with the last site cut off: " + ", ".join(f"{k} {v}" for k, v in ddp.items()))
    print("DDP under a bucket or Prefect outage: unaffected (it uses neither while it trains).")
    return 0 if all(ok for o in outcomes for _, ok, _ in o.checks) else 1
