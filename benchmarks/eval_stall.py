"""Evaluation stall: round times with evaluation every N rounds against none, side by side.

    python benchmarks/eval_stall.py [--rounds 120] [--inline-rounds 24] [--every 4] [--interval-s 0.5]
        [--model mini] [--eval-batches 4] [--threads 1] [--repeats 2] [--out out/bench/eval_stall]

One process, one machine, three arms on three runs of the same model, in alternating order
(``--repeats`` blocks of none, thread, inline, then inline, thread, none, ...), so that drift in
the machine's load falls on every arm alike:

* **none**: the recipe never evaluates;
* **thread**: evaluation every ``--every`` rounds by :class:`~atoll.train.evaluator.Evaluator`,
  the synchronizer process's evaluator thread (what ``run_synchronizer`` and the training run
  start), on the CPU: it reads the committed state from the bucket and measures while the next
  rounds run;
* **inline**: the same evaluation inside the round, between the merge and the commit (what the
  synchronizer did before evaluation left the round's path), for scale: ``--inline-rounds`` per
  block (each of its evaluations stalls a round for the whole evaluation).

Each round: two replay learners publish real-sized contributions (random fp32 deltas of the
fragment's shapes, :class:`~atoll.storage.learner_side.LearnerStore`) to the round's fragment, not
timed; the real :class:`~atoll.train.synchronizer.Synchronizer` then polls, merges, takes the
outer step and commits (timed: the round time). Rounds start every ``--interval-s`` (a fleet's
cadence; a round that overruns starts the next one late). The first P rounds of each block warm up
and are left out. The model is ``mini`` (10.9 M parameters, context 256, P = 4) on the standard
library's bytes; one evaluation predicts ``eval_batches x 16 x 256`` tokens (16,384 by default).
``--threads`` is torch's intra-op threads for the whole process (the local synchronizer's default
is 1): the evaluator thread runs its forward passes beside the rounds, on the same process.

Prints a table (round time p50 / p90 / p99 and max per arm, the thread's and inline's ratio to
none, evaluations done and skipped) and writes ``eval_stall.png`` (round time per round, and
the percentiles) and ``eval_stall.json`` under ``--out``. Goal: thread within 10% of none at
p50, p90 and p99.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atoll.core.compress import encode
from atoll.core.config import DilocoConfig
from atoll.core.weights import Counters
from atoll.storage import LearnerStore, SynchronizerStore
from atoll.storage.paths import to_url
from atoll.train.evaluator import Evaluator, EvaluatorOptions
from atoll.train.model import MODEL_PRESETS
from atoll.train.recipe import DataSpec, LearnerSpec, Recipe
from atoll.train.run import EVAL_BATCH_SIZE, create_run, make_evaluator
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions

ARMS = ("none", "thread", "inline")
LEARNERS = 2
FRAGMENTS = 4
BATCH = 8
DELTA_SCALE = 1e-3


@dataclass
class Arm:
    name: str
    round_s: list[float] = field(default_factory=list)
    eval_s: list[float] = field(default_factory=list)
    evaluated: int = 0
    skipped: int = 0


def new_run(root: Path, arm: str, args: argparse.Namespace) -> SynchronizerStore:
    config = DilocoConfig(num_learners=LEARNERS, num_fragments=FRAGMENTS, inner_steps=FRAGMENTS, overlap_steps=2,
                          min_quorum=LEARNERS, initial_grace_s=0.0)
    recipe = Recipe(model=args.model, data=DataSpec(max_corpus_mb=2.0),
                    learners=tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=BATCH) for i in range(LEARNERS)),
                    max_rounds=10**9, eval_every_rounds=0 if arm == "none" else args.every,
                    eval_batches=args.eval_batches, checkpoint_every_rounds=0)
    return create_run(to_url(str(root / f"{arm}-{uuid.uuid4().hex[:6]}")), config, recipe)


def publish(handles: list[LearnerStore], store: SynchronizerStore, p: int, base: int, context: int) -> None:
    """Each replay learner's contribution to fragment ``p`` against version ``base`` (H steps)."""
    g = torch.Generator().manual_seed(p)
    delta = {n: encode(torch.randn(s, generator=g).mul_(DELTA_SCALE), "fp32")
             for n, s in store.manifest.fragment_shapes(p).items()}
    for i, h in enumerate(handles):
        counters = Counters(c_steps=FRAGMENTS, c_tokens=FRAGMENTS * BATCH * context)
        h.publish_contribution(f"learner-{i}", p, base, counters, delta, info={"step_time_s": 0.1, "pool": "replay"})


