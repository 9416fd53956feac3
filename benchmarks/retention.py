"""Bucket size of a run that trains on, with retention against without it, side by side.

    python benchmarks/retention.py [--rounds 600] [--learners 4] [--every-s 30] [--keep-rounds 16] [--out out/]

A real local run (``python -m atoll.train.local run --preset demo``: a synchronizer process and
``--learners`` learner processes that publish, save their inner state as the recipe's budget
allows, and write checkpoints) trains ``--rounds`` rounds in a local folder. Meanwhile, every ``--every-s``
seconds, this script prunes it the way ``atoll prune`` does (``--keep-rounds``, two checkpoints,
``--min-age-s``, the real clock: the run is live, so young objects must survive) and records the
bucket's size. "Without retention" is the size now plus every byte deleted so far: what the folder
would hold had nobody pruned it. At the end: one last prune as of ``--min-age-s`` later (the run has
exited, no writer is in flight: the size a long run's bucket settles to), ``atoll verify`` on the
chain, and the contributors per round before and after the first prune (the run must keep merging
everyone).

Prints a table and writes ``retention.png`` (bucket size over time, both lines).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from atoll.storage import OperatorStore, RunReader
from atoll.storage.paths import to_url
from atoll.storage.retention import RetentionPolicy, apply_prune, plan_prune


def folder_bytes(root: Path) -> tuple[int, int]:
    """(bytes, objects) of every file under ``root`` (temporary files included: they take space)."""
    sizes = [f.stat().st_size for f in root.rglob("*") if f.is_file()]
    return sum(sizes), len(sizes)


def plot(rows: list[dict], out: Path, *, settled_mib: float, every_s: float, min_age_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    t = [r["t_s"] for r in rows]
    ax.plot(t, [r["without_mib"] for r in rows], "o--", label="without retention")
    ax.plot(t, [r["with_mib"] for r in rows], "o-", label="with retention (atoll prune)")
    ax.plot([t[-1]], [settled_mib], "s", color="C2",
            label=f"with retention, once the last writes are {min_age_s:.0f} s old")
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("bucket size (MiB)")
    ax.set_title(f"a live run's bucket, pruned every {every_s:.0f} s")
    ax.legend()
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "retention.png"
    fig.savefig(path, dpi=110)
    return path


def prune_once(url: str, policy: RetentionPolicy, *, now: float | None = None) -> tuple[int, int, float, int]:
    """(objects, bytes deleted, seconds, latest round) of one plan + apply on a fresh handle."""
    t0 = time.perf_counter()
    run = OperatorStore.open(url)
    plan = plan_prune(run, policy, now=now)
    if plan.deletes:
        apply_prune(run, plan, by="benchmarks/retention.py")
    return len(plan.deletes), plan.bytes, time.perf_counter() - t0, plan.latest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=600)
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--every-s", type=float, default=30.0, help="prune this often while the run trains")
    p.add_argument("--keep-rounds", type=int, default=16)
    p.add_argument("--min-age-s", type=float, default=60.0)
    p.add_argument("--out", default="out/retention")
    args = p.parse_args(argv)
    policy = RetentionPolicy(keep_rounds=args.keep_rounds, keep_checkpoints=2, min_age_s=args.min_age_s)
    work = Path(tempfile.mkdtemp(prefix="atoll-retention-"))
    root = work / "run"
    url = to_url(str(root))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "atoll.train.local", "run", "--preset", "demo", "--bucket", str(root),
           "--learners", str(args.learners), "--rounds", str(args.rounds), "--log-dir", str(work / "logs")]
    print(f"training {args.rounds} rounds with {args.learners} learners in {root}; pruning every "
          f"{args.every_s:.0f} s (keep {args.keep_rounds} rounds, 2 checkpoints, min age {args.min_age_s:.0f} s)",
          flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=(work / "run.err").open("wb"))
    rows: list[dict] = []
    deleted_bytes = deleted_objects = 0
    first_prune_round: int | None = None
    prune_s: list[float] = []
    try:
        while True:
            try:
                proc.wait(timeout=args.every_s)
                done = True
            except subprocess.TimeoutExpired:
                done = False
            if not (root / "run.json").exists():
                continue
            n, b, secs, latest = prune_once(url, policy)
            deleted_objects += n
            deleted_bytes += b
            prune_s.append(secs)
            if n and first_prune_round is None:
                first_prune_round = latest
            size, objects = folder_bytes(root)
            rows.append({"t_s": time.monotonic() - t0, "round": latest, "with_mib": size / 2**20,
                         "without_mib": (size + deleted_bytes) / 2**20, "objects": objects,
                         "deleted": deleted_objects, "prune_s": secs})
            print(f"  t={rows[-1]['t_s']:6.0f}s round {latest:5d}: {size / 2**20:8.1f} MiB in {objects} objects "
                  f"({(size + deleted_bytes) / 2**20:.1f} MiB without retention; prune {secs:.2f} s, {n} deleted)",
                  flush=True)
            if done:
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    if proc.returncode != 0:
        print(f"the run exited {proc.returncode}: {(work / 'run.err').read_text()[-2000:]}", file=sys.stderr)
        return 1
    # Once the run has ended no writer is in flight, and an hour later its last objects are as old
    # as min_age_s: what a long run's bucket settles to (the window, two checkpoints, each learner's
    # state), whatever its length.
    n, b, _, _ = prune_once(url, policy, now=time.time() + args.min_age_s)
    deleted_objects += n
    deleted_bytes += b
    settled, settled_objects = folder_bytes(root)
    report = RunReader.open(url).verify()
    history = RunReader.open(url).history()
    split = first_prune_round or len(history)
    before = [len(r.accepted) for r in history if r.round <= split]
    after = [len(r.accepted) for r in history if r.round > split]
    # What a wrongly deleted object would cause: a base version or a payload a round could not read.
    harmed = sum(1 for r in history for why in r.rejected.values() if why.kind.value in ("unknown_base", "missing_payload"))
    last = rows[-1]
    print()
    print(f"run: demo preset, {args.learners} learners, {len(history)} rounds in {last['t_s']:.0f} s; prune every "
          f"{args.every_s:.0f} s, keep {args.keep_rounds} rounds and 2 checkpoints, min age {args.min_age_s:.0f} s")
    print(f"{'measure':<52}{'value':>16}")
    print("-" * 68)
    for name, value in (
        ("bucket at the end without retention (MiB)", f"{last['without_mib']:.1f}"),
        ("bucket at the end with retention (MiB)", f"{last['with_mib']:.1f}"),
        ("ratio without / with", f"{last['without_mib'] / max(last['with_mib'], 1e-9):.1f}x"),
        ("  objects younger than min age were kept: the run is live", ""),
        (f"bucket once its last objects are {args.min_age_s:.0f} s old (MiB)", f"{settled / 2**20:.1f}"),
        ("  objects in it", f"{settled_objects}"),
        ("ratio without / settled", f"{(settled + deleted_bytes) / max(settled, 1):.1f}x"),
        ("objects deleted in all", f"{deleted_objects}"),
        ("prune wall s per call, median / max", f"{statistics.median(prune_s):.2f} / {max(prune_s):.2f}"),
        ("contributors per round before the first prune (mean)", f"{statistics.fmean(before):.2f}" if before else "-"),
        ("contributors per round after it (mean)", f"{statistics.fmean(after):.2f}" if after else "-"),
        ("rejections unknown_base / missing_payload (goal 0)", f"{harmed}"),
        ("chain verifies (atoll verify)", "yes" if report.ok else f"NO: {report.problems[:3]}"),
        ("state objects not checked (deleted on purpose)", f"{report.pruned}"),
    ):
        print(f"{name:<52}{value:>16}")
    print(f"plot: {plot(rows, Path(args.out), settled_mib=settled / 2**20, every_s=args.every_s, min_age_s=args.min_age_s)}")
    return 0 if report.ok and not harmed else 1


if __name__ == "__main__":
    sys.exit(main())
