"""Quality at an equal token budget: Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel.

Every configuration trains the same model on the same corpus (the Python standard library's
source as bytes) for the same number of tokens, side by side in one run, and the table reports
the final validation loss and its ratio to data-parallel, plus bytes moved per token.

DiLoCo configurations run the real Learner and Synchronizer objects on a real bucket folder,
driven by the virtual clock of atoll.train.virtual: learners 3 and 4 take 1.5x longer per step
(older chips), so with K = 1 + grace the fast learners do more of the tokens, exactly as they
would in wall-clock time, but repeatably.

    python benchmarks/quality.py                       # 2 M tokens per method: ~25 min on 2 cores
    python benchmarks/quality.py --tokens 5e5 --dp-lrs 3e-3   # a quick look (~10 min); DP takes few steps
    python benchmarks/quality.py --only "P=1);grace, RDA"     # only some DiLoCo methods (DP always runs)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from atoll.core.config import DilocoConfig, synchronous_diloco
from atoll.train import data as data_mod
from atoll.storage.paths import to_url
from atoll.train.run import create_run, make_evaluator
from atoll.train.model import MODEL_PRESETS, build_model, count_parameters, loss_fn
from atoll.train.recipe import DataSpec, InnerOptimConfig, LearnerSpec, Recipe, lr_at_step
from atoll.train.virtual import run_virtual

M = 4


def learners(batch: int) -> tuple[LearnerSpec, ...]:
    return tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=batch, slowdown=1.5 if i >= 2 else 1.0,
                             pool="cpu-slow" if i >= 2 else "cpu-fast") for i in range(M))


def methods(h: int) -> dict[str, DilocoConfig]:
    decoupled = DilocoConfig(num_learners=M, num_fragments=h, inner_steps=h, overlap_steps=2, min_quorum=1,
                             grace_factor=0.5, initial_grace_s=1.0)
    return {
        "sync DiLoCo (K=M, P=1)": synchronous_diloco(M, inner_steps=h),
        "decoupled K=1+grace, RDA": decoupled,
        "decoupled K=1+grace, mean": decoupled.replace(merge="mean"),
        "decoupled K=1+grace, RDA, int4": decoupled.replace(compression="int4"),
        "decoupled K=1, no grace, RDA": decoupled.replace(grace_factor=0.0, initial_grace_s=0.0),
        "sync DiLoCo, outer lr 1 mu 0": synchronous_diloco(M, inner_steps=h, outer_lr=1.0, outer_momentum=0.0),
        "decoupled RDA, outer lr 1 mu 0": decoupled.replace(outer_lr=1.0, outer_momentum=0.0),
    }


def run_dp(args: argparse.Namespace, corpus: data_mod.Corpus, lr: float) -> dict:
    """Synchronous data-parallel = one model on the union batch (M x per-learner batch)."""
    cfg = MODEL_PRESETS[args.model]()
    model = build_model(cfg, seed=0)
    batch = M * args.batch
    steps = int(args.tokens) // (batch * cfg.context_tokens)
    inner = InnerOptimConfig(lr=lr, warmup_steps=max(1, steps // 20), total_steps=steps)
    opt = inner.make(model.parameters())
    stream = data_mod.BatchStream(corpus.train, context_tokens=cfg.context_tokens, seed=0)
    curve, tokens = [], 0
    every = max(1, steps // args.evals)
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
            curve.append((tokens, data_mod.evaluate(model, corpus.val, batches=args.eval_batches)))
    n = count_parameters(model)
    # Each of M workers sends and receives one fp32 gradient per step (parameter-server view).
    bytes_per_token = 2 * M * 4 * n / (batch * cfg.context_tokens)
    return {"curve": curve, "tokens": tokens, "bytes_per_token": bytes_per_token, "rounds": steps, "merged": M}


def run_diloco(args: argparse.Namespace, name: str, config: DilocoConfig, root: Path) -> dict:
    cfg = MODEL_PRESETS[args.model]()
    steps_per_learner = int(args.tokens) // (M * args.batch * cfg.context_tokens)
    recipe = Recipe(model=args.model, data=DataSpec(max_corpus_mb=args.corpus_mb), learners=learners(args.batch),
                    inner=InnerOptimConfig(lr=args.inner_lr, warmup_steps=max(1, steps_per_learner // 20),
                                           total_steps=steps_per_learner),
                    max_rounds=10**9, eval_every_rounds=0, eval_batches=args.eval_batches, save_every_steps=0)
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
    url = to_url(str(root / slug))
    store = create_run(url, config, recipe)
    result = run_virtual(store, token_budget=int(args.tokens), evaluate=make_evaluator(store),
                         eval_every_tokens=int(args.tokens) // args.evals)
    return {"curve": result.curve, "tokens": result.tokens, "bytes_per_token": result.bytes_moved / result.tokens,
            "rounds": result.rounds, "merged": result.merged_per_round, "steps": result.steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=2e6, help="token budget per method (all learners together)")
    ap.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--batch", type=int, default=8, help="sequences per learner step")
    ap.add_argument("--inner-steps", type=int, default=8, help="H (= P for decoupled)")
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--dp-lrs", default="2e-3,3e-3,4e-3", help="data-parallel learning rates to try (best is the reference)")
    ap.add_argument("--corpus-mb", type=float, default=8.0)
    ap.add_argument("--evals", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--only", default="", help="semicolon-separated substrings: run only matching DiLoCo methods")
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = DataSpec(max_corpus_mb=args.corpus_mb).corpus()
    results: dict[str, dict] = {}
    t0 = time.time()
    for lr in [float(x) for x in args.dp_lrs.split(",")]:
        results[f"data-parallel (lr {lr:g})"] = run_dp(args, corpus, lr)
        print(f"[{time.time() - t0:6.0f}s] data-parallel lr {lr:g}: {results[f'data-parallel (lr {lr:g})']['curve'][-1][1]:.4f}",
              flush=True)
    with tempfile.TemporaryDirectory(prefix="atoll-quality-") as tmp:
        for name, config in methods(args.inner_steps).items():
            if args.only and not any(s in name for s in args.only.split(";")):
                continue
            results[name] = run_diloco(args, name, config, Path(tmp))
            print(f"[{time.time() - t0:6.0f}s] {name}: {results[name]['curve'][-1][1]:.4f}", flush=True)

    dp_name = min((k for k in results if k.startswith("data-parallel")), key=lambda k: results[k]["curve"][-1][1])
    dp = results[dp_name]
    cfg = MODEL_PRESETS[args.model]()
    print()
    print(f"Quality at an equal token budget: {args.model} GPT ({count_parameters(build_model(cfg, device='meta')):,} "
          f"params), {int(args.tokens):,} tokens per method, M = {M} learners x batch {args.batch} x "
          f"{cfg.context_tokens} tokens, learners 3-4 1.5x slower, H = {args.inner_steps}")
    header = f"{'method':34s} {'val loss':>9s} {'vs DP':>7s} {'rounds':>7s} {'merged/rd':>9s} {'bytes/token':>12s} {'vs DP':>8s}"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        loss = r["curve"][-1][1]
        print(f"{name:34s} {loss:9.4f} {loss / dp['curve'][-1][1]:7.3f} {r['rounds']:7d} {r['merged']:9.2f} "
              f"{r['bytes_per_token']:12.1f} {r['bytes_per_token'] / dp['bytes_per_token']:8.4f}")
    print(f"(reference: {dp_name}; {time.time() - t0:.0f}s total)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, r in results.items():
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="o", ms=3, label=name, lw=2 if name == dp_name else 1.2)
    ax.set_xlabel("tokens (all learners)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"atoll quality benchmark: {args.model} GPT, equal token budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=120)
    (out / "quality.json").write_text(json.dumps({k: {**v, "curve": v["curve"]} for k, v in results.items()}, indent=1))
    print(f"wrote {out / 'quality.png'} and {out / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
