"""What the trust guards cost an honest run (docs/threat-model.md): the demo recipe on the
virtual clock (benchmarks/quality.py's engine: 4 learners, one 1.5x slower, K = 1 + grace, RDA),
with the guards at their defaults and with the weight-share cap and the plausible-steps clip off,
same seed and token budget. The outlier guard against a fragment's history stays on in both (it
shares ``outlier_norm_ratio`` with the round-median guard). Prints a table, writes a plot.

    python benchmarks/trust_guards.py --tokens 100000 --out out/trust_guards

Wall times include the first row's warm-up (the corpus): compare losses, not seconds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from atoll.storage.paths import to_url
from atoll.train.recipe import demo_recipe
from atoll.train.run import create_run, make_evaluator
from atoll.train.virtual import run_virtual

ROWS = {"guards on (defaults)": {}, "guards off": {"max_weight_share": None, "max_learner_speedup": None}}


def one(name: str, tokens: int, seed: int) -> dict:
    config, recipe = demo_recipe()
    store = create_run(to_url(tempfile.mkdtemp() + "/run"), config.replace(**ROWS[name]), recipe)
    t0 = time.perf_counter()
    res = run_virtual(store, token_budget=tokens, base_step_s=1.0, step_noise=0.1, seed=seed,
                      evaluate=make_evaluator(store), eval_every_tokens=max(1, tokens // 8))
    hist = store.history()
    return {
        "name": name, "loss": res.curve[-1][1], "curve": res.curve, "rounds": res.rounds,
        "merged": res.merged_per_round, "clipped": sum(len(r.stats.get("steps_clipped", {})) for r in hist),
        "outliers": sum(1 for r in hist for w in r.rejected.values() if w.kind.value == "outlier"),
        "share": max((a.weight for r in hist for a in r.accepted if len(r.accepted) > 1), default=0.0),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="token budget per row (all learners)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/trust_guards", help="folder for the plot")
    a = ap.parse_args()
    rows = [one(name, a.tokens, a.seed) for name in ROWS]
    print(f"{'row':22s} {'val loss':>9s} {'rounds':>7s} {'merged/rnd':>10s} {'clipped':>8s} {'outliers':>8s} "
          f"{'max share':>9s} {'wall s':>7s}")
    for r in rows:
        print(f"{r['name']:22s} {r['loss']:9.4f} {r['rounds']:7d} {r['merged']:10.2f} {r['clipped']:8d} "
              f"{r['outliers']:8d} {r['share']:9.3f} {r['wall_s']:7.1f}")
    print(f"loss ratio on/off: {rows[0]['loss'] / rows[1]['loss']:.4f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r, style in zip(rows, ("-", "--"), strict=True):
        ax.plot([t for t, _ in r["curve"]], [v for _, v in r["curve"]], style, label=r["name"])
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("trust guards on an honest run (demo recipe, virtual clock)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "trust_guards.png", dpi=120)
    print(f"plot: {out / 'trust_guards.png'}")


if __name__ == "__main__":
    main()
