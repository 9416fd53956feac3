"""Quality at an equal token budget: Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel.

Every row trains the same model from the same start on the same corpus for the same number of
tokens, in one process, and the tables report the final validation loss (mean and spread over
seeds) and its ratio to the best data-parallel (DP) row of that corpus.

DiLoCo rows run the real Learner and Synchronizer objects on a real bucket folder, driven by the
virtual clock of atoll.train.virtual: learners 3 and 4 take 1.5x longer per step (older chips),
so with K = 1 + grace the fast learners do more of the tokens, exactly as they would in
wall-clock time, but repeatably. The run length is ``max_rounds``, as in a real run: it is
calibrated per row (a short run of the same config with a micro model) so that the run ends at
the token budget, and the learners' lr schedule follows the run's progress (rounds).

Rows (every label carries its outer and inner settings):
  * DP (atoll's loop): one model on the union batch (M x per-learner batch), AdamW, warmup +
    cosine; its lr is swept until the best is not at an edge of the grid.
  * bare PyTorch DP: the same model and data in a plain torch loop (torch.optim.AdamW, LambdaLR,
    uniformly random windows), no atoll code in the loop: the baseline itself is efficient.
  * bare PyTorch sync DiLoCo: M model copies with an AdamW each, every H steps an outer step to
    their average (the rows' outer lr, no momentum), no atoll code: what local steps cost by
    themselves, next to atoll's sync DiLoCo row with the plain mean.
  * decoupled K=1+grace (RDA, token-weighted): its inner lr is swept the same way.
  * sync DiLoCo (K=M, P=1, plain mean) at the same H and inner lr; sync DiLoCo with H=1.
  * decoupled K=1 without the grace window; decoupled with the own-step learner (lr schedule on
    each learner's own step counter, contiguous data shards): what the run-progress schedule and
    interleaved shards are worth.

Columns: merged/rd is contributions merged per round; "merged work" is the share of the learners'
fragment-token work (tokens x fragment size) that was merged into the global model (the rest
was overwritten when a learner adopted a newer version before its work was merged).

    python benchmarks/quality.py                              # both corpora, 2 seeds, 2 M tokens:
                                                              # ~70 min on 2 busy CPU cores
    python benchmarks/quality.py --corpora prose --seeds 0 --tokens 5e5   # a quick look
    python benchmarks/quality.py --corpora tokens:s3://b/train.bin,s3://b/val.bin   # your shards

Sweeps run at the first seed; the other seeds rerun the best of each sweep (and any --rows).
Every finished run is saved under --out; --resume continues an interrupted benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from atoll.core.config import DilocoConfig, synchronous_diloco  # noqa: E402
from atoll.runs.report import MergedWork  # noqa: E402
from atoll.storage.paths import to_url  # noqa: E402
from atoll.train import data as data_mod  # noqa: E402
from atoll.train.model import GPTConfig, build_model, count_parameters, loss_fn  # noqa: E402
from atoll.train.recipe import DataSpec, InnerOptimConfig, LearnerSpec, Recipe, lr_at_step  # noqa: E402
from atoll.train.run import create_run, make_evaluator  # noqa: E402
from atoll.train.virtual import run_virtual  # noqa: E402
from corpora import corpus_spec  # noqa: E402

M = 4
SLOW = 1.5


def learners(batch: int) -> tuple[LearnerSpec, ...]:
    return tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=batch, slowdown=SLOW if i >= 2 else 1.0,
                             pool="cpu-slow" if i >= 2 else "cpu-fast") for i in range(M))


def outer_label(c: DilocoConfig) -> str:
    return f"outer lr {c.outer_lr:g} mu {c.outer_momentum:g}"


def diloco_configs(h: int, outer_lr: float, outer_mu: float) -> dict[str, DilocoConfig]:
    decoupled = DilocoConfig(num_learners=M, num_fragments=h, inner_steps=h, overlap_steps=2, min_quorum=1,
                             grace_factor=0.5, initial_grace_s=1.0, outer_lr=outer_lr, outer_momentum=outer_mu)
    sync = synchronous_diloco(M, inner_steps=h, outer_lr=outer_lr, outer_momentum=outer_mu)
    return {
        "decoupled": decoupled,
        "nograce": decoupled.replace(grace_factor=0.0, initial_grace_s=0.0),
        # The same merge rule and outer step as the decoupled rows: the like-for-like synchronous run.
        "sync": sync.replace(merge=decoupled.merge, weighting=decoupled.weighting),
        "sync-mean": sync,
        "sync-h1": synchronous_diloco(M, inner_steps=1, outer_lr=1.0, outer_momentum=0.0),
        "prefix": decoupled,
    }


def label_of(kind: str, c: DilocoConfig | None, lr: float, extra: str = "") -> str:
    if kind == "dp":
        return f"DP, atoll loop, AdamW lr {lr:g}"
    if kind == "bare":
        return f"DP, bare PyTorch loop, AdamW lr {lr:g}"
    if kind == "bare-sync":
        h, _, outer = extra.partition(",")
        return f"sync DiLoCo H={h}, mean, outer lr {outer or 1} mu 0, bare PyTorch loop (no atoll), inner lr {lr:g}"
    assert c is not None
    merge = "RDA" if c.merge == "rda" else "mean"
    if c.min_quorum == c.num_learners:
        head = f"sync DiLoCo K=M P=1 H={c.inner_steps}, {merge}"
    else:
        grace = "+grace" if c.grace_factor > 0 else ", no grace"
        head = f"decoupled K={c.min_quorum}{grace} H=P={c.inner_steps} tau={c.overlap_steps}, {merge}"
    return f"{head}, {outer_label(c)}, inner lr {lr:g}{extra}"


# ----------------------------------------------------------------------------------------------
# Data-parallel baselines


def run_dp(a: argparse.Namespace, gpt: GPTConfig, spec: DataSpec, lr: float, seed: int) -> dict:
    """Synchronous data-parallel = one model on the union batch (M x per-learner batch), atoll's loop."""
    corpus = spec.corpus()
    model = build_model(gpt, seed=seed)
    batch = M * a.batch
    steps = int(a.tokens) // (batch * gpt.context_tokens)
    inner = InnerOptimConfig(lr=lr, warmup_steps=max(1, steps // 20), schedule="steps", total_steps=steps)
    opt = inner.make(model.parameters())
    stream = data_mod.BatchStream(corpus.train, context_tokens=gpt.context_tokens, seed=seed)
    curve, tokens = [], 0
    every = max(1, steps // a.evals)
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at_step(inner, step)
        x, y = stream.next_batch(batch)
        loss = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        opt.step()
        tokens += x.numel()
        if step % every == 0 or step == steps:
            curve.append((tokens, data_mod.evaluate(model, corpus.val, batches=a.eval_batches)))
    n = count_parameters(model)
    # Each of M workers sends and receives one fp32 gradient per step (parameter-server view).
    return {"curve": curve, "tokens": tokens, "bytes_per_token": 2 * M * 4 * n / (batch * gpt.context_tokens),
            "rounds": steps, "merged": float(M), "merged_share": 1.0}


def _bare_step(model: torch.nn.Module, opt: torch.optim.Optimizer, w: torch.Tensor) -> None:
    """One plain PyTorch training step on windows ``w`` (next-byte loss, clip 1, AdamW step)."""
    logits = model(w[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def run_bare_dp(a: argparse.Namespace, gpt: GPTConfig, spec: DataSpec, lr: float, seed: int) -> dict:
    """The same model and data in a plain PyTorch loop: nothing of atoll but the model and the evaluator."""
    corpus = spec.corpus()
    train = torch.from_numpy(corpus.train.read(0, len(corpus.train)).astype(np.int64))
    T, batch = gpt.context_tokens, M * a.batch
    steps = int(a.tokens) // (batch * T)
    warm = max(1, steps // 20)
    model = build_model(gpt, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)

    def factor(i: int) -> float:  # i = steps done so far (0-based): warmup, cosine to 10%
        s = i + 1
        if s <= warm:
            return s / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, steps - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    gen = torch.Generator().manual_seed(1000 + seed)
    curve, tokens, every = [], 0, max(1, steps // a.evals)
    offsets = torch.arange(T + 1)
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(train) - T - 1, (batch,), generator=gen)
        _bare_step(model, opt, train[starts[:, None] + offsets])
        sched.step()
        tokens += batch * T
        if step % every == 0 or step == steps:
            curve.append((tokens, data_mod.evaluate(model, corpus.val, batches=a.eval_batches)))
    n = count_parameters(model)
    return {"curve": curve, "tokens": tokens, "bytes_per_token": 2 * M * 4 * n / (batch * T),
            "rounds": steps, "merged": float(M), "merged_share": 1.0}


def run_bare_sync(a: argparse.Namespace, gpt: GPTConfig, spec: DataSpec, lr: float, seed: int, h: int,
                  outer_lr: float = 1.0) -> dict:
    """Synchronous DiLoCo in a plain PyTorch loop (no atoll learner, synchronizer or bucket): M
    copies of the model, each with its own AdamW on its own uniformly random windows of the whole
    corpus; every ``h`` steps the global model moves ``outer_lr`` of the way to the average of
    the copies (no momentum: outer lr 1 is the plain average) and every copy restarts from it.
    The same schedule as the DP rows, on the global step. Tells whether atoll's DiLoCo rows lose
    anything to atoll itself, or only what local steps cost."""
    corpus = spec.corpus()
    train = torch.from_numpy(corpus.train.read(0, len(corpus.train)).astype(np.int64))
    T = gpt.context_tokens
    steps = int(a.tokens) // (M * a.batch * T)
    inner = InnerOptimConfig(lr=lr, warmup_steps=max(1, steps // 20), schedule="steps", total_steps=steps)
    model = build_model(gpt, seed=seed)
    copies = [build_model(gpt, seed=seed) for _ in range(M)]
    copy_params = [dict(m.named_parameters()) for m in copies]
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1) for m in copies]
    gens = [torch.Generator().manual_seed(1000 * (i + 1) + seed) for i in range(M)]
    offsets = torch.arange(T + 1)
    curve, tokens, every = [], 0, max(1, steps // a.evals)
    for step in range(1, steps + 1):
        for m, opt, gen in zip(copies, opts, gens, strict=True):
            for g in opt.param_groups:
                g["lr"] = lr_at_step(inner, step)
            _bare_step(m, opt, train[torch.randint(0, len(train) - T - 1, (a.batch,), generator=gen)[:, None] + offsets])
            tokens += a.batch * T
        if step % h == 0 or step == steps:  # the outer step, then every copy restarts from the global model
            with torch.no_grad():
                for name, p in model.named_parameters():
                    mean = torch.stack([c[name] for c in copy_params]).mean(0)
                    p.add_(mean - p, alpha=outer_lr)
                    for c in copy_params:
                        c[name].copy_(p)
        if step % every == 0 or step == steps:
            curve.append((tokens, data_mod.evaluate(model, corpus.val, batches=a.eval_batches)))
    n = count_parameters(model)
    return {"curve": curve, "tokens": tokens, "bytes_per_token": 2 * M * 4 * n / (h * M * a.batch * T),
            "rounds": math.ceil(steps / h), "merged": float(M), "merged_share": 1.0}


# ----------------------------------------------------------------------------------------------
# DiLoCo rows: the real learners and synchronizer on a virtual clock


def _recipe(a: argparse.Namespace, model: dict, spec: DataSpec, inner_lr: float, seed: int, max_rounds: int,
            schedule: str) -> Recipe:
    gpt = GPTConfig.from_dict(model)
    steps_per_learner = int(a.tokens) // (M * a.batch * gpt.context_tokens)
    return Recipe(model=model, model_seed=seed, data=spec, learners=learners(a.batch),
                  inner=InnerOptimConfig(lr=inner_lr, warmup_steps=max(1, steps_per_learner // 20), schedule=schedule,
                                         total_steps=steps_per_learner),
                  max_rounds=max_rounds, eval_every_rounds=0, eval_batches=a.eval_batches, save_every_steps=0)


def calibrate_rounds(a: argparse.Namespace, config: DilocoConfig, spec: DataSpec, root: Path) -> int:
    """Rounds this config commits for the token budget (virtual time does not depend on the model):
    a micro-model run of 1/8 of the budget, scaled up. That is the run's max_rounds."""
    micro = {"vocab_size": 256, "context_tokens": a.context, "num_layers": 1, "num_heads": 2, "embed_dim": 16}
    budget = min(int(a.tokens), max(int(a.tokens) // 8, 400 * M * a.batch * a.context))
    recipe = _recipe(a, micro, spec, 1e-3, 0, 10**9, "steps")
    store = create_run(to_url(str(root / f"calibrate-{time.monotonic_ns()}")), config, recipe)
    res = run_virtual(store, token_budget=budget)
    return max(1, round(res.rounds * int(a.tokens) / res.tokens))


def run_diloco(a: argparse.Namespace, model: dict, spec: DataSpec, config: DilocoConfig, inner_lr: float, seed: int,
               root: Path, *, schedule: str = "run", rounds_cache: dict) -> dict:
    key = json.dumps(config.to_dict(), sort_keys=True)  # virtual time: the same for every corpus
    if key not in rounds_cache:
        rounds_cache[key] = calibrate_rounds(a, config, spec, root)
    max_rounds = rounds_cache[key]
    recipe = _recipe(a, model, spec, inner_lr, seed, max_rounds, schedule)
    store = create_run(to_url(str(root / f"run-{time.monotonic_ns()}")), config, recipe)
    result = run_virtual(store, token_budget=int(a.tokens), evaluate=make_evaluator(store),
                         eval_every_tokens=int(a.tokens) // a.evals)
    # Merged work: tokens x fragment size of every merged contribution, over all the work done.
    total_numel = sum(store.plan.sizes.values())
    # A repeat (published again against the same base before adopting the round that merged the
    # first) counts only its tokens beyond the first (MergedWork).
    ledger = MergedWork()
    merged_work = 0.0
    per_learner: dict[str, float] = {}
    for rec in store.history():
        for lid, (_, new_tokens) in ledger.round(rec).items():
            work = new_tokens * store.plan.fragment_numel(rec.fragment)
            merged_work += work
            per_learner[lid] = per_learner.get(lid, 0.0) + work
    tokens_of = {lid: steps * a.batch * a.context for lid, steps in result.steps.items()}
    return {"curve": result.curve, "tokens": result.tokens, "bytes_per_token": result.bytes_moved / result.tokens,
            "rounds": result.rounds, "max_rounds": max_rounds, "merged": result.merged_per_round,
            "merged_share": merged_work / (result.tokens * total_numel),
            "merged_share_per_learner": {lid: per_learner.get(lid, 0.0) / (tokens_of[lid] * total_numel)
                                         for lid in tokens_of if tokens_of[lid]},
            "steps": result.steps}


# ----------------------------------------------------------------------------------------------
# The benchmark


def final(r: dict) -> float:
    return r["curve"][-1][1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpora", default="code,prose", help="comma-separated: code, prose, tokens:TRAIN_URL,VAL_URL "
                    "(separate several corpora with ';' when a tokens: entry is given)")
    ap.add_argument("--seeds", default="0,1", help="model init + data order seeds; sweeps run at the first")
    ap.add_argument("--tokens", type=float, default=2e6, help="token budget per row (all learners together)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="sequences per learner step (DP: M x this)")
    ap.add_argument("--inner-steps", type=int, default=8, help="H (= P for decoupled)")
    ap.add_argument("--outer-lr", type=float, default=0.8, help="0.8 measured best for RDA here (0.6 / 1 / 1.25 worse)")
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--dp-lrs", default="2.83e-3,4e-3,5.66e-3,8e-3",
                    help="DP lr grid, sqrt(2) apart (extended by 2x until the best is inside)")
    ap.add_argument("--inner-lrs", default="4.24e-3,6e-3,8.49e-3", help="decoupled inner lr grid (extended likewise)")
    ap.add_argument("--max-extend", type=int, default=2, help="grid extensions per sweep")
    ap.add_argument("--rows", default="",
                    help="rows beyond the two sweeps, at every seed: bare, bare-sync (sync DiLoCo in plain PyTorch), sync "
                         "(same merge and outer step as the decoupled rows), sync-mean, sync-h1, nograce, prefix "
                         "(own-step learner: lr schedule on each learner's own steps, contiguous shards)")
    ap.add_argument("--rows-first-seed", default="prefix,sync,nograce,sync-mean",
                    help="rows run at the first seed only (same choices)")
    ap.add_argument("--rows-late", default="bare,bare-sync,sync-h1",
                    help="sanity rows, first seed only, run last (same choices)")
    ap.add_argument("--code-mb", type=float, default=8.0)
    ap.add_argument("--evals", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--resume", action="store_true", help="reuse the runs saved in --out by an earlier invocation "
                    "with the same settings")
    ap.add_argument("--report-only", action="store_true", help="with --resume: train nothing, tabulate what is saved")
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    rows_all = [r for r in a.rows.split(",") if r]
    rows_first = [r for r in a.rows_first_seed.split(",") if r and r not in rows_all]
    rows_late = [r for r in a.rows_late.split(",") if r and r not in rows_all + rows_first]
    model = {"vocab_size": 256, "context_tokens": a.context, "num_layers": a.layers, "num_heads": 4,
             "embed_dim": a.width}
    gpt = GPTConfig.from_dict(model)
    n_params = count_parameters(build_model(gpt, device="meta"))
    configs = diloco_configs(a.inner_steps, a.outer_lr, a.outer_momentum)
    corpora = a.corpora.split(";") if ";" in a.corpora or a.corpora.startswith("tokens:") else a.corpora.split(",")
    t0 = time.time()
    report: dict = {"args": vars(a), "params": n_params, "corpora": {}}
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    with tempfile.TemporaryDirectory(prefix="atoll-quality-") as tmp:
        root = Path(tmp)
        rounds_cache: dict = {}
        for cname in corpora:
            spec0, desc = corpus_spec(cname, code_mb=a.code_mb)
            corpus = spec0.corpus()
            bytes_per_tok = 1.0 if spec0.kind == "stdlib" or cname == "prose" else float("nan")
            runs: dict[str, dict[int, dict]] = {}
            labels: dict[str, str] = {}
            # Every finished run is saved at once; --resume (same settings!) reuses them, so a long
            # benchmark can be stopped and continued, or its plan changed, without losing work.
            saved = out / f"quality-{cname.split(':')[0]}-runs.json"
            if a.resume and saved.exists():
                old = json.loads(saved.read_text())
                labels.update(old["labels"])
                runs.update({k: {int(sd): r for sd, r in d.items()} for k, d in old["runs"].items()})

            def run(key: str, label: str, seed: int, fn) -> float:
                if seed in runs.get(key, {}):
                    return final(runs[key][seed])
                if a.report_only:
                    return math.inf
                r = fn(seed)
                runs.setdefault(key, {})[seed] = r
                labels[key] = label
                saved.write_text(json.dumps({"labels": labels, "runs": runs}, default=str))
                print(f"[{time.time() - t0:6.0f}s] {cname} seed {seed}: {label}: {final(r):.4f}"
                      + (f"  (rounds {r['rounds']}/{r.get('max_rounds', r['rounds'])}, merged work {r['merged_share']:.0%})"
                         if "max_rounds" in r else ""), flush=True)
                return final(r)

            def spec_for(seed: int, shard: str = "interleaved") -> DataSpec:
                return dataclasses.replace(spec0, seed=seed, shard=shard)

            def dp_row(lr: float, seed: int) -> float:
                return run(f"dp {lr:g}", label_of("dp", None, lr), seed, lambda s: run_dp(a, gpt, spec_for(s), lr, s))

            def dec_row(lr: float, seed: int) -> float:
                c = configs["decoupled"]
                return run(f"dec {lr:g}", label_of("diloco", c, lr), seed,
                           lambda s: run_diloco(a, model, spec_for(s), c, lr, s, root, rounds_cache=rounds_cache))

            def sweep(grid: list[float], row) -> float:
                """Run the grid at the first seed; while the best is at an edge, extend past it by 2x."""
                grid = sorted(grid)
                for _ in range(a.max_extend):
                    losses = {lr: row(lr, seeds[0]) for lr in grid}
                    losses = {lr: v if math.isfinite(v) else math.inf for lr, v in losses.items()}
                    best = min(losses, key=losses.get)
                    if best == grid[0]:
                        grid.insert(0, grid[0] / 2)
                    elif best == grid[-1]:
                        grid.append(grid[-1] * 2)
                    else:
                        return best
                losses = {lr: row(lr, seeds[0]) for lr in grid}
                return min(losses, key=lambda lr: losses[lr] if math.isfinite(losses[lr]) else math.inf)

            dp_lr = sweep([float(x) for x in a.dp_lrs.split(",")], dp_row)
            inner_lr = sweep([float(x) for x in a.inner_lrs.split(",")], dec_row)

            def fixed(key: str, seed: int) -> None:
                c = configs.get(key)
                if key == "bare":
                    run("bare", label_of("bare", None, dp_lr), seed, lambda s: run_bare_dp(a, gpt, spec_for(s), dp_lr, s))
                elif key == "bare-sync":  # atoll's sync-mean row without atoll: same inner lr and outer lr
                    run(f"bare-sync {a.outer_lr:g}", label_of("bare-sync", None, inner_lr, f"{a.inner_steps},{a.outer_lr:g}"),
                        seed, lambda s: run_bare_sync(a, gpt, spec_for(s), inner_lr, s, a.inner_steps, a.outer_lr))
                elif key == "sync-h1":  # H = 1, plain mean: one averaged AdamW step per round, at DP's lr
                    run(key, label_of("diloco", c, dp_lr), seed,
                        lambda s: run_diloco(a, model, spec_for(s), c, dp_lr, s, root, rounds_cache=rounds_cache))
                elif key == "prefix":
                    run(key, label_of("diloco", c, inner_lr, ", own-step learner: lr schedule on its own steps, contiguous shards"),
                        seed, lambda s: run_diloco(a, model, spec_for(s, "contiguous"), c, inner_lr, s, root,
                                                   schedule="steps", rounds_cache=rounds_cache))
                else:
                    run(key, label_of("diloco", c, inner_lr), seed,
                        lambda s: run_diloco(a, model, spec_for(s), c, inner_lr, s, root, rounds_cache=rounds_cache))

            # Most telling first: the first seed's rows, then the other seeds, then the sanity rows.
            for key in rows_all + rows_first:
                fixed(key, seeds[0])
            # DP's best lr at the first seed can sit at the edge of stability (one step up fails to
            # take off): its lower neighbour runs at every seed too, and the table's best DP is the
            # best mean over all seeds, so one lucky seed never sets the reference.
            # The decoupled rows get the same treatment (the table lists each inner lr's mean).
            lower = sorted(float(k.split()[1]) for k in runs if k.startswith("dp ") and float(k.split()[1]) < dp_lr)
            lower_inner = sorted(float(k.split()[1]) for k in runs if k.startswith("dec ")
                                 and float(k.split()[1]) < inner_lr)
            for seed in seeds[1:]:
                dp_row(dp_lr, seed)
                if lower:
                    dp_row(lower[-1], seed)
                dec_row(inner_lr, seed)
                if lower_inner:
                    dec_row(lower_inner[-1], seed)
                for key in rows_all:
                    fixed(key, seed)
            for key in rows_late:
                fixed(key, seeds[0])

            # -- the table ------------------------------------------------------------------
            def stats(key: str) -> tuple[float, float, int]:
                vals = [final(r) for r in runs[key].values()]
                return statistics.fmean(vals), (max(vals) - min(vals)) / 2, len(vals)

            dp_keys = [k for k in runs if k.startswith("dp ")]
            most = max(len(runs[k]) for k in dp_keys)
            best_dp = min((k for k in dp_keys if len(runs[k]) == most), key=lambda k: stats(k)[0])
            ref = stats(best_dp)[0]

            def ref_of(key: str) -> float:
                """The best DP's mean over the seeds ``key`` ran at (a row run at one seed is compared
                with DP at that seed, not with DP's mean over seeds it never ran)."""
                same = [final(runs[best_dp][sd]) for sd in runs[key] if sd in runs[best_dp]]
                return statistics.fmean(same) if same else ref
            dp_bpt = runs[best_dp][seeds[0]]["bytes_per_token"]
            say("")
            say(f"== {desc}; {len(corpus.train):,} train tokens = {a.tokens / len(corpus.train):.1f} epochs at "
                f"{int(a.tokens):,} tokens; bytes per token {bytes_per_tok:g} (byte-level) ==")
            say(f"GPT {a.layers} layers x d{a.width}, context {a.context} ({n_params:,} params); M = {M} learners x batch "
                f"{a.batch}, learners 3-4 {SLOW}x slower; DP batch {M * a.batch}; AdamW (0.9, 0.95), wd 0.1, clip 1, "
                f"warmup 5% then cosine to 10%; seeds {a.seeds}")
            header = (f"{'row':92s} {'val loss':>8s} {'+-':>6s} {'n':>2s} {'/ best DP':>9s} {'rounds':>7s} "
                      f"{'merged/rd':>9s} {'merged work':>11s} {'bytes/token':>11s} {'/ DP':>7s}")
            say(header)
            say("-" * len(header))
            order = sorted(dp_keys, key=lambda k: float(k.split()[1])) + [k for k in runs if not k.startswith("dp ")]
            table = []
            for key in order:
                mean, spread, n = stats(key)
                r0 = next(iter(runs[key].values()))
                row = {"key": key, "label": labels[key], "mean": mean, "spread": spread, "n": n, "ratio": mean / ref_of(key),
                       "rounds": r0["rounds"], "merged": r0["merged"],
                       "merged_share": statistics.fmean(r["merged_share"] for r in runs[key].values()),
                       "bytes_per_token": r0["bytes_per_token"], "seeds": {s: final(r) for s, r in runs[key].items()}}
                table.append(row)
                mark = " *" if key == best_dp else ""
                say(f"{labels[key] + mark:92s} {mean:8.4f} {spread:6.4f} {n:2d} {mean / ref_of(key):9.3f} {r0['rounds']:7d} "
                    f"{r0['merged']:9.2f} {row['merged_share']:11.0%} {r0['bytes_per_token']:11.1f} "
                    f"{r0['bytes_per_token'] / dp_bpt:7.4f}")
            say(f"(* best DP: best mean over seeds; '/ best DP' divides by its mean over the row's own seeds; "
                f"+- is half the range over seeds; sweeps at seed {seeds[0]}, best DP lr {dp_lr:g}, "
                f"best inner lr {inner_lr:g}; {time.time() - t0:.0f}s so far)")
            report["corpora"][cname] = {"desc": desc, "table": table, "best_dp": best_dp, "dp_lr": dp_lr,
                                        "inner_lr": inner_lr,
                                        "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()},
                                        "labels": labels}

    (out / "quality.txt").write_text("\n".join(lines) + "\n")
    (out / "quality.json").write_text(json.dumps(report, indent=1, default=str))
    plot(report, out / "quality.png")
    print(f"wrote {out / 'quality.txt'}, {out / 'quality.json'} and {out / 'quality.png'}")
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["corpora"])
    fig, axes = plt.subplots(1, len(names), figsize=(8 * len(names), 5.5), squeeze=False)
    for ax, cname in zip(axes[0], names, strict=False):
        c = report["corpora"][cname]
        shown = [c["best_dp"]] + [k for k in c["runs"] if not k.startswith("dp ")]
        for key in shown:
            curves = [r["curve"] for r in c["runs"][key].values()]
            n = max(len(cv) for cv in curves)
            curves = [cv for cv in curves if len(cv) == n]  # full curves only (a resumed run may lack one)
            xs = [statistics.fmean(cv[i][0] for cv in curves) for i in range(n)]
            ys = [statistics.fmean(cv[i][1] for cv in curves) for i in range(n)]
            ax.plot(xs, ys, marker="o", ms=3, lw=2.2 if key == c["best_dp"] else 1.2, label=c["labels"][key])
        ax.set_xlabel("tokens (all learners)")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(c["desc"][:70], fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("atoll quality benchmark: validation loss vs tokens (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
