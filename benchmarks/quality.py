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

The communication front (``--pareto`` runs only it; ``--pareto-grid none`` leaves it out):
decoupled K=1+grace rows at the best inner lr over uplink precision (fp32/bf16/int4) x downlink
precision (fp32/bf16/int4) x H (8/16/24/48, P = min(8, H)) x round pacing (off/1), every learner on
its own counted store (``atoll.storage.wire``), each with its bytes per token trained (up, down,
requests per 1,000 tokens; the synchronizer's apart), effective H, merged-work share and final
loss; a table and a plot (``quality-pareto.png``: loss against bytes per token, log x) per corpus,
with the front (no other point with every seed run has fewer bytes and a lower loss; a point that
diverged on any seed is never on it). The whole cross product is 72 points per corpus and seed,
far too long for 2 cores, so ``--pareto-grid auto`` (default) runs a coordinate sweep around the
reference (H = 8, fp32 both ways, no pacing: 9 points), then the cross product of each axis's
values within ``--pareto-promising`` (4%) of the reference's loss (at most ``--pareto-max`` = 16
points: an axis value another one beats on bytes and loss goes first, then the worst loss), at the
first seed; the first seed's front and the points within
2% of the reference then run at every seed. ``coord`` stops after the sweep, ``full`` runs all 72,
``points`` the reference and the points given (``--pareto-points int4/int4/16/0,...``).

    python benchmarks/quality.py --pareto --tokens 5e5                     # the front, both corpora, 2 seeds

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
from atoll.runs.contributions import effective_h  # noqa: E402
from atoll.runs.goodput import MergedWork  # noqa: E402
from atoll.storage.paths import to_url  # noqa: E402
from atoll.storage.wire import WireCounts  # noqa: E402
from atoll.train import data as data_mod  # noqa: E402
from atoll.train.model import GPTConfig, build_model, count_parameters, loss_fn  # noqa: E402
from atoll.train.recipe import DataSpec, InnerOptimConfig, LearnerSpec, Recipe, lr_at_step  # noqa: E402
from atoll.train.run import create_run, make_evaluator  # noqa: E402
from atoll.train.virtual import run_virtual  # noqa: E402
from communication import dp_ring_bytes_per_token  # noqa: E402
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
        hp = f"H=P={c.inner_steps}" if c.num_fragments == c.inner_steps else f"H={c.inner_steps} P={c.num_fragments}"
        head = f"decoupled K={c.min_quorum}{grace} {hp} tau={c.overlap_steps}, {merge}"
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


def timing_key(config: DilocoConfig) -> str:
    """What a config's virtual time depends on: everything but the codecs (a delta's precision
    changes its bytes, never when a step or a round happens), so one calibration serves them all."""
    d = config.to_dict()
    for codec in CODEC_FIELDS:
        if codec in d:
            d[codec] = "fp32"
    return json.dumps(d, sort_keys=True)


