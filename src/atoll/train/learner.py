"""The learner loop: one island training on its own data, publishing fragment deltas on schedule.

Read top to bottom, this is the whole of what a learner does:

1. Rebuild the model and its data shard from the run's recipe in the bucket; start from the
   latest committed global state, and from its own last saved inner state if it has one (AdamW
   moments, step counter, data cursor): that is rejoin.
2. Each inner step: AdamW with warmup + cosine on the learner's own step counter; count steps and
   tokens for every fragment.
3. After step t, if the schedule says fragment p is due (t mod H == t_p), publish
   ``delta = Theta_p(base) - theta_p`` with the counters since the last alignment.
4. A background thread watches the bucket for new commits and prefetches new global fragment
   versions; the loop adopts each one by overwriting its local fragment in place (AdamW moments
   are kept) and resetting that fragment's counters. It never waits for peers. Only in lock-step
   mode (K = M: the round cannot close without every learner) does it wait, tau steps after
   publishing, for the version that merges its contribution: that is synchronous DiLoCo.
5. Every ``save_every_steps`` it saves its inner state for rejoin; it stops once the run has
   committed its last round.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from atoll.core.align import LearnerCounters, align_fragment
from atoll.core.pseudograd import learner_delta
from atoll.storage.bucket import RunStore
from atoll.train.data import BatchStream
from atoll.train.model import loss_fn
from atoll.train.recipe import Recipe, lr_at_step

__all__ = ["LearnerOptions", "LearnerSummary", "run_learner", "load_recipe"]


@dataclass(frozen=True, kw_only=True)
class LearnerOptions:
    """Knobs of one learner process that are not part of the run's recipe."""

    poll_interval_s: float = 0.2
    """How often the background fetcher looks for new commits."""

    max_steps: int | None = None
    """Stop after this many local steps (None: until the run is finished)."""

    lockstep: bool | None = None
    """Wait for each merged version tau steps after publishing. None: only when K = M."""

    log_every_steps: int = 0
    """Print a progress line every this many steps (0: quiet)."""

    threads: int | None = None
    """torch intra-op threads for this process (None: leave torch's default)."""


@dataclass
class LearnerSummary:
    learner_id: str
    steps: int = 0
    tokens: int = 0
    published: int = 0
    aligned: int = 0
    last_loss: float = float("nan")
    started_from_round: int = 0
    resumed_inner_state: bool = False
    losses: list[float] = field(default_factory=list)


def load_recipe(store: RunStore) -> Recipe:
    extra = store.manifest.extra
    if "recipe" not in extra:
        raise ValueError(f"run {store.url} has no recipe (run.json extra.recipe); it was not created by atoll.train")
    return Recipe.from_dict(extra["recipe"])


class _Fetcher(threading.Thread):
    """Background poller: new commits -> prefetched fragment versions on a queue."""

    def __init__(self, store: RunStore, after_round: int, poll_interval_s: float) -> None:
        super().__init__(daemon=True, name="atoll-fetcher")
        self.store = RunStore(store.store)  # own caches; the object store itself is shared
        self.store._manifest = store.manifest  # noqa: SLF001 - same run, avoid a GET
        self.after = after_round
        self.poll_interval_s = poll_interval_s
        self.ready: queue.Queue[tuple[int, int, dict[str, torch.Tensor]]] = queue.Queue()
        self.latest_round = after_round
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                for rec in self.store.poll_commits(self.after):
                    if rec.updated:
                        self.ready.put((rec.round, rec.fragment, self.store.read_global_fragment(rec.fragment, rec.round)))
                    self.after = self.latest_round = rec.round
            except Exception as e:  # noqa: BLE001 - keep polling; the loop decides what to do
                self.error = e
            self.stop.wait(self.poll_interval_s)


