"""What the trust guards cost an honest run, and what they leave a liar (docs/threat-model.md).

Honest cost: the demo recipe on the virtual clock (benchmarks/quality.py's engine: 4 learners,
one 1.5x slower, K = 1 + grace, RDA), with the guards at their defaults and with the weight-share
cap, the step-share cap, the plausible-steps clip and its prior off, same seed and token budget;
the last line says whether the two runs' final global states are equal bit for bit. The outlier
guard against a fragment's history stays on in both (it shares ``outlier_norm_ratio`` with the
round-median guard). Prints a table, writes a plot.

    python benchmarks/trust_guards.py --tokens 100000 --out out/trust_guards

Worst case (``--worst-case``, no training): one confined liar beside M - 1 honest learners on the
real :class:`~atoll.train.trust.ContributionScreen` (H = P = 24, 1 s a step, equal batches): in
every round it claims the most steps the step bound admits, full batches, against whichever base
gives it more time, and reports a tiny step time. Its share of one round's weight, in the first
round of a run, in steady state, after a 600 s stall of the synchronizer, and in the first round
of a restarted synchronizer (reading back what it had observed, and reading nothing), with the
guards and with the rules before them.

    python benchmarks/trust_guards.py --worst-case

Wall times include the first row's warm-up (the corpus): compare losses, not seconds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from atoll.core.config import DilocoConfig
from atoll.core.fragments import fragment_offsets
from atoll.core.weights import contribution_weights, max_steps_since
from atoll.storage.paths import to_url
from atoll.storage.records import BlobRef, ContributionRecord
from atoll.train.recipe import demo_recipe
from atoll.train.run import create_run, make_evaluator
from atoll.train.trust import ContributionScreen
from atoll.train.virtual import run_virtual

ROWS = {"guards on (defaults)": {},
        "guards off": {"max_weight_share": None, "max_learner_speedup": None, "max_step_share": None}}


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
        "state": store.read_global_state(store.latest_round()).params,
    }


# -- the worst case of one confined liar ----------------------------------------------------------
TPP = 1024
"""Tokens per step of every learner (equal batches: the liar's weight per step is an honest one's)."""
LIAR = "liar"


class _Leases:
    """No leases: every incarnation is 0."""

    def current_incarnation(self, learner_id: str) -> int:
        return 0


def record(lid: str, fragment: int, base: int, c_steps: int, c_tokens: int, r: int, step_s: float
           ) -> ContributionRecord:
    return ContributionRecord(
        key=f"learners/{lid}/contributions/{fragment:04d}/{base:08d}/{r:08d}-{c_steps}.json",
        learner_id=lid, fragment=fragment, base_version=base, c_steps=c_steps, c_tokens=c_tokens,
        payload=BlobRef(sha256="0" * 64, nbytes=0), tensors={}, created_at=0.0, info={"step_time_s": step_s})


class Fleet:
    """M - 1 honest learners and one liar on the real :class:`ContributionScreen` (no bucket)."""

    def __init__(self, M: int, *, H: int = 24, P: int = 24, honest_steps: int | None = None,
                 guards: bool = True) -> None:
        self.M, self.H, self.P, self.guards = M, H, P, guards
        self.honest_steps = H if honest_steps is None else honest_steps
        self.offsets = fragment_offsets(P, H)
        self.versions = [0] * P
        self.previous = [0] * P
        self.t = 0.0
        self.round = 0
        self.screen = self.new_screen()

    def new_screen(self, recall: dict[str, float] | None = None) -> ContributionScreen:
        """A (re)started synchronizer's screen; ``recall``: what it reads back from commit records.
        Without the guards: the rules before the prior and the step-share cap."""
        kw: dict[str, Any] = ({"max_step_share": DilocoConfig().max_step_share} if self.guards
                              else {"max_step_share": None, "unobserved_intervals": None})
        s = ContributionScreen(_Leases(), offsets=self.offsets, inner_steps=self.H, num_fragments=self.P,
                               max_learner_speedup=4.0, token_bounds=None, started_at_s=self.t, **kw)
        if recall is not None and self.guards:  # the rules before the guards read nothing back
            s.observed.recall(recall)
        return s

    def play(self, *, stall_s: float = 0.0) -> float:
        """One round: the honest learners publish at the honest pace (1 s a step; through a stall
        of the synchronizer of ``stall_s`` they keep stepping, as learners never wait), the liar
        claims the most the step bound admits, against whichever base gives it more time, with
        full batches and a tiny reported step time. Returns the liar's share of the round's weight."""
        self.t += self.H / self.P + stall_s
        r = self.round + 1
        p = (r - 1) % self.P
        honest = self.honest_steps + int(stall_s)
        recs = [record(f"honest-{i}", p, self.versions[p], honest, honest * TPP, r, 1.0) for i in range(self.M - 1)]
        best = None
        for base in {self.versions[p], self.previous[p]}:
            elapsed = self.t - self.screen.base_seen_at_s(base)
            steps = max_steps_since(base, r, self.H, elapsed_s=elapsed)
            if best is None or elapsed > best[1]:
                best = (base, elapsed, steps)
        base, _, steps = best
        recs.append(record(LIAR, p, base, steps, steps * TPP, r, 1e-9))
        recs.sort(key=lambda x: (x.base_version, x.c_steps))
        screened = self.screen.screen(recs, r, self.t)
        weighed = self.screen.weighed(screened.candidates.values())
        w = contribution_weights(weighed).weights
        share = sum(v for k, v in w.items() if k.startswith(f"learners/{LIAR}/"))
        self.previous[p], self.versions[p] = self.versions[p], r
        self.round = r
        self.screen.saw_commit(r, self.t)
        self.screen.open_round()
        return share


PHASES = ("first round (honest H steps)", "first round (honest 1 step)", "steady state", "after a 600 s stall",
          "restart, read back", "restart, nothing read")


def liar_shares(M: int, *, guards: bool) -> dict[str, float]:
    """The liar's share of one round's weight in each of :data:`PHASES` (steady state: the
    largest over a third cycle of rounds)."""
    out = {PHASES[0]: Fleet(M, guards=guards).play(), PHASES[1]: Fleet(M, guards=guards, honest_steps=1).play()}
    f = Fleet(M, guards=guards)
    steady = [f.play() for _ in range(3 * f.P)]
    out[PHASES[2]] = max(steady[2 * f.P:])
    out[PHASES[3]] = f.play(stall_s=600.0)
    observed = f.screen.observed.observed_stats()
    for phase, recall in ((PHASES[4], observed), (PHASES[5], None)):
        f.screen = f.new_screen(recall=recall)
        out[phase] = f.play()
    return out


def worst_case() -> None:
    cols = [(M, g) for M in (2, 8) for g in (False, True)]
    shares = {c: liar_shares(c[0], guards=c[1]) for c in cols}
    print(f"{'liar share of one round':30s} " + " ".join(f"{f'M={M} ' + ('guards' if g else 'before'):>12s}"
                                                         for M, g in cols))
    for phase in PHASES:
        print(f"{phase:30s} " + " ".join(f"{shares[c][phase]:12.3f}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="token budget per row (all learners)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/trust_guards", help="folder for the plot")
    ap.add_argument("--worst-case", action="store_true", help="the liar's worst share instead (no training)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.worst_case:
        worst_case()
        return
    rows = [one(name, a.tokens, a.seed) for name in ROWS]
    print(f"{'row':22s} {'val loss':>9s} {'rounds':>7s} {'merged/rnd':>10s} {'clipped':>8s} {'outliers':>8s} "
          f"{'max share':>9s} {'wall s':>7s}")
    for r in rows:
        print(f"{r['name']:22s} {r['loss']:9.4f} {r['rounds']:7d} {r['merged']:10.2f} {r['clipped']:8d} "
              f"{r['outliers']:8d} {r['share']:9.3f} {r['wall_s']:7.1f}")
    print(f"loss ratio on/off: {rows[0]['loss'] / rows[1]['loss']:.4f}")
    same = rows[0]["state"].keys() == rows[1]["state"].keys() and all(
        torch.equal(rows[0]["state"][n], rows[1]["state"][n]) for n in rows[0]["state"])
    print(f"final global state on/off equal bit for bit: {same}")
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
