"""A split synchronizer: how round throughput grows with the number of merger processes.

    python benchmarks/sync_split.py [--quick] [--sizes 10M,86M] [--fragments 8] [--groups 1,2]
        [--passes 2] [--emulate-s 30] [--step-ms 60] [--out out/bench/sync_split]

The synchronizer split into G mergers (``SynchronizerOptions.fragment_group``, ``python -m
atoll.train.local synchronizer --group g/G``): merger g merges the rounds of fragments p with
p mod G = g and they take turns on one commit chain (:mod:`atoll.train.peer_rounds`). Each
configuration is the replay setup of ``benchmarks/sync_throughput.py`` (random GPTs on bytes of
the real sizes, M replay learners publishing real-sized int4 contributions, K = 1 + grace, RDA,
Nesterov 0.7 / 0.9, masters by replay every 16 versions), one run per size, and for each G:

* **Rounds back to back**: the fleet publishes the inputs of ``--passes`` x P rounds first (not
  timed), then G merger processes (each with cores / G torch threads) run them; seconds per round
  over the last pass, from the commit records' times (one machine, one clock), the CPU the
  mergers used, in cores, and the largest merger's peak memory (each holds its own group's
  fragments: about 1/G of the state). G = 1 runs the same way (one process), so the ratios hold.
* **An emulated run**: the fleet of ``sync_throughput.py`` (steps on a ``--step-ms`` clock,
  publishes on the schedule, adopts every version it sees) in this process for ``--emulate-s``
  seconds while the G merger processes run; rounds per second, the rounds per second that keep
  up (P / (H x step)), and the effective H ``atoll status`` reports.

Prints progress, a table, and writes ``sync_split.png`` (seconds per round against G, one line per
size) and ``sync_split.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from atoll.core.fragments import FragmentGroup
from atoll.storage import RunReader, SynchronizerStore, paths
from atoll.storage.validation import RoundOrderError
from atoll.train.lease import RunStopped
from atoll.train.run import create_run
from atoll.train.synchronizer import Synchronizer, SynchronizerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_throughput import (  # noqa: E402 - the replay fleet and models of the throughput benchmark
    POLL_INTERVAL_S,
    SIZES,
    CommitWatch,
    DeltaBank,
    Progress,
    ReplayLearner,
    Setup,
    back_to_back_s,
    emulated_figures,
    fleet_handles,
    parameter_count,
    publish_round,
    random_model,
    remove,
    run_config,
)

# -- a merger process ---------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> int:
    """One merger: ready once its state is read, runs from the go file until the bucket holds
    round ``--through`` or the run is stopped; prints its CPU seconds and peak memory as JSON."""
    torch.set_num_threads(args.threads)
    group = FragmentGroup.parse(args.group)
    store = SynchronizerStore.open(args.worker)
    sync = Synchronizer(store, options=SynchronizerOptions(
        poll_interval_s=POLL_INTERVAL_S, fragment_group=group, synchronizer_id=f"merger-{group.index}"))
    sync.hold_lease()  # its group's lease: the run's stop marker (``Mergers.stop``) ends the loop
    print("ready", flush=True)
    go = Path(args.go)
    while not go.exists():
        time.sleep(0.005)
    c0 = time.process_time()
    try:
        while store.latest_round() < args.through:
            _, decision = sync.step()
            if decision is not None:
                time.sleep(min(max((decision.recheck_at_s or 0) - sync.clock(), 0.005), POLL_INTERVAL_S))
        sync.drain()
    except (RunStopped, RoundOrderError):  # stopped, or a round dropped because the run stopped while it waited
        pass
    finally:
        sync.shutdown()
    peak_gb = peak_rss_gb()
    print(json.dumps({"cpu_s": time.process_time() - c0, "round": sync.round, "peak_gb": peak_gb}), flush=True)
    return 0


def peak_rss_gb() -> float:
    """This process's peak resident memory (``VmHWM``: its own, where ``ru_maxrss`` would carry
    the parent's peak across ``exec``); NaN where /proc cannot tell."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


