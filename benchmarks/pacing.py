"""Round pacing: effective H, merged-work share and bytes per token, pacing off against on.

    python benchmarks/pacing.py [--pacing 0,0.5,0.75,1] [--steps 110] [--noise 0.5] [--seed 0] [--out out/]

The demo's algorithm (H = P = 8, tau = 2, K = 1 + grace, M = 4 with one learner 1.5x slower) on
the micro GPT, with the real learners and synchronizer on a virtual clock
(:func:`atoll.train.virtual.run_virtual`: seconds of virtual time, so the ratios do not depend on
the machine's load), one run per ``DilocoConfig.round_pacing`` at an equal token budget
(``--steps`` inner steps per fast learner). ``--noise`` spreads each step's time by up to that
fraction, which staggers the learners' publishes as machines do.

Columns: rounds committed; contributions merged per round; **effective H**, the mean inner steps
per merged contribution (:func:`atoll.runs.contributions.effective_h`, after the first pass over the
fragments); **merged-work share**, the new work merged (``MergedWork``, tokens x fragment size)
over all the work the learners did; bytes moved per token (deltas up, new fragments down to every
learner); the global model's validation loss at the end (one seed: a hint, not a quality claim,
which is benchmarks/quality.py's). Writes ``pacing.png``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from atoll.runs.contributions import effective_h
from atoll.runs.goodput import MergedWork
from atoll.storage.paths import to_url
from atoll.train.recipe import LearnerSpec, smoke_recipe
from atoll.train.run import create_run, make_evaluator
from atoll.train.virtual import run_virtual


def run_one(root: Path, pacing: float, *, steps: int, noise: float, seed: int) -> dict:
    config, recipe = smoke_recipe(4, max_rounds=100_000)
    config = config.replace(num_fragments=8, inner_steps=8, overlap_steps=2, initial_grace_s=0.5,
                            round_pacing=pacing)
    learners = tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=4, slowdown=1.5 if i == 3 else 1.0)
                     for i in range(4))
    recipe = recipe.replace(learners=learners)
    store = create_run(to_url(str(root / f"pacing-{pacing:g}")), config, recipe)
    context = 64
    res = run_virtual(store, token_budget=4 * 4 * context * steps, step_noise=noise, seed=seed,
                      evaluate=make_evaluator(store))
    history = store.history()
    eff = effective_h(history[config.num_fragments:])
    ledger, merged = MergedWork(), 0
    for rec in history:
        for _, new_tokens in ledger.round(rec).values():
            merged += new_tokens * store.plan.fragment_numel(rec.fragment)
    return {"pacing": pacing, "h": config.inner_steps, "rounds": res.rounds, "merged": res.merged_per_round,
            "eff_h": eff[0] if eff else float("nan"),
            "share": merged / (res.tokens * sum(store.plan.sizes.values())),
            "bytes_per_token": res.bytes_moved / res.tokens, "loss": res.curve[-1][1]}


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["pacing"] for r in rows]
    a.plot(x, [r["eff_h"] for r in rows], "o-", label="effective H")
    a.axhline(rows[0]["h"], ls="--", c="gray", label=f"H = {rows[0]['h']}")
    a.set_xlabel("round_pacing")
    a.set_ylabel("inner steps per merged contribution")
    a.legend()
    b.plot(x, [r["bytes_per_token"] for r in rows], "o-", c="C1")
    b.set_xlabel("round_pacing")
    b.set_ylabel("bytes moved per token")
    fig.suptitle("round pacing (virtual clock, K = 1 + grace, M = 4)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pacing.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pacing", default="0,0.5,0.75,1")
    p.add_argument("--steps", type=int, default=110, help="inner steps per fast learner")
    p.add_argument("--noise", type=float, default=0.5, help="step-time spread (fraction)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"H = P = 8, tau = 2, K = 1 + grace, M = 4 (one 1.5x slower), micro GPT, {args.steps} steps per fast "
          f"learner, step noise {args.noise:g}, seed {args.seed}")
    print(f"{'round_pacing':>12} {'rounds':>6} {'merged/round':>12} {'effective H':>11} {'merged-work share':>17} "
          f"{'B/token':>8} {'val loss':>8}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pacing in (float(x) for x in args.pacing.split(",")):
            r = run_one(Path(tmp), pacing, steps=args.steps, noise=args.noise, seed=args.seed)
            rows.append(r)
            print(f"{r['pacing']:>12g} {r['rounds']:>6} {r['merged']:>12.2f} {r['eff_h']:>11.2f} {r['share']:>17.1%} "
                  f"{r['bytes_per_token']:>8.0f} {r['loss']:>8.4f}", flush=True)
    print(f"plot: {plot(rows, Path(args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
