"""The DiLoCo side of one learner: bases, counters, publish, adopt and save.

A :class:`Learner` is always given the model and the optimizer it follows; whoever trains them
(atoll's own inner loop, :mod:`atoll.train.inner`, or a user's loop through :func:`atoll.join`,
:mod:`atoll.train.hook`) calls :meth:`Learner.record_step` after each optimizer step. Read top
to bottom, this is what a learner does around those steps:

1. On construction, overwrite the model with the run's latest committed global state, and the
   optimizer with its own last saved inner state if it has one (AdamW moments, step counter,
   data cursor): that is rejoin.
2. :meth:`Learner.record_step`: count the step's tokens for every fragment; if the schedule says
   fragment p is due (t mod H == t_p), publish ``delta = Theta_p(base) - theta_p`` with the
   counters since the last alignment (:mod:`atoll.train.publisher` writes it, now or on a thread).
3. :meth:`Learner.adopt`: overwrite a fragment in place with a newer global version (AdamW
   moments are kept) and reset its counters. In lock-step mode (K = M, P = 1) the driver waits, tau
   steps after publishing, for the version that merges its contribution (:meth:`Learner.waiting_for`).
4. :meth:`Learner.save`: the inner state, for rejoin.

Where the weights live is the learner's :class:`Weights`: a :class:`Replica` (one process, or
any rank of a DDP island, of which only rank 0 publishes) or FSDP2 shards
(:class:`atoll.train.island.Shards`). The life of the process around all this (lease,
heartbeats, the fetcher of new versions, exits) is :class:`atoll.train.session.LearnerSession`.
Bases and deltas stay fp32 on the model's device; each publish moves its delta to the host in one copy.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from atoll.core.align import LearnerCounters, PublishMarks, align_fragment, carry, carry_counters
from atoll.core.retry import FETCH_RETRY, RetryPolicy
from atoll.storage.learner_side import LearnerStore
from atoll.storage.validation import InvalidInput
from atoll.storage.wire import wire_report
from atoll.train.device import flat_fragment_to_device, fragment_delta_to_host
from atoll.train.fetcher import FetchError
from atoll.train.inner_state import load_inner_state, local_inner_state, moments_as
from atoll.train.publisher import Outbox, Outgoing
from atoll.train.run import load_recipe

__all__ = ["FetchError", "Learner", "LearnerExit", "LearnerOptions", "LearnerSummary", "Replica",
           "STALLED_PUBLISHES", "Weights", "publish_due"]


@dataclass(frozen=True, kw_only=True)
class LearnerOptions:
    """Knobs of one learner process that are not part of the run's recipe."""

    poll_interval_s: float = 0.2
    """How often the background fetcher looks for new commits."""

    max_steps: int | None = None
    """Stop after this many local steps (None: until the run is finished)."""

    lockstep: bool | None = None
    """Wait for each merged version tau steps after publishing. None: only when K = M and P = 1
    (synchronous DiLoCo). With P > 1 a learner publishes fragments in offset order, which is not
    the rounds' order (P = 2, H = 8: fragment 1 at step 4, fragment 0 at step 8, round 1 merges
    fragment 0), so waiting after the first publish would deadlock the run; K = M there is the
    synchronizer waiting for all M, and the learners run on."""

    log_every_steps: int = 0
    """Print a progress line every this many steps (0: quiet)."""

    threads: int | None = None
    """torch intra-op threads for this process (None: leave torch's default)."""

    fetch_retry: RetryPolicy = FETCH_RETRY
    """Backoff and bound for failed polls of the run's commits (core.retry); then FetchError."""

    flow_run_id: str | None = None
    """The Prefect flow run running this learner, recorded in its lease (informational)."""

    take_lease: bool = True
    """Take the learner's next lease before starting (fencing older copies), tag contributions with
    its incarnation and heartbeat. False: incarnation 0, no heartbeat, never fenced (tests, tools)."""

    heartbeat_interval_s: float = 5.0
    """How often the background keeper heartbeats and checks for a fence, the stop marker and the
    orphan timeout."""

    stall_timeout_s: float = 120.0
    """Heartbeats stop once the training loop has made no progress (no step finished, no lock-step
    wait polled) for this long, so a hung learner looks dead and is replaced."""

    orphan_timeout_s: float | None = 900.0
    """Exit (saving state) when no new commit has appeared for this long, counted from the start
    or from the last new commit (the synchronizer is gone). None: never."""

    handle_sigterm: bool = True
    """On SIGTERM, finish the current step, save and exit (exit_reason "sigterm"). Installed only
    when run_learner runs in the main thread; the previous handler is restored afterwards."""

    device: str | None = None
    """Where atoll's own loop trains: 'auto', 'cpu', 'cuda', 'cuda:N', 'mps' (None: the recipe's
    LearnerSpec.device). A user's loop trains where its model is."""

    autocast: str | None = None
    """'' (off) or 'bf16' autocast of atoll's own inner forward pass (None: the recipe's LearnerSpec.autocast)."""

    publish_in_background: bool = True
    """Encode, hash and write each contribution on a background thread, in order, so the next
    inner steps overlap the bucket I/O (the delta itself is taken, and copied to the host, in the
    step). At most two contributions wait; a failed write is raised from the next step."""