def _save_inner_state(store: RunStore, learner_id: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                      step: int, cursor: dict[str, Any], tokens: int) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p)
        if st:
            tensors[f"adamw.{name}.exp_avg"] = st["exp_avg"].detach().float().contiguous()
            tensors[f"adamw.{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().float().contiguous()
            tensors[f"adamw.{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    store.save_learner_state(learner_id, tensors, {"step": step, "cursor": cursor, "tokens": tokens})


def _load_inner_state(tensors: dict[str, torch.Tensor], model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for name, p in model.named_parameters():
        if f"adamw.{name}.exp_avg" not in tensors:
            continue
        opt.state[p] = {
            "step": tensors[f"adamw.{name}.step"].reshape(()).clone(),
            "exp_avg": tensors[f"adamw.{name}.exp_avg"].to(p.dtype).reshape(p.shape).clone(),
            "exp_avg_sq": tensors[f"adamw.{name}.exp_avg_sq"].to(p.dtype).reshape(p.shape).clone(),
        }


def run_learner(
    store: RunStore,
    learner_id: str,
    *,
    options: LearnerOptions | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
) -> LearnerSummary:
    """Train as learner ``learner_id`` of the run in ``store`` until the run is finished."""
    options = options or LearnerOptions()
    if options.threads:
        torch.set_num_threads(options.threads)
    config, plan, recipe = store.config, store.plan, load_recipe(store)
    index, spec = recipe.learner(learner_id)
    lockstep = options.lockstep if options.lockstep is not None else config.min_quorum == config.num_learners
    summary = LearnerSummary(learner_id=learner_id)

    # 1. Model, data shard, global state, own inner state.
    model = recipe.model_factory()()
    params = dict(model.named_parameters())
    if set(params) != set(plan.sizes):
        raise ValueError(f"model parameters do not match the run's fragment plan: {sorted(set(params) ^ set(plan.sizes))[:5]}")
    context = int(getattr(getattr(model, "config", None), "context_tokens", 0)) or 128
    stream = BatchStream(recipe.data.corpus().train, context_tokens=context, learner_index=index,
                         num_learners=config.num_learners, seed=recipe.data.seed)
    start_round = store.latest_round()
    state = store.read_global_state(start_round)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state.params[name])
    versions = list(state.versions)
    bases = [plan.select(state.params, p) for p in range(plan.num_fragments)]
    counters = LearnerCounters.fresh(plan.num_fragments)
    for p, v in enumerate(versions):
        counters.fragments[p].base_version = v
    opt = recipe.inner.make(model.parameters())
    step, tokens_total = 0, 0
    saved = store.load_learner_state(learner_id)
    if saved is not None:
        _load_inner_state(saved.tensors, model, opt)
        step = int(saved.meta.get("step", 0))
        tokens_total = int(saved.meta.get("tokens", 0))
        if isinstance(saved.meta.get("cursor"), dict):
            stream.load_state_dict(saved.meta["cursor"])
        summary.resumed_inner_state = True
    summary.started_from_round = start_round
    log(f"{learner_id}: {'rejoined' if saved else 'joined'} at round {start_round}, step {step}, "
        f"pool {spec.pool}, batch {spec.batch_size}, slowdown {spec.slowdown:g}x")

    fetcher = _Fetcher(store, start_round, options.poll_interval_s)
    fetcher.start()
    step_ema: float | None = None
    pending: list[tuple[int, int, int]] = []  # (due step, fragment, base version) in lock-step mode

    def adopt_ready(block_for: tuple[int, int] | None = None) -> None:
        """Align every prefetched newer version; optionally wait until fragment p is past base b."""
        while True:
            try:
                while True:
                    r, p, tensors = fetcher.ready.get_nowait()
                    if r > versions[p]:
                        bases[p] = align_fragment(params, tensors, counters=counters, fragment=p, version=r)
                        versions[p] = r
                        summary.aligned += 1
            except queue.Empty:
                pass
            if block_for is None or versions[block_for[0]] > block_for[1] or should_stop() or run_finished():
                return
            time.sleep(min(0.01, options.poll_interval_s))

    def run_finished() -> bool:
        return fetcher.latest_round >= recipe.max_rounds

    try:
        model.train()
        while not should_stop() and not run_finished():
            if options.max_steps is not None and summary.steps >= options.max_steps:
                break
            t0 = time.perf_counter()
            step += 1
            # 2. One inner step on this learner's own lr schedule.
            for group in opt.param_groups:
                group["lr"] = lr_at_step(recipe.inner, step)
            x, y = stream.next_batch(spec.batch_size)
            loss = loss_fn(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if recipe.inner.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.inner.grad_clip)
            opt.step()
            n_tokens = int(x.numel())
            counters.record_step(n_tokens)
            tokens_total += n_tokens
            summary.steps += 1
            summary.tokens += n_tokens
            summary.last_loss = loss.item()
            if spec.slowdown > 1:  # stand-in for an older chip: stretch the step
                time.sleep((spec.slowdown - 1) * (time.perf_counter() - t0))
            dt = time.perf_counter() - t0
            step_ema = dt if step_ema is None else 0.9 * step_ema + 0.1 * dt

            # 3. Publish the fragment that is due, against the version we last aligned to.
            p = plan.fragment_at(step)
            if p is not None and counters.fragments[p].c_steps > 0:
                local = plan.select(params, p)
                fc = counters.fragments[p]
                store.publish_contribution(
                    learner_id, p, fc.base_version, fc, learner_delta(bases[p], local),
                    info={"step": step, "step_time_s": round(step_ema, 6), "pool": spec.pool,
                          "loss": round(summary.last_loss, 6) if math.isfinite(summary.last_loss) else None},
                )
                summary.published += 1
                if lockstep:
                    pending.append((step + config.overlap_steps, p, fc.base_version))

            # 4. Adopt new global versions (and, in lock-step mode, wait for ours when due).
            adopt_ready()
            while pending and pending[0][0] <= step:
                _, pp, base = pending.pop(0)
                adopt_ready(block_for=(pp, base))

            # 5. Save inner state for rejoin.
            if recipe.save_every_steps and step % recipe.save_every_steps == 0:
                _save_inner_state(store, learner_id, model, opt, step, stream.state_dict(), tokens_total)
            if options.log_every_steps and step % options.log_every_steps == 0:
                log(f"{learner_id}: step {step} loss {summary.last_loss:.4f} published {summary.published} "
                    f"aligned {summary.aligned} ({step_ema * 1000:.0f} ms/step)")
            summary.losses.append(summary.last_loss)
    finally:
        fetcher.stop.set()
        fetcher.join(timeout=5)
    _save_inner_state(store, learner_id, model, opt, step, stream.state_dict(), tokens_total)
    log(f"{learner_id}: stopped at step {step} ({summary.published} published, {summary.aligned} aligned)")
    return summary
