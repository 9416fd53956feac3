"""Save cost: what learners' inner-state saves send up, per token trained, against their contributions.

    python benchmarks/save_cost.py                # the table, then 3 measured runs of 2000 steps: ~2.5 min, one core
    python benchmarks/save_cost.py --steps 3000   # what docs/benchmarks.md shows: ~3.5 min
    python benchmarks/save_cost.py --steps 0      # the table from the byte formulas only (seconds)

Two parts:

* **planned** (:mod:`atoll.train.save_costs`, the planner's byte formulas): the demo and paper
  presets (the demo's tiny GPT, 4 learners of 8 x 128 tokens; the paper's H = P = 24 with fp32
  deltas) and the gpu preset at 86 M and at 1 B parameters, with fp32 and bf16 moments: a
  learner's contributions per token, one save, and at the recipe's default cadence (saves within
  ``save_uplink_share`` = 10% of its other uplink bytes) the steps between saves, the saves'
  bytes per token and their share; beside them, the fixed cadence the presets had before (every
  50 steps, the gpu preset every 2000).
* **measured**: a real learner (atoll's own loop, ``run_learner``, with its lease, fetcher and
  background writers) and a real synchronizer (a thread of this process) on a local bucket, the
  ``micro`` GPT (0.14 M parameters, batch 4 x 64) so that a CPU reaches several budget-paced saves
  in a minute, with the demo's and the paper's ``DilocoConfig`` (M = 1) and the recipe's default
  save fields; and the demo's config with the former fixed 50 steps, for scale. Counted: the
  learner's object store (every byte it sent up) and every save it wrote (payload and record,
  read back from the bucket). Saves' share is periodic saves over the learner's other uplink
  bytes (contributions, records, heartbeats, leases); the save on exit is counted apart.

Prints both tables and writes ``save_cost.png`` (saves' share of the uplink per preset and
cadence, planned and measured) and ``save_cost.json`` under ``--out``. Goal: at the default
cadence saves cost at most 10% of a learner's uplink bytes per token at the demo and paper presets.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from atoll.core.config import DilocoConfig, paper
from atoll.storage import LearnerStore, SynchronizerStore, paths
from atoll.storage.paths import to_url
from atoll.train.inner import run_learner
from atoll.train.learner import LearnerOptions
from atoll.train.recipe import DataSpec, InnerOptimConfig, LearnerSpec, Recipe, demo_recipe
from atoll.train.run import create_run
from atoll.train.save_costs import FIXED_CADENCE, preset_save_costs, save_cost_lines
from atoll.train.sync_loop import run_synchronizer

RUNS = ("demo", "paper", "demo-fixed-50")
"""The measured runs: the demo's and the paper's config at the default cadence, the demo's at 50 steps."""


@dataclass
class Measured:
    name: str
    steps: int
    tokens: int
    saves: int
    """Periodic saves (the save on exit not included)."""
    save_bytes: int
    """Their bytes up: payloads and records."""
    exit_save_bytes: int
    other_up_bytes: int
    """Everything else the learner sent up."""
    wall_s: float

    @property
    def share(self) -> float:
        return self.save_bytes / self.other_up_bytes if self.other_up_bytes else 0.0

    @property
    def save_bytes_per_token(self) -> float:
        return self.save_bytes / self.tokens if self.tokens else 0.0

    @property
    def other_bytes_per_token(self) -> float:
        return self.other_up_bytes / self.tokens if self.tokens else 0.0


SAVED: list[tuple[int, int]] = []
"""(step, bytes up) of every save the measured learner wrote, in order."""


class CountedSaves(LearnerStore):
    """The learner's store, noting each save's bytes up (its payload and its record, read back)."""

    def save_learner_state(self, learner_id: str, tensors: Any, meta: Any = None) -> None:
        super().save_learner_state(learner_id, tensors, meta)
        rec = self.load_learner_state_record(learner_id)
        record = self.store.get(paths.learner_state_key(learner_id))
        assert rec is not None
        SAVED.append((int(rec.meta.get("step", 0)), rec.payload.nbytes + len(record)))


def _config(name: str) -> DilocoConfig:
    demo = demo_recipe(1)[0]
    return (paper(1) if name == "paper" else demo).replace(num_learners=1, min_quorum=1)