def run_diloco(a: argparse.Namespace, model: dict, spec: DataSpec, config: DilocoConfig, inner_lr: float, seed: int,
               root: Path, *, schedule: str = "run", rounds_cache: dict, wire: bool = False) -> dict:
    """One DiLoCo row. ``wire``: every learner on its own counted handle of the bucket (it reads
    each new version itself, as separate processes do), and the row reports what crossed the wire."""
    key = timing_key(config)  # virtual time: the same for every corpus
    if key not in rounds_cache:
        rounds_cache[key] = calibrate_rounds(a, config.replace(**{f: "fp32" for f in CODEC_FIELDS
                                                                  if f in config.to_dict()}), spec, root)
    max_rounds = rounds_cache[key]
    recipe = _recipe(a, model, spec, inner_lr, seed, max_rounds, schedule)
    store = create_run(to_url(str(root / f"run-{time.monotonic_ns()}")), config, recipe)
    result = run_virtual(store, token_budget=int(a.tokens), evaluate=make_evaluator(store),
                         eval_every_tokens=int(a.tokens) // a.evals, own_stores=wire)
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
    out = {"curve": result.curve, "tokens": result.tokens, "bytes_per_token": result.bytes_moved / result.tokens,
           "rounds": result.rounds, "max_rounds": max_rounds, "merged": result.merged_per_round,
           "merged_share": merged_work / (result.tokens * total_numel),
           "merged_share_per_learner": {lid: per_learner.get(lid, 0.0) / (tokens_of[lid] * total_numel)
                                        for lid in tokens_of if tokens_of[lid]},
           "steps": result.steps, "effective_h": effective_h_of(store)}
    if wire:
        learners = sum((c for k, c in result.wire.items() if k != "synchronizer"), WireCounts())
        out["wire"] = {"learners": learners.to_dict(),
                       "synchronizer": result.wire.get("synchronizer", WireCounts()).to_dict()}
    return out


def effective_h_of(store) -> float:  # type: ignore[no-untyped-def]
    """Mean inner steps per merged contribution after the first pass over the fragments
    (:func:`atoll.runs.contributions.effective_h`): the effective H."""
    got = effective_h(store.history()[store.plan.num_fragments:])
    return got[0] if got else float("nan")


# ----------------------------------------------------------------------------------------------
# The communication front: validation loss against bytes per token

UPLINK_FIELD = "compression"
"""DilocoConfig's precision of the deltas learners upload."""
DOWNLINK_FIELD = "downlink_compression"
"""DilocoConfig's precision of the new fragment versions learners fetch (fp32 where the field is absent)."""
PACING_FIELD = "round_pacing"
"""DilocoConfig's round pacing (fraction of H; 0 = off)."""
CODEC_FIELDS = (UPLINK_FIELD, DOWNLINK_FIELD)
CODECS = ("fp32", "bf16", "int4")
DIVERGED_LOSS = math.log(256)
"""A final validation loss at or above a uniform guess over bytes: the row diverged (or never learned)."""


@dataclasses.dataclass(frozen=True, order=True)
class ParetoPoint:
    """One configuration of the front's grid (the decoupled K=1+grace config otherwise)."""

    up: str = "fp32"
    """Uplink: precision of the deltas."""
    down: str = "fp32"
    """Downlink: precision of the fetched fragments."""
    h: int = 8
    """H: inner steps between two syncs of one fragment."""
    pacing: float = 0.0
    """Round pacing (fraction of H; 0 = off)."""
    extra: str = ""
    """More DilocoConfig settings, ``field:value;...`` (``--pareto-extra``), the same for every point."""

    def key(self, lr: float) -> str:
        extra = f" extra={self.extra}" if self.extra else ""
        return f"pareto {lr:g} up={self.up} down={self.down} H={self.h} pace={self.pacing:g}{extra}"

    @classmethod
    def from_key(cls, key: str) -> ParetoPoint:
        f = dict(kv.split("=", 1) for kv in key.split()[2:])
        return cls(up=f["up"], down=f["down"], h=int(f["H"]), pacing=float(f["pace"]), extra=f.get("extra", ""))

    def label(self) -> str:
        pace = f", paced {self.pacing:g}" if self.pacing else ""
        extra = f", {self.extra}" if self.extra else ""
        return f"up {self.up} / down {self.down}, H={self.h}{pace}{extra}"

    def axes(self) -> dict[str, object]:
        return {"up": self.up, "down": self.down, "h": self.h, "pacing": self.pacing}


def pareto_config(base: DilocoConfig, pt: ParetoPoint, fragments: int) -> DilocoConfig:
    """``base`` (the decoupled K=1+grace config) at point ``pt``: H = pt.h with P = min(fragments, H)
    fragments (a small model has few tensors, and a commit record grows with P)."""
    changes: dict[str, object] = {UPLINK_FIELD: pt.up, "inner_steps": pt.h, "num_fragments": min(fragments, pt.h)}
    if pt.down != "fp32":
        changes[DOWNLINK_FIELD] = pt.down
    if pt.pacing:
        changes[PACING_FIELD] = pt.pacing
    for item in filter(None, pt.extra.split(";")):
        name, _, value = item.partition(":")
        default = getattr(DilocoConfig(), name)
        changes[name] = (value.lower() in ("1", "true", "yes") if isinstance(default, bool)
                         else type(default)(value) if default is not None else float(value))
    return base.replace(**changes)


def supported(pt: ParetoPoint) -> bool:
    """Whether this build's DilocoConfig has the knobs ``pt`` needs."""
    known = {f.name for f in dataclasses.fields(DilocoConfig)}
    return (pt.down == "fp32" or DOWNLINK_FIELD in known) and (not pt.pacing or PACING_FIELD in known)


def wire_per_token(r: dict) -> dict[str, float]:
    """A wire-measured row's bytes and requests per token trained (all learners; synchronizer apart)."""
    w, t = r["wire"], r["tokens"]
    lw, sw = w["learners"], w["synchronizer"]
    reqs = sum(lw[k] for k in ("puts", "gets", "heads", "lists", "deletes"))
    return {"up": lw["bytes_up"] / t, "down": lw["bytes_down"] / t, "total": (lw["bytes_up"] + lw["bytes_down"]) / t,
            "req_k": 1000 * reqs / t, "sync": (sw["bytes_up"] + sw["bytes_down"]) / t}


def diverged(r: dict) -> bool:
    v = final(r)
    return not math.isfinite(v) or v >= DIVERGED_LOSS


def axis_values(a: argparse.Namespace) -> dict[str, list]:
    return {"up": a.pareto_ups.split(","), "down": a.pareto_downs.split(","),
            "h": [int(x) for x in a.pareto_hs.split(",")], "pacing": [float(x) for x in a.pareto_pacing.split(",")]}


def coordinate_points(axes: dict[str, list], ref: ParetoPoint) -> list[ParetoPoint]:
    """The reference, then every other value of one axis at a time (the rest at the reference)."""
    pts = [ref]
    for axis, values in axes.items():
        pts += [dataclasses.replace(ref, **{axis: v}) for v in values if v != getattr(ref, axis)]
    return pts


def cross_points(axes: dict[str, list], ref: ParetoPoint, keep: dict[str, list], cap: int,
                 sweep: dict[ParetoPoint, tuple[float, float]] | None = None) -> list[ParetoPoint]:
    """The cross product of the values ``keep`` names on each axis (each axis ordered as ``axes``).
    While it exceeds ``cap`` points, one value (never the reference's) goes from the axis with the
    most values: the one whose coordinate-sweep point (``sweep``: point -> (bytes per token, loss))
    another value of the same axis beats on both, else the one with the highest loss; without
    ``sweep``, the value nearest the middle of the axis."""
    keep = {ax: [v for v in axes[ax] if v in keep[ax]] for ax in axes}
    sweep = sweep or {}
    while math.prod(len(v) for v in keep.values()) > cap:
        ax = max(keep, key=lambda k: len(keep[k]))
        score = {v: sweep.get(dataclasses.replace(ref, **{ax: v})) for v in keep[ax]}
        droppable = [v for v in keep[ax] if v != getattr(ref, ax)]
        if all(score[v] is not None for v in keep[ax]) and droppable:
            beaten = [v for v in droppable if any(score[w][0] <= score[v][0] and score[w][1] <= score[v][1]  # type: ignore[index]
                                                  for w in keep[ax] if w != v)]
            drop = beaten[0] if beaten else max(droppable, key=lambda v: score[v][1])  # type: ignore[index]
        else:
            inner = [v for v in keep[ax][1:-1] if v != getattr(ref, ax)]
            if not inner:
                break
            drop = inner[0]
        keep[ax].remove(drop)
    return [ParetoPoint(up=u, down=d, h=h, pacing=pc, extra=ref.extra) for u in keep["up"] for d in keep["down"]
            for h in keep["h"] for pc in keep["pacing"]]


def parse_point(text: str, extra: str = "") -> ParetoPoint:
    """``UP/DOWN/H/PACING[/SETTINGS]``, e.g. ``int4/bf16/24/1`` or
    ``int4/int4/8/1/keep_local_progress:1;outer_lr:0.6``: SETTINGS (``field:value;...``) go after
    ``extra`` (``--pareto-extra``, every point's), so one invocation can sweep the outer step."""
    up, down, h, pacing, *own = text.split("/", 4)
    return ParetoPoint(up=up, down=down, h=int(h), pacing=float(pacing), extra=";".join(filter(None, [extra, *own])))


def has_settings(extra: str, common: str) -> bool:
    """Whether a point's settings ``extra`` hold every one of ``common`` (``--pareto-extra``)."""
    return set(filter(None, common.split(";"))) <= set(filter(None, extra.split(";")))


def front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Keys not dominated in (bytes per token, loss): no other point is as good on both and better on one."""
    out = []
    for k, (b, v) in points.items():
        if not any((b2 <= b and v2 <= v) and (b2 < b or v2 < v) for k2, (b2, v2) in points.items() if k2 != k):
            out.append(k)
    return sorted(out, key=lambda k: points[k][0])


def run_pareto(a: argparse.Namespace, run, seeds: list[int], lr: float, runs: dict, row) -> None:  # type: ignore[no-untyped-def]
    """The front's grid (``--pareto-grid``), at ``lr``: ``row(pt, seed)`` runs one point.

    * ``coord``: the reference (H = 8, fp32 both ways, no pacing) and each other value of one axis
      at a time;
    * ``auto`` (default): ``coord``, then the cross product of the values within
      ``--pareto-promising`` of the reference's loss on each axis (at most ``--pareto-max`` points:
      values the sweep shows beaten on bytes and loss go first, then the worst losses);
    * ``full``: every point;
    * ``points``: the reference and ``--pareto-points``.
    Then the reference and every point of the first seed's front, or within half of
    ``--pareto-promising`` of the reference's loss (with ``points``: every point), run at the other
    seeds."""
    axes = axis_values(a)
    ref = ParetoPoint(extra=a.pareto_extra)
    if a.pareto_grid == "points":
        todo = [ref] + [parse_point(x, a.pareto_extra) for x in a.pareto_points.split(",") if x]
    elif a.pareto_grid in ("coord", "auto"):
        todo = coordinate_points(axes, ref)
    else:
        todo = cross_points(axes, ref, axes, 10**9)
    todo = [pt for pt in todo if supported(pt)]
    for pt in todo:
        row(pt, seeds[0])
    done = {pt: runs[pt.key(lr)][seeds[0]] for pt in todo if seeds[0] in runs.get(pt.key(lr), {})}
    if ref not in done:
        return
    ref_loss = final(done[ref])
    if a.pareto_grid == "auto":
        ok = {pt for pt, r in done.items() if not diverged(r) and final(r) <= ref_loss * (1 + a.pareto_promising)}
        keep = {ax: [v for v in vals if any(getattr(pt, ax) == v for pt in ok)] for ax, vals in axes.items()}
        sweep = {pt: (wire_per_token(r)["total"], final(r)) for pt, r in done.items()}
        for pt in cross_points(axes, ref, keep, a.pareto_max, sweep):
            if supported(pt) and pt not in done:
                row(pt, seeds[0])
                if seeds[0] in runs.get(pt.key(lr), {}):
                    done[pt] = runs[pt.key(lr)][seeds[0]]
    good = {pt: r for pt, r in done.items() if not diverged(r)}
    first = set(front({pt.key(lr): (wire_per_token(r)["total"], final(r)) for pt, r in good.items()}))
    again = [pt for pt, r in good.items() if a.pareto_grid == "points" or pt == ref or pt.key(lr) in first
             or final(r) <= ref_loss * (1 + a.pareto_promising / 2)]
    for seed in seeds[1:]:
        for pt in sorted(again, key=lambda p: wire_per_token(good[p])["total"]):
            row(pt, seed)


def pareto_table(a: argparse.Namespace, runs: dict, labels: dict, lr: float, n_params: int, seeds: list[int],
                 say) -> dict:  # type: ignore[no-untyped-def]
    """The front's table: every point run at ``lr``, then the front (all seeds run, none diverged)."""
    keys = [k for k in runs if k.startswith(f"pareto {lr:g} ") and has_settings(ParetoPoint.from_key(k).extra, a.pareto_extra)]
    ref_key = ParetoPoint(extra=a.pareto_extra).key(lr)
    if not keys or ref_key not in runs:
        return {}
    tok_step = M * a.batch * a.context
    dp32, dp16 = (dp_ring_bytes_per_token(n_params, M, tok_step, p) for p in ("fp32", "bf16"))
    rows = {}
    for k in keys:
        vals = {sd: final(r) for sd, r in runs[k].items()}
        same = [final(runs[ref_key][sd]) for sd in vals if sd in runs[ref_key]]
        w = [wire_per_token(r) for r in runs[k].values()]
        rows[k] = {"point": ParetoPoint.from_key(k).axes(), "mean": statistics.fmean(vals.values()),
                   "spread": (max(vals.values()) - min(vals.values())) / 2, "n": len(vals), "seeds": vals,
                   "ratio": statistics.fmean(vals.values()) / statistics.fmean(same) if same else float("nan"),
                   "diverged": any(diverged(r) for r in runs[k].values()),
                   **{f: statistics.fmean(x[f] for x in w) for f in w[0]},
                   "effective_h": statistics.fmean(r["effective_h"] for r in runs[k].values()),
                   "merged_share": statistics.fmean(r["merged_share"] for r in runs[k].values()),
                   "complete": len(vals) == len(seeds)}
        rows[k]["dp_fold"] = dp32 / rows[k]["total"]
        rows[k]["dp16_fold"] = dp16 / rows[k]["total"]
    full = {k: r for k, r in rows.items() if r["complete"] and not r["diverged"]}
    on_front = front({k: (r["total"], r["mean"]) for k, r in full.items()})
    for k, r in rows.items():
        r["front"] = k in on_front
    wide = max(42, *(len(ParetoPoint.from_key(k).label()) + 2 for k in rows))
    head = (f"{'config (decoupled K=1+grace, P=min(8,H))':{wide}s} {'val loss':>8s} {'+-':>6s} {'n':>2s} {'/ H8 fp32':>9s} "
            f"{'up B/tok':>9s} {'down B/tok':>10s} {'req/ktok':>8s} {'sync B/tok':>10s} {'vs DP fp32':>10s} "
            f"{'vs DP bf16':>10s} {'eff H / H':>9s} {'merged work':>11s}")
    say("")
    say(f"-- communication front: loss against bytes per token (inner lr {lr:g}; learners' bytes up and down, "
        f"payloads and records, per token trained; DP = ring all-reduce, M = {M}, every worker's bytes sent and "
        f"received: {dp32:,.0f} B/token fp32, {dp16:,.0f} bf16) --")
    say(head)
    say("-" * len(head))
    for k in sorted(rows, key=lambda k: rows[k]["total"]):
        r = rows[k]
        mark = " F" if r["front"] else (" x" if r["diverged"] else "")
        say(f"{ParetoPoint.from_key(k).label() + mark:{wide}s} {r['mean']:8.4f} {r['spread']:6.4f} {r['n']:2d} "
            f"{r['ratio']:9.3f} {r['up']:9.1f} {r['down']:10.1f} {r['req_k']:8.2f} {r['sync']:10.1f} "
            f"{'1/' + format(r['dp_fold'], '.0f'):>10s} {'1/' + format(r['dp16_fold'], '.0f'):>10s} "
            f"{r['effective_h']:6.1f}/{r['point']['h']:<2d} {r['merged_share']:11.0%}")
    say(f"(F: on the front: no point with all {len(seeds)} seeds run has fewer bytes and a lower loss; x: diverged on "
        f"a seed (never a candidate); '/ H8 fp32' divides by the reference row's mean over the same seeds)")
    say("front:")
    for k in on_front:
        r = rows[k]
        say(f"  {ParetoPoint.from_key(k).label():40s} loss {r['mean']:.4f} ({r['ratio']:.3f}x H8 fp32), "
            f"{r['total']:,.1f} B/token = 1/{r['dp_fold']:.0f} of DP fp32")
    target = [k for k in full if full[k]["dp_fold"] >= a.pareto_target_fold and full[k]["ratio"] <= 1 + a.pareto_tol]
    say(f"meets the target (<= 1/{a.pareto_target_fold:g} of DP fp32's bytes per token, loss <= "
        f"{1 + a.pareto_tol:.2f}x H8 fp32, all seeds): "
        + (", ".join(ParetoPoint.from_key(k).label() for k in sorted(target, key=lambda k: full[k]["mean"])) or "none"))
    return {"rows": rows, "front": on_front, "target": target, "dp_bytes_per_token": {"fp32": dp32, "bf16": dp16},
            "markdown": pareto_markdown(rows)}


