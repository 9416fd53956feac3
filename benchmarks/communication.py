"""Communication: what Decoupled DiLoCo puts on the wire, per round and per token, against data-parallel.

    python benchmarks/communication.py --quick     # the demo preset's config, 80 steps per learner: 2-5 min
    python benchmarks/communication.py             # demo, its fp32 and H = 24 variants, paper: 200 steps each, ~40 min
    python benchmarks/communication.py --configs demo,demo-bf16 --steps 300

Each config trains the demo recipe (tiny GPT, 4 learners with batch 8 x 128, one 1.5x slower) with
the real learners and synchronizer on a virtual clock (:func:`atoll.train.virtual.run_virtual`,
``own_stores``: every learner on its own handle of the bucket, counted apart, reading each version
it adopts itself, as separate processes do). The counts are the object stores' own
(:mod:`atoll.storage.wire`): requests by kind (PUT, GET, HEAD, LIST, DELETE) and body bytes, up
and down, of every learner and of the synchronizer, after the learners joined (joining, the whole
model once, is printed apart). Beside them:

* the records' view (:class:`atoll.runs.traffic.WireTracker` over the commit records: each
  learner's own report and the synchronizer's ``stats.wire``), which ``atoll status`` shows;
* the planner's prediction (:func:`atoll.sim.planner.plan_wire`) for the same config and model;
* effective H (mean inner steps per merged contribution after the first pass over the fragments,
  :func:`atoll.runs.contributions.effective_h`) against the configured H, and the merged-work share (new
  work merged, tokens x fragment size, over all the work the learners did);
* data-parallel on the same model with the same number of workers, counted the same way (every
  worker's bytes sent and received): a ring all-reduce of the whole gradient every step,
  ``2 (M - 1) / M`` gradients out of each worker and as many in, fp32 and bf16.

The last line is the default configuration's (the demo preset's ``DilocoConfig``): the learners'
bytes per token (up and down, payloads and records) over DP fp32's, ``bytes per token vs DP: 1/N``.

Not in these counts: learners' inner-state saves for rejoin (paced by the recipe's budget,
``save_uplink_share``, or its ``save_every_steps``; a virtual run does not save; printed from the planner), leases and heartbeats (a few hundred bytes
every few seconds of wall time), and the real fetcher's polling on a timer (a virtual learner
polls once per step). Writes ``communication.png`` (bytes per token by direction) and
``communication.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from atoll.core.config import DilocoConfig, paper
from atoll.runs.contributions import effective_h
from atoll.runs.goodput import MergedWork
from atoll.runs.traffic import WireTracker
from atoll.sim.planner import plan_wire
from atoll.storage.paths import to_url
from atoll.storage.wire import WireCounts
from atoll.train.model import MODEL_PRESETS, GPTConfig, build_model, count_parameters
from atoll.train.recipe import Recipe, demo_recipe
from atoll.train.run import create_run, make_evaluator
from atoll.train.virtual import run_virtual

KINDS = (("puts", "PUT"), ("gets", "GET"), ("heads", "HEAD"), ("lists", "LIST"), ("deletes", "DEL"))


def dp_ring_bytes_per_token(n_params: int, workers: int, tokens_per_step: int, precision: str = "fp32") -> float:
    """Data-parallel with ``workers`` workers, every worker's bytes sent and received, per token:
    a ring all-reduce of the whole gradient every step sends ``2 (W - 1) / W`` gradient sizes out
    of each worker and receives as many; ``tokens_per_step``: tokens of one step, all workers."""
    grad = n_params * {"fp32": 4, "bf16": 2}[precision]
    return workers * 2 * (2 * (workers - 1) / workers * grad) / tokens_per_step


def configs(base: DilocoConfig) -> dict[str, DilocoConfig]:
    """The configs this benchmark knows, by name: the demo preset's (``demo``), variants of it with
    the precisions, H and pacing set explicitly, and the paper's (``paper``, M as the demo's)."""
    out = {"demo": base, "paper": paper(base.num_learners)}
    for codec in ("fp32", "bf16", "int4"):
        out[f"demo-{codec}"] = base.replace(compression=codec, downlink_compression=codec, round_pacing=0.0)
    out["demo-int4-h24"] = out["demo-int4"].replace(inner_steps=24)
    out["demo-int4-h24-paced"] = out["demo-int4-h24"].replace(round_pacing=1.0)
    return out


FULL = ("demo", "demo-fp32", "demo-int4-h24", "demo-int4-h24-paced", "paper")
"""The configs a run without ``--quick`` or ``--configs`` measures."""


def describe(c: DilocoConfig) -> str:
    d = c.to_dict()
    return (f"H={c.inner_steps} P={c.num_fragments} tau={c.overlap_steps} K={c.min_quorum}"
            f"{'+grace' if c.grace_factor > 0 else ''}, up {c.compression}, down {d.get('downlink_compression', 'fp32')}, "
            f"pacing {d.get('round_pacing', 0):g}, outer lr {c.outer_lr:g} mu {c.outer_momentum:g}")


def measure(config: DilocoConfig, recipe: Recipe, *, steps: int, noise: float, seed: int, root: Path) -> dict:
    """One virtual run of ``config`` on ``recipe``'s model and learners, ``steps`` inner steps per
    learner on average; what every party's store sent, the records' view and the plan."""
    store = create_run(to_url(str(root / f"run-{time.monotonic_ns()}")), config, recipe)
    tokens_per_step = recipe.learners[0].island_batch * gpt_of(recipe).context_tokens
    res = run_virtual(store, token_budget=steps * len(recipe.learners) * tokens_per_step, step_noise=noise, seed=seed,
                      evaluate=make_evaluator(store), own_stores=True)
    history = store.history()
    learners = sum((c for k, c in res.wire.items() if k != "synchronizer"), WireCounts())
    tracker = WireTracker()
    ledger, merged = MergedWork(), 0
    for rec in history:
        tracker.add(rec)
        for _, new_tokens in ledger.round(rec).values():
            merged += new_tokens * store.plan.fragment_numel(rec.fragment)
    eff = effective_h(history[config.num_fragments:])
    shapes = [s for p in range(store.plan.num_fragments) for s in store.manifest.fragment_shapes(p).values()]
    params = sum(math.prod(s) for s in shapes)
    kwargs = {"params": params, "tokens_per_step": tokens_per_step, "tensors": len(shapes),
              "save_every_steps": recipe.save_every_steps, "save_uplink_share": recipe.save_uplink_share,
              "save_moments": recipe.save_moments_dtype}
    if "download_precision" in inspect.signature(plan_wire).parameters:
        kwargs["download_precision"] = getattr(config, "downlink_compression", "fp32")
    planned = plan_wire(config, **kwargs)  # type: ignore[arg-type]
    return {
        "config": config.to_dict(), "params": params, "tokens": res.tokens, "rounds": res.rounds,
        "tokens_per_step": tokens_per_step, "virtual_s": res.virtual_s, "loss": res.curve[-1][1] if res.curve else None,
        "merged_per_round": res.merged_per_round, "effective_h": eff[0] if eff else float("nan"),
        "merged_share": merged / (res.tokens * sum(store.plan.sizes.values())),
        "wire": {k: c.to_dict() for k, c in res.wire.items()}, "learners": learners.to_dict(),
        "join": {k: c.to_dict() for k, c in res.join_wire.items()},
        "records": {"learners": tracker.learners.to_dict(), "synchronizer": tracker.synchronizer.to_dict(),
                    "learner_tokens": tracker.learner_tokens},
        "planned": planned_figures(planned, tokens_per_step),
        "dp": {p: dp_ring_bytes_per_token(params, len(recipe.learners), len(recipe.learners) * tokens_per_step, p)
               for p in ("fp32", "bf16")},
    }


def planned_figures(planned, tokens_per_step: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The plan for all learners together, per round and per token (every learner contributing to
    every round, one round per H / P steps of each learner)."""
    m = planned.learners
    tokens_per_round = m * planned.steps_per_round * tokens_per_step
    return {"up": planned.up_bytes_per_token, "down": planned.down_bytes_per_token,
            "puts": m * planned.up_requests_per_round, "gets": m * planned.down_requests_per_round,
            "up_round": m * planned.up_bytes_per_round, "down_round": m * planned.down_bytes_per_round,
            "sync_up_round": planned.sync_up_bytes_per_round, "sync_down_round": planned.sync_down_bytes_per_round,
            "sync_up": planned.sync_up_bytes_per_round / tokens_per_round,
            "sync_down": planned.sync_down_bytes_per_round / tokens_per_round, "saves": planned.save_bytes_per_token}