def measure(name: str, *, steps: int, root: Path) -> Measured:
    """One learner and the synchronizer, ``steps`` inner steps of the micro GPT."""
    config = _config(name)
    recipe = Recipe(model="micro", data=DataSpec(max_corpus_mb=2.0),
                    learners=(LearnerSpec(learner_id="learner-0", batch_size=4),),
                    inner=InnerOptimConfig(lr=3e-3, warmup_steps=5), max_rounds=1_000_000, eval_every_rounds=0,
                    save_every_steps=FIXED_CADENCE["demo"] if name.endswith("fixed-50") else None)
    url = to_url(str(root / name))
    sync_store = create_run(url, config, recipe)
    stop = threading.Event()
    sync = threading.Thread(target=run_synchronizer, args=(SynchronizerStore.beside(sync_store),),
                            kwargs={"should_stop": stop.is_set, "log": lambda _: None}, daemon=True)
    sync.start()
    SAVED.clear()
    store = CountedSaves.open(url)
    t0 = time.perf_counter()
    try:
        summary = run_learner(store, "learner-0", log=lambda _: None,
                              options=LearnerOptions(max_steps=steps, poll_interval_s=0.05, threads=1,
                                                     handle_sigterm=False, orphan_timeout_s=None))
    finally:
        stop.set()
        sync.join(timeout=60)
    wall = time.perf_counter() - t0
    up = store.store.wire_counts().bytes_up
    periodic, last = SAVED[:-1], SAVED[-1]  # the last save is the one on exit
    saved = sum(b for _, b in periodic)
    return Measured(name=name, steps=summary.steps, tokens=summary.tokens, saves=len(periodic), save_bytes=saved,
                    exit_save_bytes=last[1], other_up_bytes=up - saved - last[1], wall_s=wall)


def measured_lines(rows: list[Measured]) -> list[str]:
    lines = [f"{'run':<14} {'steps':>6} {'tokens':>9} {'saves':>5} {'saves B/tok':>11} {'other up B/tok':>14} "
             f"{'share':>6} {'exit save':>10} {'wall s':>7}"]
    lines += [f"{m.name:<14} {m.steps:>6,} {m.tokens:>9,} {m.saves:>5} {m.save_bytes_per_token:>11,.2f} "
              f"{m.other_bytes_per_token:>14,.2f} {m.share:>6.1%} {m.exit_save_bytes / 2**20:>6.2f} MiB {m.wall_s:>7.1f}"
              for m in rows]
    return lines


def plot(costs: list[Any], rows: list[Measured], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    labels = [f"{c.name}\n{c.moments}" for c in costs]
    x = range(len(costs))
    ax.bar([i - 0.2 for i in x], [100 * c.old_share for c in costs], width=0.4, label="fixed cadence (before)")
    ax.bar([i + 0.2 for i in x], [100 * c.share for c in costs], width=0.4, label="default budget (planned)")
    for m in rows:
        at = next((i for i, c in enumerate(costs) if c.name == m.name.split("-")[0] and c.moments == "fp32"), None)
        if at is not None:
            ax.plot([at + (-0.2 if "fixed" in m.name else 0.2)], [100 * m.share], "kD",
                    label="measured (micro GPT, CPU)" if m is rows[0] else None)
    ax.axhline(10, color="gray", linestyle="--", linewidth=1, label="goal: 10%")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("saves' bytes / other uplink bytes (%)")
    ax.set_title("Inner-state saves against a learner's uplink")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="inner steps of each measured run (0: planned only)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"measured runs, of {','.join(RUNS)}")
    ap.add_argument("--out", default="out/bench/save_cost")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    costs = preset_save_costs()
    print("planned (byte formulas): bytes up per token a learner trains; share: saves over its contributions")
    print("\n".join(save_cost_lines(costs)), flush=True)
    rows: list[Measured] = []
    if args.steps > 0:
        names = [n for n in args.runs.split(",") if n]
        unknown = sorted(set(names) - set(RUNS))
        if unknown:
            ap.error(f"--runs: unknown {unknown}; choose from {RUNS}")
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                print(f"measuring {name}: {args.steps} steps of the micro GPT ...", flush=True)
                rows.append(measure(name, steps=args.steps, root=Path(tmp)))
        print("\nmeasured (micro GPT, one learner + synchronizer, CPU): bytes up per token; share: periodic saves "
              "over the learner's other uplink")
        print("\n".join(measured_lines(rows)))
    png = plot(costs, rows, out / "save_cost.png")
    (out / "save_cost.json").write_text(json.dumps({
        "planned": [{**asdict(c), "share": c.share, "old_share": c.old_share} for c in costs],
        "measured": [{**asdict(m), "share": m.share} for m in rows]}, indent=1))
    print(f"\nwrote {png} and {out / 'save_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