def pareto_markdown(rows: dict) -> list[str]:
    """The front's table as markdown (docs/benchmarks.md), fewest bytes first."""
    out = ["| uplink / downlink, H, pacing | val loss / H8 fp32 | seeds | up | down | req / 1k tok | learners B/tok "
           "| vs DP fp32 | eff. H / H | merged work | front |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in sorted(rows, key=lambda k: rows[k]["total"]):
        r = rows[k]
        pt = ParetoPoint.from_key(k)
        pace = ", paced" if pt.pacing else ""
        pace += f", {pt.extra}" if pt.extra else ""
        spread = f" (+-{r['spread']:.3f})" if r["n"] > 1 else ""
        out.append(f"| {pt.up} / {pt.down}, H={pt.h}{pace} | {r['ratio']:.3f}x{spread} | {r['n']} | "
                   f"{r['up']:.1f} | {r['down']:.1f} | {r['req_k']:.2f} | {r['total']:.1f} | 1/{r['dp_fold']:.0f} | "
                   f"{r['effective_h']:.1f} / {pt.h} | {r['merged_share']:.0%} | {'yes' if r['front'] else ('diverged' if r['diverged'] else '')} |")
    return out


def plot_pareto(report: dict, path: Path) -> None:
    """Loss against bytes per token (log x), one panel per corpus, the front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c for c in report["corpora"] if report["corpora"][c].get("pareto")]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(7.5 * len(names), 5.5), squeeze=False)
    colors = {8: "tab:blue", 24: "tab:orange", 48: "tab:green"}
    short = {"fp32": "32", "bf16": "16", "int4": "4"}
    for ax, cname in zip(axes[0], names, strict=False):
        p = report["corpora"][cname]["pareto"]
        rows = p["rows"]
        for r in rows.values():
            pt = r["point"]
            color = colors.get(pt["h"], "gray")
            ax.scatter(r["total"], r["mean"], marker="*" if pt["pacing"] else "o", s=70 if pt["pacing"] else 30,
                       facecolors=color if r["complete"] else "none", edgecolors=color)
            ax.annotate(f"{short.get(pt['up'], pt['up'])}/{short.get(pt['down'], pt['down'])}",
                        (r["total"], r["mean"]), fontsize=6, xytext=(3, -8), textcoords="offset points")
        fr = [rows[k] for k in p["front"]]
        ax.plot([r["total"] for r in fr], [r["mean"] for r in fr], "k--", lw=1, label="front (all seeds)")
        for fold in (10, 100):
            ax.axvline(p["dp_bytes_per_token"]["fp32"] / fold, color="gray", lw=0.8, ls=":")
            ax.text(p["dp_bytes_per_token"]["fp32"] / fold, ax.get_ylim()[1], f" 1/{fold} DP", fontsize=7, va="top")
        ax.set_xscale("log")
        ax.set_xlabel("bytes per token trained (learners, up + down)")
        ax.set_ylabel("final validation loss (mean over seeds)")
        ax.set_title(f"{cname}: blue H=8, orange H=24, green H=48; * paced; hollow: first seed only; "
                     "label up/down bits", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("atoll communication front: validation loss against bytes per token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    g = ap.add_argument_group("communication front", "decoupled K=1+grace rows over uplink x downlink precision x H "
                              "x round pacing, each with its bytes per token (learners' own counted stores)")
    g.add_argument("--pareto", action="store_true", help="run only the front's rows (no DP or sweeps; inner lr "
                   "--pareto-inner-lr)")
    g.add_argument("--pareto-grid", default="auto", choices=("none", "coord", "auto", "full", "points"),
                   help="none: no front rows; coord: the reference (fp32 both ways, H=8, no pacing) and one axis "
                   "at a time; auto: coord, then the cross product of each axis's values within --pareto-promising "
                   "of the reference; full: the whole cross product (72 points by default); points: the reference and "
                   "--pareto-points")
    g.add_argument("--pareto-points", default="", help="with --pareto-grid points: UP/DOWN/H/PACING[/SETTINGS],... (e.g. "
                   "int4/int4/24/1)")
    g.add_argument("--pareto-ups", default="fp32,bf16,int4", help="uplink precisions (the deltas)")
    g.add_argument("--pareto-downs", default="fp32,bf16,int4", help="downlink precisions (the fetched fragments)")
    g.add_argument("--pareto-hs", default="8,16,24,48", help="H values (P = min(--pareto-fragments, H))")
    g.add_argument("--pareto-pacing", default="0,1", help="round pacing values (fraction of H; 0 = off)")
    g.add_argument("--pareto-extra", default="", help="more DilocoConfig settings for every point of the front, "
                   "field:value;... (e.g. keep_local_progress:1); the reference takes them too")
    g.add_argument("--pareto-fragments", type=int, default=8, help="P for every H (at most H)")
    g.add_argument("--pareto-inner-lr", type=float, default=6e-3,
                   help="inner lr of the front's rows with --pareto (else the decoupled sweep's best)")
    g.add_argument("--pareto-promising", type=float, default=0.04,
                   help="auto: an axis value within this fraction of the reference's loss (first seed) joins the "
                   "cross product; within half of it, a point reruns at every seed")
    g.add_argument("--pareto-max", type=int, default=16, help="auto: most points in the cross product")
    g.add_argument("--pareto-tol", type=float, default=0.02, help="the target's loss: at most this fraction above "
                   "the reference")
    g.add_argument("--pareto-target-fold", type=float, default=100, help="the target's bytes: at most 1/this of "
                   "DP fp32's bytes per token")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    rows_all = [r for r in a.rows.split(",") if r]
    rows_first = [r for r in a.rows_first_seed.split(",") if r and r not in rows_all]
    rows_late = [r for r in a.rows_late.split(",") if r and r not in rows_all + rows_first]
    if a.pareto:
        rows_all, rows_first, rows_late = [], [], []
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

            if a.pareto:  # the front alone, at the given inner lr
                dp_lr, inner_lr = math.nan, a.pareto_inner_lr
            else:
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
            for seed in seeds[1:] if not a.pareto else ():
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

            # -- the communication front -------------------------------------------------------
            def pareto_row(pt: ParetoPoint, seed: int) -> float:
                c = pareto_config(configs["decoupled"], pt, a.pareto_fragments)
                return run(pt.key(inner_lr), f"{label_of('diloco', c, inner_lr)}, {pt.label()}", seed,
                           lambda s: run_diloco(a, model, spec_for(s), c, inner_lr, s, root, rounds_cache=rounds_cache,
                                                wire=True))

            if a.pareto_grid != "none":
                run_pareto(a, run, seeds, inner_lr, runs, pareto_row)
            if a.pareto:
                say("")
                say(f"== {desc}; {int(a.tokens):,} tokens; GPT {a.layers} layers x d{a.width}, context {a.context} "
                    f"({n_params:,} params); M = {M} learners x batch {a.batch}, learners 3-4 {SLOW}x slower; "
                    f"seeds {a.seeds} ==")
                report["corpora"][cname] = {"desc": desc, "inner_lr": inner_lr, "labels": labels,
                                            "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()},
                                            "pareto": pareto_table(a, runs, labels, inner_lr, n_params, seeds, say)}
                continue

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
            order = sorted(dp_keys, key=lambda k: float(k.split()[1])) + [k for k in runs
                                                                           if not k.startswith(("dp ", "pareto "))]
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
                                        "labels": labels,
                                        "pareto": pareto_table(a, runs, labels, inner_lr, n_params, seeds, say)}

    name = "quality-pareto" if a.pareto else "quality"
    (out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    if not a.pareto:
        plot(report, out / "quality.png")
    plot_pareto(report, out / "quality-pareto.png")
    md = [f"### {c}\n\n" + "\n".join(v["pareto"]["markdown"]) + "\n" for c, v in report["corpora"].items()
          if v.get("pareto")]
    if md:
        (out / "quality-pareto.md").write_text("\n".join(md))
    print(f"wrote {out / name}.txt, .json, .png" + ("" if a.pareto else f" and {out / 'quality-pareto.png'}"))
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["corpora"])
    fig, axes = plt.subplots(1, len(names), figsize=(8 * len(names), 5.5), squeeze=False)
    for ax, cname in zip(axes[0], names, strict=False):
        c = report["corpora"][cname]
        shown = [c["best_dp"]] + [k for k in c["runs"] if not k.startswith(("dp ", "pareto "))]
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