LOSS_WINDOW = 10_000
"""How many recent step losses a learner's summary keeps at least (see ``LearnerSummary.losses``)."""


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
    inner_state_lost: str = ""
    """Why a saved inner state could not be read back (the learner rejoined with fresh optimizer state)."""
    losses: list[float] = field(default_factory=list)
    """Per-step training losses, oldest first: the most recent ``LOSS_WINDOW`` to ``2 * LOSS_WINDOW`` of
    them (trimmed in bulk, so appending stays O(1)), so a learner that runs for days holds a bounded list."""
    incarnation: int = 0
    """The lease incarnation this process held (0: no lease)."""
    exit_reason: str = ""
    """Why run_learner returned: one of :data:`atoll.train.lease.EXIT_REASONS`."""
    exit_detail: str = ""
    """The same, for people ("fenced by incarnation 4", "stopped by alice: ...")."""


class LearnerExit(Exception):
    """Raised out of a user's training loop (from the optimizer step) when the learner must stop:
    the run is finished or stopped, SIGTERM, orphaned or fenced. The ``with`` block of
    :func:`atoll.train.hook.join` catches it after saving (unless fenced)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


STALLED_PUBLISHES = 4
"""Publishes of one fragment against one base version before a learner backs off (see publish_due)."""


def publish_due(c_steps: int, inner_steps: int) -> bool:
    """Whether a learner publishes the due fragment, ``c_steps`` steps after it last aligned it.

    Each publish supersedes the previous one against the same base (counters are cumulative), so
    while the synchronizer keeps up this is every sync interval (a fragment is merged within a
    few). When the fragment's base has not moved for more than ``STALLED_PUBLISHES`` intervals
    (the synchronizer is down, or far behind), the learner backs off to intervals 8, 16, 32, …:
    a training run that is dead for an hour leaves a few dozen superseded objects per fragment
    behind, not one per interval, and the restarted synchronizer does not have to read them all.
    """
    n = c_steps // max(1, inner_steps)
    return n <= STALLED_PUBLISHES or (n & (n - 1)) == 0


# -- where the weights live --------------------------------------------------------------------
class Weights(Protocol):
    """Where a learner's parameters, bases and optimizer state live on this process: what
    differs between one process (or a DDP rank) and an FSDP2 shard."""

    def delta_to_host(self, learner: Learner, fragment: int, out: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
        """The due fragment's delta on the host (into ``out`` when given), or None when another
        rank of the island publishes it."""

    def adopt(self, learner: Learner, fragment: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Take a newer global version of ``fragment`` as its value and base; reset its counters."""

    def inner_state(self, learner: Learner, *, snapshot: bool) -> dict[str, torch.Tensor]:
        """The optimizer state to save, in :func:`~atoll.train.inner_state.inner_state_tensors`' layout."""

    def broadcast(self, learner: Learner, fragments: list[int]) -> None:
        """Every rank of an island: take rank 0's values of ``fragments`` (after rank 0 adopted them)."""


