"""Run a whole Decoupled DiLoCo job in one process on a virtual clock.

The very same :class:`~atoll.train.learner.Learner` (on atoll's own inner loop:
:class:`~atoll.train.inner.RecipeLearner`) and :class:`~atoll.train.synchronizer.Synchronizer`
objects as in a real run, on a real bucket, but time is simulated: learner i finishes a step
every ``base_step_s * slowdown_i`` virtual seconds (whatever the CPU needs to compute it), and
the synchronizer's quorum/grace clock is the same virtual clock. That makes heterogeneous-speed experiments exact and repeatable on a laptop: the
quality benchmark uses it to compare methods at an equal token budget.

Event order per learner step (as in the real loop): compute the step, publish the due fragment,
then adopt the newest version of every fragment committed so far, read as a learner's fetcher
reads it (:class:`~atoll.train.fetcher.Follower`: the newest version only; with a compressed
downlink, the chain of updates or the view). The synchronizer polls after every event and at the
recheck times its policy asks for. In lock-step mode (K = M, P = 1) a learner that must wait for a
merged version simply does not get its next event until that version is committed.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from atoll.storage.learner_side import LearnerStore
from atoll.storage.reader import RunReader
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.storage.wire import WireCounts
from atoll.train.fetcher import Follower
from atoll.train.inner import RecipeLearner
from atoll.train.run import load_recipe
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions

__all__ = ["VirtualResult", "run_virtual"]


@dataclass
class VirtualResult:
    """What a virtual run did."""

    tokens: int = 0
    """Tokens consumed by all learners."""

    virtual_s: float = 0.0
    """Virtual wall-clock time at the end."""

    rounds: int = 0
    """Rounds committed."""

    curve: list[tuple[int, float]] = field(default_factory=list)
    """(tokens, validation loss of the global model) at every evaluation."""

    merged_per_round: float = 0.0
    """Mean number of contributions merged per round."""

    bytes_moved: int = 0
    """Contribution payloads uploaded plus new fragment versions downloaded by every learner."""

    steps: dict[str, int] = field(default_factory=dict)
    """Inner steps per learner."""

    wire: dict[str, WireCounts] = field(default_factory=dict)
    """Requests and bytes each party's object store sent while training, by learner id and
    ``"synchronizer"`` (with ``own_stores``; without, everyone shares one store: ``"all"``)."""

    join_wire: dict[str, WireCounts] = field(default_factory=dict)
    """The same, for joining (before the first step: manifest, recipe, the whole model, saved state)."""


def run_virtual(
    store: SynchronizerStore,
    *,
    token_budget: int,
    base_step_s: float = 1.0,
    step_noise: float = 0.0,
    seed: int = 0,
    evaluate: Callable[[Mapping[str, torch.Tensor]], float] | None = None,
    eval_every_tokens: int = 0,
    sync_options: SynchronizerOptions | None = None,
    log: Callable[[str], None] = lambda s: None,
    own_stores: bool = False,
) -> VirtualResult:
    """Train the run in ``store`` until the learners have consumed ``token_budget`` tokens.

    ``own_stores``: each learner on its own handle of the run, counted apart (as separate
    processes are); the synchronizer on ``store``. Otherwise all share ``store``'s object store,
    caches and counts (the learners through a :class:`LearnerStore` beside it).
    Either way each learner reads the new versions it adopts itself."""
    run = _VirtualRun(store, base_step_s=base_step_s, step_noise=step_noise, seed=seed,
                      sync_options=sync_options, log=log, own_stores=own_stores)
    result = run.result
    next_eval = eval_every_tokens or None
    while run.events and result.tokens < token_budget:
        run.next_event()
        if evaluate is not None and next_eval is not None and result.tokens >= next_eval:
            loss = evaluate(run.global_params())
            result.curve.append((result.tokens, loss))
            log(f"[virtual {run.now:8.1f}s] tokens {result.tokens:,} round {run.sync.round} val_loss {loss:.4f}")
            next_eval += eval_every_tokens
    if evaluate is not None and (not result.curve or result.curve[-1][0] != result.tokens):
        result.curve.append((result.tokens, evaluate(run.global_params())))
    result.virtual_s = run.now
    result.rounds = run.sync.round
    result.merged_per_round = sum(run.merged) / len(run.merged) if run.merged else 0.0
    result.steps = {lr.learner_id: lr.summary.steps for lr in run.learners}
    result.join_wire = run.joined
    result.wire = {k: v - run.joined.get(k, WireCounts()) for k, v in run.wire().items()}
    return result


class _VirtualRun:
    """The learners, the synchronizer and the event queue of one virtual run; ``now`` is the clock."""

    def __init__(self, store: SynchronizerStore, *, base_step_s: float, step_noise: float, seed: int,
                 sync_options: SynchronizerOptions | None, log: Callable[[str], None], own_stores: bool = False) -> None:
        self.now = 0.0
        self.store, self.own_stores = store, own_stores
        self.sync = Synchronizer(store, options=sync_options or SynchronizerOptions(poll_interval_s=base_step_s / 4),
                                 clock=lambda: self.now)
        specs = load_recipe(store).learners
        learner = LearnerStore.beside(store)  # the learners' role on the synchronizer's handle
        handles = [learner.sibling(metered_apart=True) if own_stores else learner for _ in specs]
        self.learners = [RecipeLearner(h, spec.learner_id, log=log) for h, spec in zip(handles, specs, strict=True)]
        self.base_step_s, self.step_noise = base_step_s, step_noise
        self.rng = random.Random(seed)
        self.reader = RunReader.beside(store).sibling()
        self.readers = [h.sibling() for h in handles] if own_stores else [self.reader] * len(specs)
        self.seen_round = [lr.start_round for lr in self.learners]
        self.followers = [Follower(reader, lr.versions, lr.held_views(), log=log)
                          for reader, lr in zip(self.readers, self.learners, strict=True)]
        self.result = VirtualResult()
        self.merged: list[int] = []
        self.dts = [0.0] * len(self.learners)
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.blocked: set[int] = set()
        """Lock-step learners waiting for a merged version: no next event until it is committed."""
        self.sync_wake: float | None = None
        for i in range(len(self.learners)):
            self.push(self.step_s(i), "learner", i)
        self.joined = self.wire()

    def step_s(self, i: int) -> float:
        """Draw learner i's next step duration (and remember it: the learner reports it)."""
        s = self.base_step_s * self.learners[i].spec.slowdown
        self.dts[i] = s * (1 + self.step_noise * (2 * self.rng.random() - 1)) if self.step_noise else s
        return self.dts[i]

    def push(self, t: float, kind: str, i: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, i))

    def adopt_committed(self, i: int) -> None:
        records = self.readers[i].poll_commits(self.seen_round[i])
        for version, fragment, values in self.followers[i].advance(records):
            self.learners[i].adopt(version, fragment, values)
        if records:
            self.seen_round[i] = records[-1].round

    def wire(self) -> dict[str, WireCounts]:
        if not self.own_stores:
            return {"all": self.store.store.wire_counts()}
        out = {lr.learner_id: lr.store.store.wire_counts() for lr in self.learners}
        out["synchronizer"] = self.store.store.wire_counts()
        return out

    def next_event(self) -> None:
        """The next event (a learner's step, or a recheck the synchronizer asked for), then the
        synchronizer looks at the bucket, like a tight poll loop."""
        self.now, _, kind, i = heapq.heappop(self.events)
        if kind == "learner":
            lr = self.learners[i]
            before = lr.summary.tokens
            lr.step(step_time_s=self.dts[i])
            self.result.tokens += lr.summary.tokens - before
            self.adopt_committed(i)
            if lr.waiting_for() is not None:
                self.blocked.add(i)
            else:
                self.push(self.now + self.step_s(i), "learner", i)
        elif kind == "sync":
            self.sync_wake = None
        self.tick_synchronizer()

    def tick_synchronizer(self) -> None:
        """Commit every round that can close now; unblock lock-step learners whose version landed.
        ``Synchronizer.tick`` commits each round before it returns (no commit pipeline here), so
        the bucket moves with the virtual clock and a run is deterministic."""
        while True:
            out = self.sync.tick()
            if isinstance(out, RoundSummary):
                rec = out.record
                self.merged.append(len(rec.accepted))
                self.result.bytes_moved += int(rec.stats.get("bytes_in", 0))
                self.result.bytes_moved += int(rec.stats.get("bytes_out_per_learner", 0)) * len(self.learners)
                for j in sorted(self.blocked):
                    self.adopt_committed(j)
                    if self.learners[j].waiting_for() is None:
                        self.blocked.discard(j)
                        self.push(self.now + self.step_s(j), "learner", j)
                continue
            if out.recheck_at_s is not None and (self.sync_wake is None or out.recheck_at_s < self.sync_wake):
                self.sync_wake = out.recheck_at_s
                self.push(self.sync_wake, "sync")
            return

    def global_params(self) -> dict[str, torch.Tensor]:
        return {n: t for frag in self.sync.fragments for n, t in frag.items()}