class Mergers:
    """G merger processes on one run, started up to 'ready' (state read), then let go together."""

    def __init__(self, url: str, groups: int, through: int, work: Path) -> None:
        self.store = SynchronizerStore.open(url)
        self.store.clear_stopped(reason="the next measurement", by="sync_split")
        self.go = work / f"go-{uuid.uuid4().hex[:6]}"
        threads = max(1, (os.cpu_count() or 1) // groups)
        self.procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", url, "--group", f"{g}/{groups}", "--through", str(through),
             "--threads", str(threads), "--go", str(self.go)],
            stdout=subprocess.PIPE, text=True) for g in range(groups)]
        for p in self.procs:
            line = p.stdout.readline() if p.stdout else ""
            if line.strip() != "ready":
                self.kill()
                raise RuntimeError(f"a merger did not start: {line!r}")
        self.threads = threads

    def start(self) -> float:
        self.go.touch()
        return time.time()

    def stop(self) -> None:
        """The run's stop marker: each merger's next poll (or wait for another group) ends its loop."""
        self.store.mark_stopped("the emulated run is over", by="sync_split")

    def wait(self, timeout_s: float = 900.0) -> tuple[float, float]:
        """Once they exited: the mergers' CPU seconds, and the largest one's peak memory (GB)."""
        cpu, peak = 0.0, 0.0
        for p in self.procs:
            out, _ = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"a merger failed ({p.returncode}): {out[-2000:]}")
            said = json.loads(out.strip().splitlines()[-1])
            cpu, peak = cpu + said["cpu_s"], max(peak, said["peak_gb"])
        return cpu, peak

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.go.unlink(missing_ok=True)


# -- measurements -------------------------------------------------------------------------------------

def publish_passes(url: str, setup: Setup, passes: int, step_s: float) -> tuple[int, int]:
    """Inputs of ``passes`` x P rounds after the bucket's latest: each against the version its
    fragment will hold then (every round merges: round r merges on round r - P). (first, last) round."""
    store = SynchronizerStore.open(url)
    first, n = store.latest_round() + 1, store.plan.num_fragments
    rec = store.read_commit(first - 1) if first > 1 else None
    versions = list(rec.versions) if rec else [0] * n
    bank, fleet = DeltaBank(store, keep=False), fleet_handles(store, setup.learners)
    for r in range(first, first + passes * n):
        p = (r - 1) % n
        publish_round(fleet, bank, p, versions[p], setup, step_s)
        versions[p] = r
    return first, first + passes * n - 1


def back_to_back(url: str, setup: Setup, groups: int, passes: int, step_s: float, work: Path,
                 progress: Progress) -> dict[str, Any]:
    first, last = publish_passes(url, setup, passes, step_s)
    gc.collect()
    mergers = Mergers(url, groups, last, work)
    try:
        t0 = mergers.start()
        cpu, peak_gb = mergers.wait()
        wall = time.time() - t0
    finally:
        mergers.kill()
    reader = RunReader.open(url)
    n = setup.fragments
    times = [rec.created_at for r in (last - n, last) if (rec := reader.read_commit(r)) is not None]
    per_round = (times[1] - times[0]) / n
    progress.say(f"{setup.name}: {groups} merger(s) x {mergers.threads} threads: {per_round:.3f} s per round "
                 f"(rounds {first}-{last}, last pass timed), {cpu / wall:.2f} cores, {peak_gb:.2f} GB per merger at most")
    return {"round_s": round(per_round, 4), "cores": round(cpu / wall, 2), "threads": mergers.threads,
            "rounds": [first, last], "peak_gb": round(peak_gb, 2)}


