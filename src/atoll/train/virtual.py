"""Run a whole Decoupled DiLoCo job in one process on a virtual clock.

The very same :class:`~atoll.train.learner.Learner` and
:class:`~atoll.train.synchronizer.Synchronizer` objects as in a real run, on a real bucket, but
time is simulated: learner i finishes a step every ``base_step_s * slowdown_i`` virtual seconds
(whatever the CPU needs to compute it), and the synchronizer's quorum/grace clock is the same
virtual clock. That makes heterogeneous-speed experiments exact and repeatable on a laptop: the
quality benchmark uses it to compare methods at an equal token budget.

Event order per learner step (as in the real loop): compute the step, publish the due fragment,
then adopt every version committed so far. The synchronizer polls after every event and at the
recheck times its policy asks for. In lock-step mode (K = M) a learner that must wait for a
merged version simply does not get its next event until that version is committed.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from atoll.storage.bucket import RunStore
from atoll.train.learner import Learner
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


def run_virtual(
    store: RunStore,
    *,
    token_budget: int,
    base_step_s: float = 1.0,
    step_noise: float = 0.0,
    seed: int = 0,
    evaluate: Callable[[Mapping[str, torch.Tensor]], float] | None = None,
    eval_every_tokens: int = 0,
    sync_options: SynchronizerOptions | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> VirtualResult:
    """Train the run in ``store`` until the learners have consumed ``token_budget`` tokens."""
    vnow = 0.0
    sync = Synchronizer(store, options=sync_options or SynchronizerOptions(poll_interval_s=base_step_s / 4),
                        clock=lambda: vnow)
    learners = [Learner(store, spec.learner_id, log=log) for spec in load_recipe(store).learners]
    rng = random.Random(seed)
    reader = store.sibling()
    seen_round = [lr.start_round for lr in learners]
    fragment_cache: dict[int, dict[str, torch.Tensor]] = {}
    result = VirtualResult()
    merged: list[int] = []

    dts = [0.0] * len(learners)

    def step_s(i: int) -> float:
        """Draw learner i's next step duration (and remember it: the learner reports it)."""
        s = base_step_s * learners[i].spec.slowdown
        dts[i] = s * (1 + step_noise * (2 * rng.random() - 1)) if step_noise else s
        return dts[i]

    def adopt_committed(i: int) -> None:
        for rec in reader.poll_commits(seen_round[i]):
            if rec.updated:
                if rec.round not in fragment_cache:
                    fragment_cache[rec.round] = reader.read_global_fragment(rec.fragment, rec.round)
                learners[i].adopt(rec.round, rec.fragment, fragment_cache[rec.round])
            seen_round[i] = rec.round

    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def push(t: float, kind: str, i: int = -1) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, i))

    for i in range(len(learners)):
        push(step_s(i), "learner", i)
    blocked: set[int] = set()
    next_eval = eval_every_tokens or None
    sync_wake: float | None = None

    while events and result.tokens < token_budget:
        vnow, _, kind, i = heapq.heappop(events)
        if kind == "learner":
            lr = learners[i]
            before = lr.summary.tokens
            lr.step(step_time_s=dts[i])
            result.tokens += lr.summary.tokens - before
            adopt_committed(i)
            if lr.waiting_for() is not None:
                blocked.add(i)
            else:
                push(vnow + step_s(i), "learner", i)
        elif kind == "sync":
            sync_wake = None
        # The synchronizer looks at the bucket after every event, like a tight poll loop.
        while True:
            out = sync.tick()
            if isinstance(out, RoundSummary):
                rec = out.record
                merged.append(len(rec.accepted))
                result.bytes_moved += int(rec.stats.get("bytes_in", 0))
                result.bytes_moved += int(rec.stats.get("bytes_out_per_learner", 0)) * len(learners)
                for j in sorted(blocked):
                    adopt_committed(j)
                    if learners[j].waiting_for() is None:
                        blocked.discard(j)
                        push(vnow + step_s(j), "learner", j)
                continue
            if out.recheck_at_s is not None and (sync_wake is None or out.recheck_at_s < sync_wake):
                sync_wake = out.recheck_at_s
                push(sync_wake, "sync")
            break
        if evaluate is not None and next_eval is not None and result.tokens >= next_eval:
            loss = evaluate({n: t for frag in sync.fragments for n, t in frag.items()})
            result.curve.append((result.tokens, loss))
            log(f"[virtual {vnow:8.1f}s] tokens {result.tokens:,} round {sync.round} val_loss {loss:.4f}")
            next_eval += eval_every_tokens
    if evaluate is not None and (not result.curve or result.curve[-1][0] != result.tokens):
        result.curve.append((result.tokens, evaluate({n: t for frag in sync.fragments for n, t in frag.items()})))
    result.virtual_s = vnow
    result.rounds = sync.round
    result.merged_per_round = sum(merged) / len(merged) if merged else 0.0
    result.steps = {lr.learner_id: lr.summary.steps for lr in learners}
    return result