def gpt_of(recipe: Recipe) -> GPTConfig:
    """The recipe's GPT (a preset name or a config dict)."""
    m = recipe.model
    return MODEL_PRESETS[m]() if isinstance(m, str) else GPTConfig.from_dict(dict(m))


def fold(n: float) -> str:
    """``1/N`` with N to two significant figures at least."""
    return f"1/{n:.0f}" if n >= 10 else f"1/{n:.1f}"


def table(name: str, r: dict, say) -> None:  # type: ignore[no-untyped-def]
    c = DilocoConfig.from_dict(r["config"])
    t, rounds = r["tokens"], max(1, r["rounds"])
    say("")
    say(f"== {name}: {describe(c)} ==")
    say(f"{r['params']:,} params, {len(r['wire']) - 1} learners x {r['tokens_per_step']:,} tokens per step, "
        f"{t:,} tokens, {r['rounds']} rounds, {r['virtual_s']:.0f} virtual s; final validation loss "
        f"{r['loss']:.4f} (a hint: benchmarks/quality.py measures quality)")
    say(f"effective H {r['effective_h']:.1f} (H = {c.inner_steps}); merged-work share {r['merged_share']:.0%}; "
        f"{r['merged_per_round']:.2f} contributions merged per round")
    head = (f"{'party':16s} " + " ".join(f"{k + '/rd':>7s}" for _, k in KINDS)
            + f" {'up B/rd':>10s} {'down B/rd':>10s} {'up B/tok':>9s} {'down B/tok':>10s} {'req/ktok':>8s}")
    say(head)
    say("-" * len(head))
    parties = [("learners (all)", r["learners"])] + [(f"  {k}", v) for k, v in r["wire"].items() if k != "synchronizer"]
    parties.append(("synchronizer", r["wire"].get("synchronizer", WireCounts().to_dict())))
    for who, w in parties:
        reqs = sum(w[f] for f, _ in KINDS)
        say(f"{who:16s} " + " ".join(f"{w[f] / rounds:7.2f}" for f, _ in KINDS)
            + f" {w['bytes_up'] / rounds:10,.0f} {w['bytes_down'] / rounds:10,.0f} {w['bytes_up'] / t:9.1f} "
            f"{w['bytes_down'] / t:10.1f} {1000 * reqs / t:8.2f}")
    sw = r["wire"].get("synchronizer", WireCounts().to_dict())
    say("requests per 1,000 tokens: " + "; ".join(
        f"{who} " + " ".join(f"{k} {1000 * w[f] / t:.2f}" for f, k in KINDS)
        for who, w in (("learners", r["learners"]), ("synchronizer", sw))))
    lw, p = r["learners"], r["planned"]
    total = (lw["bytes_up"] + lw["bytes_down"]) / t
    say(f"{'planned learners':16s} {p['puts']:7.2f} {p['gets']:7.2f} {'':23s} {p['up_round']:10,.0f} "
        f"{p['down_round']:10,.0f} {p['up']:9.1f} {p['down']:10.1f}   (plan_wire; polls not planned)")
    say(f"{'planned sync':16s} {'':39s} {p['sync_up_round']:10,.0f} {p['sync_down_round']:10,.0f} "
        f"{p['sync_up']:9.1f} {p['sync_down']:10.1f}")
    rec = r["records"]
    if rec["learner_tokens"]:
        say(f"records' view (WireTracker): learners {(rec['learners']['bytes_up'] + rec['learners']['bytes_down']) / rec['learner_tokens']:.1f} "
            f"B/tok (their own reports, joining included), synchronizer {(rec['synchronizer']['bytes_up'] + rec['synchronizer']['bytes_down']) / t:.1f} B/tok")
    join = sum((WireCounts(**v) for v in r["join"].values()), WireCounts())
    say(f"joining (once, not above): {join.line()}")
    say(f"learners, up + down: {total:,.1f} B/token, planned {p['up'] + p['down']:,.1f} "
        f"({(p['up'] + p['down']) / total:.2f}x measured); the recipe's inner-state saves would add {p['saves']:,.1f} "
        f"B/token up (planned)")
    dp32, dp16 = r["dp"]["fp32"], r["dp"]["bf16"]
    say(f"data-parallel (ring all-reduce, same workers and model, every worker's bytes sent and received): "
        f"fp32 {dp32:,.0f} B/token, bf16 {dp16:,.0f} B/token")
    say(f"learners vs DP fp32: {fold(dp32 / total)}, vs DP bf16: {fold(dp16 / total)}; with the synchronizer: "
        f"{fold(dp32 / (total + sum(r['wire']['synchronizer'][f] for f in ('bytes_up', 'bytes_down')) / t))} of DP fp32; "
        f"with saves: {fold(dp32 / (total + p['saves']))} of DP fp32")


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 4, 4.5))
    x = range(len(names))
    parts = [("learners up", lambda r: r["learners"]["bytes_up"]), ("learners down", lambda r: r["learners"]["bytes_down"]),
             ("synchronizer up", lambda r: r["wire"]["synchronizer"]["bytes_up"]),
             ("synchronizer down", lambda r: r["wire"]["synchronizer"]["bytes_down"])]
    width = 0.2
    for i, (label, get) in enumerate(parts):
        ax.bar([xi + (i - 1.5) * width for xi in x], [get(results[n]) / results[n]["tokens"] for n in names], width,
               label=label)
    dp = results[names[0]]["dp"]
    ax.axhline(dp["fp32"], color="k", lw=1, label="DP fp32 (all workers)")
    ax.axhline(dp["fp32"] / 100, color="gray", lw=1, ls=":", label="1/100 of DP fp32")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("bytes per token trained")
    ax.set_title("atoll: bytes per token by direction (virtual clock, counted object stores)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y", which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the demo config only, 80 steps per learner (2-5 min)")
    ap.add_argument("--configs", default="", help="comma-separated names (default: demo with --quick, else "
                    f"{','.join(FULL)}): demo, paper, demo-fp32, demo-bf16, demo-int4, demo-int4-h24, demo-int4-h24-paced")
    ap.add_argument("--steps", type=int, default=0, help="inner steps per learner, on average (default 80 with "
                    "--quick, else 200)")
    ap.add_argument("--noise", type=float, default=0.5, help="each step's virtual time spread by up to this fraction "
                    "(staggers the learners' publishes, as machines do)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base, recipe = demo_recipe()
    known = configs(base)
    names = [n for n in a.configs.split(",") if n] or (["demo"] if a.quick else list(FULL))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}: choose from {sorted(known)}")
    steps = a.steps or (80 if a.quick else 200)
    recipe = recipe.replace(max_rounds=10**6, eval_every_rounds=0, checkpoint_every_rounds=0)
    n = count_parameters(build_model(gpt_of(recipe), device="meta"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"communication: demo recipe (tiny GPT, {n:,} params), {len(recipe.learners)} learners, {steps} steps per "
        f"learner on average, step noise {a.noise:g}, seed {a.seed}; virtual clock, every party's own counted store")
    results: dict[str, dict] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="atoll-communication-") as tmp:
        for name in names:
            results[name] = measure(known[name], recipe, steps=steps, noise=a.noise, seed=a.seed, root=Path(tmp))
            table(name, results[name], say)
    say(f"({time.time() - t0:.0f} s)")
    (out / "communication.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "communication.png")
    say(f"wrote {out / 'communication.txt'}, .json, .png")
    r = results.get("demo", results[names[0]])  # the default configuration's, if it ran
    lw = r["learners"]
    say(f"bytes per token vs DP: {fold(r['dp']['fp32'] / ((lw['bytes_up'] + lw['bytes_down']) / r['tokens']))}")
    (out / "communication.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