def emulate_split(url: str, setup: Setup, groups: int, seconds: float, step_s: float, work: Path,
                  progress: Progress) -> dict[str, Any]:
    """The replay fleet in this process for ``seconds`` against G merger processes."""
    store = SynchronizerStore.open(url)
    first = store.latest_round()
    bank = DeltaBank(store, keep=True)
    for p in range(store.plan.num_fragments):
        bank.delta(p)
    watch = CommitWatch(RunReader.beside(store.sibling(metered_apart=True)), step_s)
    learners = [ReplayLearner(i, h, bank, watch, setup, step_s) for i, h in enumerate(fleet_handles(store, setup.learners))]
    mergers = Mergers(url, groups, 10**9, work)
    try:
        t0_wall = mergers.start()
        t0, c0 = time.monotonic(), time.process_time()
        until = t0 + seconds
        threads = [threading.Thread(target=lr.run, args=(t0, until), daemon=True) for lr in learners]
        threads.append(threading.Thread(target=watch.run, daemon=True))
        for t in threads:
            t.start()
        for t in threads[:-1]:
            t.join()
        mergers.stop()
        watch.stop.set()
        threads[-1].join()
        merger_cpu, _ = mergers.wait()
        wall = time.time() - t0_wall
    finally:
        mergers.kill()
    fleet_cpu = time.process_time() - c0
    last = RunReader.open(url).latest_round()
    figures = emulated_figures(RunReader.open(url), setup, first, last, seconds, step_s, learners, watch, fleet_cpu)
    figures["synchronizer_cores"] = merger_cpu / wall  # the mergers' processes, not this one
    progress.say(f"{setup.name}: emulated with {groups} merger(s): {figures['rounds']} rounds "
                 f"({figures['rounds_per_s']:.2f}/s, {figures['needed_rounds_per_s']:.1f}/s needed), effective H "
                 f"{figures['effective_h']} (H = {setup.fragments})")
    return figures


def measure(setup: Setup, args: argparse.Namespace, root: Path, progress: Progress) -> list[dict[str, Any]]:
    params = parameter_count(SIZES[setup.size])
    url = paths.to_url(str(root / f"{setup.size}-p{setup.fragments}-{uuid.uuid4().hex[:6]}"))
    rows = []
    step_s = args.step_ms / 1e3
    try:
        with progress.phase(f"{setup.name}: creating the run ({params / 1e6:.1f} M parameters)"):
            config, recipe = run_config(setup)
            model = random_model(SIZES[setup.size])
            create_run(url, config, recipe, model=model)
            del model
            gc.collect()
        with progress.phase(f"{setup.name}: a first pass over the fragments (their first versions write masters)"):
            store = SynchronizerStore.open(url)
            sync = Synchronizer(store, options=SynchronizerOptions(poll_interval_s=POLL_INTERVAL_S))
            try:
                back_to_back_s(sync, fleet_handles(store, setup.learners), DeltaBank(store, keep=False), setup,
                               step_s, pipelined=True)
            finally:
                sync.shutdown()
            del sync
            gc.collect()
        for groups in [int(g) for g in args.groups.split(",")]:
            row: dict[str, Any] = {"config": setup.name, "size": setup.size, "params": params,
                                   "fragments": setup.fragments, "groups": groups}
            with progress.phase(f"{setup.name}: {args.passes} x {setup.fragments} rounds back to back, {groups} merger(s)"):
                row["back_to_back"] = back_to_back(url, setup, groups, args.passes, step_s, Path(args.work), progress)
            if args.emulate_s > 0:
                with progress.phase(f"{setup.name}: emulated fleet, {args.emulate_s:g} s, {groups} merger(s)"):
                    row["emulated"] = emulate_split(url, setup, groups, args.emulate_s, step_s, Path(args.work), progress)
            rows.append(row)
    finally:
        remove(url, None)
    return rows


# -- report -------------------------------------------------------------------------------------------