@dataclass(frozen=True)
class Replica:
    """This process holds the whole model: a one-process learner, or one rank of a DDP island."""

    publishes: bool = True
    """False on ranks 1..N-1 of an island: rank 0 publishes for the island."""

    def delta_to_host(self, learner: Learner, fragment: int, out: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
        if not self.publishes:
            return None
        # Computed where the model lives, into one flat buffer that reaches the host in one copy.
        return fragment_delta_to_host(learner.bases[fragment], learner.plan.select(learner.params, fragment), out=out)

    def adopt(self, learner: Learner, fragment: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        base = align_fragment(learner.params, tensors, counters=learner.counters, fragment=fragment, version=version)
        learner.bases[fragment] = flat_fragment_to_device(base, learner.device)

    def inner_state(self, learner: Learner, *, snapshot: bool) -> dict[str, torch.Tensor]:
        return local_inner_state(learner.model, learner.opt, snapshot=snapshot, moments=learner.save_moments)

    def broadcast(self, learner: Learner, fragments: list[int]) -> None:
        import torch.distributed as dist

        with torch.no_grad():
            for p in fragments:
                for name in learner.plan.fragments[p]:
                    dist.broadcast(learner.params[name].data, src=0)


# -- the learner ---------------------------------------------------------------------------------
class Learner:
    """One learner's DiLoCo state around a model and an optimizer that its driver trains:
    :meth:`record_step` (count, and publish the due fragment), :meth:`adopt` and :meth:`save`.

    ``outbox``: how contributions are written (:class:`~atoll.train.publisher.Outbox`: in the
    step; :class:`~atoll.train.publisher.BackgroundOutbox`: on a thread), made once the learner is
    built. ``weights``: where the weights live (:class:`Replica` unless an island says otherwise).
    ``loop``: how the driver trains, for the join line of the log (None: a user's loop).
    """

    def __init__(self, store: LearnerStore, learner_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 *, log: Callable[[str], None] = print, lockstep: bool | None = None, incarnation: int = 0,
                 start_round: int | None = None, outbox: Callable[[LearnerStore], Outbox] = Outbox,
                 weights: Weights | None = None, loop: str | None = None) -> None:
        self.store, self.learner_id, self.log = store, learner_id, log
        self.incarnation = incarnation
        """The lease incarnation every contribution carries (0: no lease)."""
        self.publish_guard: Callable[[], bool] | None = None
        """Called right before each publish; False skips it (the learner was fenced)."""
        self.config, self.plan, self.recipe = store.config, store.plan, load_recipe(store)
        self.index, self.spec = self.recipe.learner(learner_id)
        self.lockstep = lockstep if lockstep is not None else (
            self.config.min_quorum == self.config.num_learners and self.config.num_fragments == 1)
        self.summary = LearnerSummary(learner_id=learner_id, incarnation=incarnation)
        self.weights: Weights = weights if weights is not None else Replica()
        self.data_cursor: Callable[[], dict[str, Any] | None] = lambda: None
        """The driver's data position, saved with the inner state (atoll's own loop: its batch stream)."""
        self.step_ema: float | None = None
        self.progress_extra: Callable[[], str] | None = None
        """More for each progress line (atoll's own loop: tokens/s, MFU, peak memory; ``train.speed``)."""
        self.speed_report: Callable[[], dict[str, float]] | None = None
        """Tokens/s, MFU and peak memory since the previous publish, for each contribution's
        ``info["speed"]`` (``atoll status`` shows the newest per learner; ``train.speed``)."""
        self.up_since = time.monotonic()
        """When this process' learner came up: its contributions report how long ago (``info.up_s``)."""
        self.train_s = 0.0
        """Seconds this process spent in inner steps (``info.train_s``; goodput, docs/prefect.md)."""
        self.pending: list[tuple[int, int, int]] = []  # lock-step: (due step, fragment, base version)
        self.exit_reason = ""
        self.exit_detail = ""

        self._check_model(model)
        self.opt = optimizer
        self._load_global_state(start_round)
        self._load_inner_state()
        self.outbox = outbox(store)
        self.model.train()
        log(f"{learner_id}: {'rejoined' if self.summary.resumed_inner_state else 'joined'} at round "
            f"{self.start_round}, step {self.step_count}, pool {self.spec.pool}, {loop or f'user loop, device {self.device}'}")

    def _check_model(self, model: torch.nn.Module) -> None:
        """Take the model (the module under a DDP or compiled wrapper holds the named parameters)
        and check it against the run's fragment plan."""
        inner = getattr(model, "module", None)
        self.model: torch.nn.Module = inner if isinstance(inner, torch.nn.Module) else model
        self.device = next(self.model.parameters()).device
        self.params = dict(self.model.named_parameters())
        if set(self.params) != set(self.plan.sizes):
            diff = sorted(set(self.params) ^ set(self.plan.sizes))[:5]
            raise ValueError(f"model parameters do not match the run's fragment plan: {diff} (the run was "
                             "created from a different model definition)")
        for name, param in self.params.items():
            if param.numel() != self.plan.sizes[name]:
                raise ValueError(f"parameter {name} has {param.numel()} elements but the run's fragment plan has "
                                 f"{self.plan.sizes[name]} (the run was created from a different model)")

    def _load_global_state(self, start_round: int | None) -> None:
        """Overwrite the model with the global state of ``start_round`` (default: the latest), as
        learners hold it: with a compressed downlink, each fragment's published view (the only
        time a learner reads the whole state; no outer momentum)."""
        self.start_round = self.store.latest_round() if start_round is None else start_round
        self.summary.started_from_round = self.start_round
        state = self.store.read_global_state(self.start_round, momentum=False, view=True)
        self.joined_views = set(range(self.plan.num_fragments)) - set(state.restored)
        """Fragments joined at their published view (with a compressed downlink, the start of the
        fetcher's update chains); one whose view did not read was joined at the master."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state.params[name])
        self.versions = list(state.versions)
        self.bases: list[dict[str, torch.Tensor]] = [flat_fragment_to_device(self.plan.select(state.params, p), self.device)
                      for p in range(self.plan.num_fragments)]
        self.counters = LearnerCounters.fresh(self.plan.num_fragments)
        self.marks = PublishMarks(self.plan.num_fragments)
        self.keeps_progress = self.config.keep_local_progress and isinstance(self.weights, Replica)
        """Carry unpublished progress through an adoption (FSDP2 shards overwrite)."""
        self.carried: dict[int, dict[str, torch.Tensor]] = {}
        """With ``kept_progress_into='delta'``: per fragment, progress kept through adoptions that
        its next contribution adds to its delta."""
        for frag, v in enumerate(self.versions):
            self.counters.fragments[frag].base_version = v

    def _load_inner_state(self) -> None:
        """Load this learner's own saved inner state, if it has one: that is rejoin."""
        self.step_count, self.tokens_total = 0, 0
        self.user_state: dict[str, Any] = {}
        """What the driver saves with the inner state (``LearnerHook.user_state``: a user loop's
        data position, scheduler step, ...), JSON only."""
        self.saved_cursor: dict[str, Any] | None = None
        """The data cursor saved with the inner state that was loaded (None: none)."""
        try:
            saved = self.store.load_learner_state(self.learner_id)
        except InvalidInput as e:
            # Its payload is gone or damaged (a storage fault, or retention's min_age_s passed while
            # this learner was frozen between its payload and its state.json): rejoin from the
            # global state with fresh inner state rather than not at all.
            self.log(f"{self.learner_id}: saved inner state unreadable ({e}); rejoining with fresh optimizer state")
            self.summary.inner_state_lost = str(e)
            return
        if saved is None:
            return
        load_inner_state(saved.tensors, self.model, self.opt)
        self.step_count = int(saved.meta.get("step", 0))
        self.tokens_total = int(saved.meta.get("tokens", 0))
        cursor = saved.meta.get("cursor")
        self.saved_cursor = cursor if isinstance(cursor, dict) else None
        self.user_state = dict(saved.meta.get("user") or {})
        self.summary.resumed_inner_state = True

    # -- after each optimizer step ------------------------------------------------------------------
    def record_step(self, n_tokens: int, *, loss: float | None = None, step_time_s: float | None = None) -> None:
        """After one inner step (atoll's own, or a user loop's optimizer step): count it, then
        publish the fragment that is due (if any). This is the one place that does so.

        ``n_tokens`` are the tokens the whole island trained on in this step; ``loss`` is for the
        contribution's info and progress lines only.
        """
        self.check_writes()
        self._count(n_tokens, loss, step_time_s)
        p = self.plan.fragment_at(self.step_count)
        if p is not None and self.counters.fragments[p].c_steps > 0 and publish_due(
                self.counters.fragments[p].c_steps, self.config.inner_steps):
            self.publish(p)

    def check_writes(self) -> None:
        """Raise here, loudly, a background write that failed."""
        self.outbox.check()

    def _count(self, n_tokens: int, loss: float | None, step_time_s: float | None) -> None:
        self.step_count += 1
        self.counters.record_step(n_tokens)
        self.tokens_total += n_tokens
        s = self.summary
        s.steps += 1
        s.tokens += n_tokens
        s.last_loss = float("nan") if loss is None else float(loss)
        s.losses.append(s.last_loss)
        if len(s.losses) >= 2 * LOSS_WINDOW:
            del s.losses[:-LOSS_WINDOW]
        if step_time_s is not None:
            self.step_ema = step_time_s if self.step_ema is None else 0.9 * self.step_ema + 0.1 * step_time_s
            self.train_s += max(0.0, step_time_s)

    def publish(self, p: int) -> None:
        """Publish fragment ``p`` against the version last aligned to, with its counters."""
        fc = self.counters.fragments[p]
        loss = self.summary.last_loss
        info = {"step": self.step_count, "step_time_s": round(self.step_ema or 0.0, 6), "pool": self.spec.pool,
                "loss": round(loss, 6) if math.isfinite(loss) else None, "wire": self.wire_report(),
                "train_s": round(self.train_s, 3), "up_s": round(time.monotonic() - self.up_since, 3)}
        if self.speed_report is not None:
            info["speed"] = self.speed_report()
        if fc.kept_steps:  # keep_local_progress: steps carried through the last adoption
            info["kept_steps"] = fc.kept_steps
        outgoing = Outgoing(self.learner_id, p, fc.base_version, fc.frozen(), info, self.incarnation,
                            self.plan.fragment_numel(p))
        if self.keeps_progress:  # every rank of an island, so that all of them carry the same
            self.marks.mark(p, self.plan.select(self.params, p), fc)
        delta = functools.partial(self.weights.delta_to_host, self, p)
        carried = self.carried.pop(p, None)
        if carried is not None:
            delta = functools.partial(_with_carried, delta, carried)
        if not self.outbox.publish(outgoing, delta, guard=self.publish_guard):
            return  # fenced, or another rank of the island publishes
        self.summary.published += 1
        if self.lockstep:
            self.pending.append((self.step_count + self.config.overlap_steps, p, fc.base_version))

    def wire_report(self) -> dict[str, Any]:
        """What this learner has sent and fetched so far, for its contributions' ``info["wire"]``:
        the requests and bytes of its object store since it was opened (every thread of the
        process: publisher, fetcher, heartbeats) and the tokens trained meanwhile."""
        store = self.store.store
        return wire_report(store.wire_counts(), tokens=self.summary.tokens, meter=store.wire.id)

    # -- new global versions ------------------------------------------------------------------------
    def run_progress(self) -> float | None:
        """The run's progress in [0, 1] for the lr schedule: newest round adopted / max_rounds.

        None under ``schedule="steps"`` (the learner's own step counter drives the cosine)."""
        if self.recipe.inner.schedule != "run":
            return None
        return min(1.0, max(self.versions) / self.recipe.max_rounds)

    def held_views(self) -> dict[int, dict[str, torch.Tensor]] | None:
        """Host copies of the fragments this learner joined at their published view, for the
        fetcher to apply compressed updates to (None: the run's downlink is fp32). Call it before
        the first adopt."""
        if self.config.downlink_compression == "fp32":
            return None
        return {p: {n: t.detach().to("cpu", copy=True) for n, t in self.bases[p].items()} for p in self.joined_views}

    def adopt(self, round_: int, fragment: int, tensors: dict[str, torch.Tensor]) -> bool:
        """Overwrite a fragment with a newer global version (AdamW moments stay); reset its counters
        (with ``keep_local_progress``: plus what no contribution carries yet, and its counters)."""
        if round_ <= self.versions[fragment]:
            return False
        kept = self.marks.unpublished(fragment, self.params, self.bases[fragment],
                                      self.counters.fragments[fragment]) if self.keeps_progress else None
        self.weights.adopt(self, fragment, round_, tensors)
        self.marks.clear(fragment)
        if kept is not None and self.config.kept_progress_into == "delta":
            held = self.carried.setdefault(fragment, {})
            for n, d in kept.progress.items():  # the progress is a new tensor: held as it is
                held[n] = held[n].add_(d) if n in held else d
            carry_counters(self.counters.fragments[fragment], kept)
        elif kept is not None:
            carry(self.params, self.counters.fragments[fragment], kept, share=self.config.kept_progress_share)
        self.versions[fragment] = round_
        self.summary.aligned += 1
        return True

    def waiting_for(self) -> tuple[int, int] | None:
        """Lock-step only: (fragment, base) whose merged version must be adopted before the next step."""
        while self.pending and self.pending[0][0] <= self.step_count:
            _, p, base = self.pending[0]
            if self.versions[p] > base:
                self.pending.pop(0)
                continue
            return p, base
        return None

    # -- the inner state ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for contributions still being written in the background (raises a failed write)."""
        self.outbox.flush()

    @property
    def save_moments(self) -> torch.dtype:
        """The dtype of the saved AdamW moments (``Recipe.save_moments_dtype``)."""
        return torch.bfloat16 if self.recipe.save_moments_dtype == "bf16" else torch.float32

    @property
    def saving(self) -> bool:
        """A periodic save is still being written in the background (the next one is not queued)."""
        return self.outbox.saving

    def save_bytes_estimate(self) -> int:
        """What one save sends before the first one has: AdamW's two moments per parameter."""
        return 2 * sum(self.plan.sizes.values()) * (2 if self.save_moments == torch.bfloat16 else 4)

    def save(self, *, background: bool = False) -> int:
        """Save the inner state (AdamW moments, step counter, data cursor) for rejoin; the bytes
        of its tensors, or 0 when nothing was taken (a background save is still in flight).

        Contributions still being written go first: a saved step never runs ahead of what the
        bucket holds from this learner. ``background=True`` (with a background outbox; the
        periodic saves): snapshot the state here and write it once those contributions are
        written, on a thread of its own, guarded by the lease like them, so the step does not
        wait for the write; while an earlier one is still being written, nothing is taken and
        nothing queued (:mod:`atoll.train.save_pacing`). Otherwise (the last save, on exit)
        write it now, after everything in flight."""
        background = background and self.outbox.background
        if background and self.outbox.saving:
            return 0
        if not background:
            self.flush()
        tensors = moments_as(self.weights.inner_state(self, snapshot=background), self.save_moments)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        meta: dict[str, Any] = {"step": self.step_count, "tokens": self.tokens_total, "cursor": self.data_cursor()}
        if self.user_state:
            meta["user"] = self.user_state
        if background:
            meta = json.loads(json.dumps(meta))  # a snapshot: the loop goes on changing user_state
            learner_id = self.learner_id
            taken = self.outbox.save(lambda store: store.save_learner_state(learner_id, tensors, meta),
                                     guard=self.publish_guard)
            return nbytes if taken else 0
        self.store.save_learner_state(self.learner_id, tensors, meta)
        return nbytes

    def progress_line(self) -> str:
        ms = (self.step_ema or 0.0) * 1000
        return (f"{self.learner_id}: step {self.step_count} loss {self.summary.last_loss:.4f} "
                f"published {self.summary.published} aligned {self.summary.aligned} ({ms:.0f} ms/step"
                f"{self.progress_extra() if self.progress_extra is not None else ''})")


def _with_carried(delta: Callable[[torch.Tensor | None], dict[str, torch.Tensor] | None],
                  carried: dict[str, torch.Tensor], out: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
    """A contribution's delta (base - local) with the progress its fragment carried through
    adoptions (local values gained) taken off: as if the fragment had kept it."""
    got = delta(out)
    if got is not None:
        for n, d in carried.items():
            got[n].sub_(d.to(device=got[n].device, dtype=got[n].dtype))
    return got