def run_block(root: Path, arm: Arm, args: argparse.Namespace) -> None:
    """A block of rounds of ``arm`` on a new run; appends the measured round times."""
    store = new_run(root, arm.name, args)
    context = MODEL_PRESETS[args.model]().context_tokens
    handles = [LearnerStore.beside(store.sibling(metered_apart=True)) for _ in range(LEARNERS)]
    sync = Synchronizer(store, options=SynchronizerOptions(poll_interval_s=0.005))
    evaluator = Evaluator(store, options=EvaluatorOptions(device="cpu"), log=lambda _: None) if arm.name == "thread" else None
    inline = make_evaluator(store) if arm.name == "inline" else None
    if evaluator is not None:
        evaluator.start()
    start = time.monotonic()
    for r in range(1, (args.inline_rounds if arm.name == "inline" else args.rounds) + 1):
        p = sync.fragment_of_round(r)
        publish(handles, store, p, sync.versions[p], context)
        t0 = time.perf_counter()
        out = sync.tick()
        while not isinstance(out, RoundSummary):
            time.sleep(0.002)
            out = sync.tick()
        if inline is not None and sync.schedule.evaluates(r):  # as before: in the round, on the host
            e0 = time.perf_counter()
            inline({n: t for frag in sync.fragments for n, t in frag.items()})
            arm.eval_s.append(time.perf_counter() - e0)
            arm.evaluated += 1
        dt = time.perf_counter() - t0
        if evaluator is not None:
            evaluator.committed(r)
        if r > FRAGMENTS:
            arm.round_s.append(dt)
        time.sleep(max(0.0, start + r * args.interval_s - time.monotonic()))
    if evaluator is not None:
        # Not timed: the evaluations still due end here, not in the next block.
        evaluator.close(final_round=r, join_s=600.0)
        arm.evaluated += len(evaluator.written)
        arm.skipped += evaluator.skipped
        arm.eval_s += [rec.eval_s for rec in evaluator.written]


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summary(arms: dict[str, Arm]) -> list[dict[str, float | int | str]]:
    base = arms["none"].round_s
    rows = []
    for arm in arms.values():
        row: dict[str, float | int | str] = {"arm": arm.name, "rounds": len(arm.round_s)}
        for q in (50, 90, 99):
            row[f"p{q}_ms"] = round(1000 * pct(arm.round_s, q), 1)
            row[f"p{q}_ratio"] = round(pct(arm.round_s, q) / pct(base, q), 3)
        row["max_ms"] = round(1000 * max(arm.round_s), 1)
        row["evaluations"], row["skipped"] = arm.evaluated, arm.skipped
        row["eval_s_median"] = round(statistics.median(arm.eval_s), 3) if arm.eval_s else 0.0
        rows.append(row)
    return rows


def table(rows: list[dict[str, float | int | str]], args: argparse.Namespace, tokens: int) -> str:
    head = (f"round time, {args.model} on CPU ({torch.get_num_threads()} torch thread(s)), P={FRAGMENTS} M={LEARNERS}, "
            f"a round every {args.interval_s:g} s, evaluation every {args.every} rounds ({tokens:,} tokens each)\n")
    cols = (f"{'arm':<8} {'rounds':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
            f"{'p50 x':>6} {'p90 x':>6} {'p99 x':>6} {'evals':>6} {'skipped':>7} {'eval s':>7}")
    lines = [head + cols, "-" * len(cols)]
    for r in rows:
        lines.append(f"{r['arm']:<8} {r['rounds']:>6} {r['p50_ms']:>8} {r['p90_ms']:>8} {r['p99_ms']:>8} "
                     f"{r['max_ms']:>8} {r['p50_ratio']:>6} {r['p90_ratio']:>6} {r['p99_ratio']:>6} "
                     f"{r['evaluations']:>6} {r['skipped']:>7} {r['eval_s_median']:>7}")
    return "\n".join(lines)


def plot(arms: dict[str, Arm], rows: list[dict[str, float | int | str]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for arm in arms.values():
        ax[0].plot([1000 * s for s in arm.round_s], lw=0.8, label=arm.name)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("measured round")
    ax[0].set_ylabel("round time (ms)")
    ax[0].legend(fontsize=8)
    width = 0.25
    for i, row in enumerate(rows):
        ax[1].bar([q + (i - 1) * width for q in range(3)], [float(row[f"p{q}_ms"]) for q in (50, 90, 99)],
                  width, label=str(row["arm"]))
    ax[1].set_xticks(range(3), ["p50", "p90", "p99"])
    ax[1].set_yscale("log")
    ax[1].set_ylabel("round time (ms)")
    ax[1].legend(fontsize=8)
    fig.suptitle("round time with evaluation on the synchronizer's thread, inline, and none")
    fig.tight_layout()
    path = out / "eval_stall.png"
    fig.savefig(path, dpi=90)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=120, help="rounds per block of none and thread (the first P warm up)")
    ap.add_argument("--inline-rounds", type=int, default=24, help="rounds per block of inline (0: no inline arm)")
    ap.add_argument("--every", type=int, default=4, help="evaluate every this many rounds")
    ap.add_argument("--interval-s", type=float, default=0.5, help="a round starts this often")
    ap.add_argument("--model", default="mini", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the process")
    ap.add_argument("--repeats", type=int, default=2, help="blocks per arm, in alternating order")
    ap.add_argument("--out", default="out/bench/eval_stall")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = ARMS if args.inline_rounds else ARMS[:2]
    arms = {name: Arm(name) for name in names}
    with tempfile.TemporaryDirectory(prefix="atoll-eval-stall-") as tmp:
        for block in range(args.repeats):
            for name in (names if block % 2 == 0 else tuple(reversed(names))):
                t0 = time.monotonic()
                run_block(Path(tmp), arms[name], args)
                print(f"block {block + 1}: {name}: {time.monotonic() - t0:.0f} s", flush=True)
    tokens = args.eval_batches * EVAL_BATCH_SIZE * MODEL_PRESETS[args.model]().context_tokens
    rows = summary(arms)
    print(table(rows, args, tokens))
    (out / "eval_stall.json").write_text(json.dumps({"args": vars(args), "tokens_per_evaluation": tokens,
                                                     "rows": rows, "round_s": {a.name: a.round_s for a in arms.values()}},
                                                    indent=1))
    print(f"plot: {plot(arms, rows, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