def table(rows: list[dict[str, Any]]) -> str:
    """One line per size and G; speed-up against the same size's G = 1. With H = P a round per
    learner step keeps every fragment synced every H steps, so s/round is also the fastest
    learner step the mergers keep up with."""
    head = (f"{'config':<24}{'mergers':>8}{'threads':>8}{'s/round':>9}{'speed-up':>9}{'cores':>7}{'GB/merger':>10}"
            f"{'emul. r/s':>10}{'needed':>8}{'eff. H':>8}")
    lines = [head, "-" * len(head)]
    single = {r["config"]: r["back_to_back"]["round_s"] for r in rows if r["groups"] == 1}
    for r in rows:
        b, e = r["back_to_back"], r.get("emulated") or {}
        ref = single.get(r["config"])
        cells = [f"{r['config']:<24}", f"{r['groups']:>8}", f"{b['threads']:>8}", f"{b['round_s']:>9.3f}",
                 format(f"{ref / b['round_s']:.2f}x" if ref else "-", ">9"), f"{b['cores']:>7.2f}",
                 format(f"{b['peak_gb']:.2f}" if "peak_gb" in b else "-", ">10"),
                 format(f"{e['rounds_per_s']:.2f}" if e else "-", ">10"),
                 format(f"{e['needed_rounds_per_s']:.1f}" if e else "-", ">8"),
                 format(str(e.get("effective_h")) if e else "-", ">8")]
        lines.append("".join(cells))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path, step_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    for i, (name, rs) in enumerate(sorted(by.items())):
        ax.plot([r["groups"] for r in rs], [r["back_to_back"]["round_s"] for r in rs], "o-", color=f"C{i}", label=name)
    ax.axhline(step_s, color="k", ls=":", lw=1, label=f"a round per {step_s * 1e3:g} ms step")
    ax.set_yscale("log")
    ax.set_xlabel("merger processes (G)")
    ax.set_ylabel("seconds per round, rounds back to back")
    ax.set_title(f"a split synchronizer on {os.cpu_count()} cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sync_split.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10M and 86M, P = 8, G = 1, 2, 20 s emulated")
    p.add_argument("--sizes", default="10M,86M,350M", help=f"of {','.join(SIZES)}")
    p.add_argument("--fragments", type=int, default=8, help="P (= H)")
    p.add_argument("--learners", type=int, default=4, help="M")
    p.add_argument("--groups", default="1,2", help="merger counts G")
    p.add_argument("--passes", type=int, default=2, help="passes over the fragments back to back (the last is timed)")
    p.add_argument("--emulate-s", type=float, default=30.0, help="seconds of each emulated run (0: none)")
    p.add_argument("--step-ms", type=float, default=60.0)
    p.add_argument("--work", default=None, help="where the runs go (default: a temporary folder)")
    p.add_argument("--out", default="out/bench/sync_split")
    g = p.add_argument_group("one merger process (started by the benchmark)")
    g.add_argument("--worker", default=None, help="a run URL: be one merger of it")
    g.add_argument("--group", default="0/1")
    g.add_argument("--through", type=int, default=0)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--go", default="")
    args = p.parse_args(argv)
    if args.passes < 2:  # the timed pass starts at the previous pass's last commit, in the same processes
        p.error("--passes must be at least 2 (the first pass is not timed)")
    if args.quick:
        args.sizes, args.groups, args.emulate_s = "10M,86M", "1,2", 20.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    tmp = tempfile.mkdtemp(prefix="atoll-sync-split-") if args.work is None else None
    args.work = args.work or tmp
    progress = Progress()
    progress.say(f"{os.cpu_count()} CPUs; sizes {args.sizes}, P = {args.fragments}, M = {args.learners}, "
                 f"mergers {args.groups}")
    rows: list[dict[str, Any]] = []
    try:
        for size in args.sizes.split(","):
            rows += measure(Setup(size, args.fragments, args.learners, "int4", 16), args, Path(args.work), progress)
    finally:
        progress.close()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_split.json").write_text(json.dumps({"cpus": os.cpu_count(), "args": vars(args), "rows": rows}, indent=1))
    print()
    print(f"a split synchronizer: G merger processes, rounds back to back and an emulated fleet at {args.step_ms:g} ms "
          f"per step; local folder, {os.cpu_count()} CPUs")
    print(table(rows))
    print(f"plot: {plot(rows, out, args.step_ms / 1e3)}")
    print(f"table: {out / 'sync_split.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
