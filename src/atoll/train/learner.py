"""The learner loop: one island training on its own data, publishing fragment deltas on schedule.

Read top to bottom, this is the whole of what a learner does:

1. Rebuild the model and its data shard from the run's recipe in the bucket; start from the
   latest committed global state, and from its own last saved inner state if it has one (AdamW
   moments, step counter, data cursor): that is rejoin.
2. Each inner step: AdamW, warmup on the learner's own steps then cosine over the run's progress
   (rounds adopted / max_rounds); count steps and tokens for every fragment.
3. After step t, if the schedule says fragment p is due (t mod H == t_p), publish
   ``delta = Theta_p(base) - theta_p`` with the counters since the last alignment.
4. A background thread watches the bucket for new commits and prefetches new global fragment
   versions; the loop adopts each one by overwriting its local fragment in place (AdamW moments
   are kept) and resetting that fragment's counters. It never waits for peers. Only in lock-step
   mode (K = M: the round cannot close without every learner) does it wait, tau steps after
   publishing, for the version that merges its contribution: that is synchronous DiLoCo.
5. Every ``save_every_steps`` it saves its inner state for rejoin; it stops once the run has
   committed its last round.

Its life in the bucket (:mod:`atoll.train.lease`): :func:`run_learner` first takes the
learner's next lease (fencing any older copy), then builds the learner (so it loads the state the
old copy left), tags every contribution with its incarnation and heartbeats while the loop makes
progress. It exits by itself when the run is finished or stopped (``sync/stop.json``), when no
commit has appeared for ``orphan_timeout_s``, on SIGTERM (saving its state first), or, without
saving anything, when a newer incarnation fenced it.

Model, batches and AdamW state live on the learner's device (``LearnerSpec.device`` or the
launch's ``device``; ``auto``: CUDA, then MPS, then CPU), optionally with a bf16 autocast of the
forward pass; bases and deltas stay fp32, and each publish moves its delta to the host in one copy.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from atoll.core.align import LearnerCounters, align_fragment
from atoll.core.pseudograd import check_same_layout, learner_delta
from atoll.core.retry import FETCH_RETRY, RetryPolicy
from atoll.storage.bucket import RunStore
from atoll.storage.validation import InvalidInput
from atoll.train.data import BatchStream
from atoll.train.device import autocast as autocast_context
from atoll.train.device import (
    check_autocast,
    flat_fragment_to_device,
    fragment_delta_to_host,
    fragment_to_host,
    resolve_device,
)
from atoll.train.lease import LeaseKeeper, sigterm_flag
from atoll.train.model import loss_fn
from atoll.train.recipe import lr_at_step
from atoll.train.run import load_recipe

__all__ = ["FetchError", "Learner", "LearnerExit", "LearnerOptions", "LearnerSession", "LearnerSummary",
           "STALLED_PUBLISHES", "publish_due", "run_learner"]


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
    """Where to train: 'auto', 'cpu', 'cuda', 'cuda:N', 'mps' (None: the recipe's LearnerSpec.device)."""

    autocast: str | None = None
    """'' (off) or 'bf16' autocast of the inner forward pass (None: the recipe's LearnerSpec.autocast)."""

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


class _Publisher(threading.Thread):
    """Background writer of a learner's contributions and saves: one at a time, in the order
    submitted (so a save never lands before the contributions submitted ahead of it).

    The training loop hands over jobs on host tensors and snapshots (nothing it mutates later);
    this thread encodes, hashes and writes them. The queue is bounded (backpressure when the
    bucket is slower than training); the first failure is kept and re-raised in the training
    thread by :meth:`check` (from the next submit or flush), and nothing after it is written.
    """

    def __init__(self, store: RunStore, *, depth: int = 2) -> None:
        super().__init__(daemon=True, name="atoll-publisher")
        self.store = store.sibling()  # own caches; the object store itself is shared
        self.jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=depth)
        self.failed: BaseException | None = None

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                # The guard (the lease is still ours) is asked right before the write, as in the step.
                if self.failed is None and (job.guard is None or job.guard()):
                    job.write(self.store)
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by check()
                self.failed = e
            finally:
                if job is not None and job.done is not None:
                    job.done()
                self.jobs.task_done()

    def submit(self, write: Callable[[RunStore], Any], *, guard: Callable[[], bool] | None = None,
               done: Callable[[], None] | None = None) -> None:
        """Queue ``write(store)``; ``done()`` runs after it, written or not (returns buffers)."""
        self.check()
        self.jobs.put(_Job(write, guard, done))

    def flush(self) -> None:
        """Wait until everything submitted is written (or failed); raise the failure."""
        self.jobs.join()
        self.check()

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed


@dataclass(frozen=True)
class _Job:
    write: Callable[[RunStore], Any]
    guard: Callable[[], bool] | None
    done: Callable[[], None] | None


class IslandLink(Protocol):
    """What rank 0 of an island (:mod:`atoll.train.island`) adds to :func:`run_learner`'s loop."""

    world: int
    """Ranks of the island."""

    def attach(self, learner: Learner) -> None:
        """Once, after the learner is built (wraps its model for DDP)."""

    def before_step(self, learner: Learner) -> None:
        """Before every step: the other ranks learn to take it, with what rank 0 adopted since."""

    def finish(self, learner: Learner, *, clean: bool) -> None:
        """When the loop ends, for any reason: the other ranks stop. ``clean``: the loop ended
        without an error (rank 0 may save next: a sharded island gathers its state first)."""


class FetchError(RuntimeError):
    """The learner could not read the run's commits for ``FETCH_RETRY.attempts`` polls in a row.

    Raised from the training loop (never swallowed): a learner that cannot see new global
    versions would train on stale state forever, so it fails loudly and orchestration restarts it.
    """


class _Fetcher(threading.Thread):
    """Background poller: new commits -> prefetched fragment versions on a queue.

    A failed poll is logged and counted, and retried with backoff (``retry``); after the last
    attempt the fetcher stops and sets ``failed``, which the training loop raises as FetchError.
    """

    def __init__(self, store: RunStore, after_round: int, poll_interval_s: float, *,
                 retry: RetryPolicy = FETCH_RETRY, log: Callable[[str], None] = print) -> None:
        super().__init__(daemon=True, name="atoll-fetcher")
        self.store = store.sibling()  # own caches; the object store itself is shared
        self.after = after_round
        self.poll_interval_s = poll_interval_s
        self.retry = retry
        self.log = log
        self.ready: queue.Queue[tuple[int, int, dict[str, torch.Tensor]]] = queue.Queue()
        self.latest_round = after_round
        self.stop = threading.Event()
        self.errors = 0
        """Failed polls since the fetcher started (for progress lines)."""
        self.failed: BaseException | None = None
        """Set once the retry policy is exhausted; the fetcher has stopped."""

    def run(self) -> None:
        failures = 0
        while not self.stop.is_set():
            try:
                for rec in self.store.poll_commits(self.after):
                    if rec.updated:
                        try:
                            values = self.store.read_global_fragment(rec.fragment, rec.round)
                        except InvalidInput as e:  # that version's object is unreadable: skip it
                            self.log(f"fetcher: round {rec.round}'s fragment {rec.fragment} is unreadable "
                                     f"({e}); keeping the current version")
                        else:
                            self.ready.put((rec.round, rec.fragment, values))
                    self.after = self.latest_round = rec.round
                failures = 0
            except Exception as e:  # noqa: BLE001 - counted, logged and bounded below
                failures += 1
                self.errors += 1
                if self.retry.exhausted(failures):
                    self.log(f"fetcher: giving up after {failures} failed polls of {self.store.url}: {e!r}")
                    self.failed = e
                    return
                delay = self.retry.delay_s(failures - 1)
                self.log(f"fetcher: poll {failures} of {self.retry.attempts} failed ({e!r}); retrying in {delay:.1f}s")
                self.stop.wait(delay)
                continue
            self.stop.wait(self.poll_interval_s)

    def check(self) -> None:
        """Raise FetchError in the caller's thread if the fetcher gave up."""
        if self.failed is not None:
            raise FetchError(
                f"cannot read the commits of {self.store.url} after {self.retry.attempts} attempts: "
                f"{self.failed!r}; the learner stops so that orchestration restarts it"
            ) from self.failed


def inner_state_tensors(states: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Optimizer state by parameter name -> the saved layout: ``adamw.<name>.<key>`` tensors, fp32,
    on the host (any optimizer: the prefix is historical; tensors and numbers, nothing pickled).

    The layout does not depend on how the island was sharded: a DDP island can rejoin as FSDP2
    and back."""
    tensors: dict[str, torch.Tensor] = {}
    for name, st in states.items():
        for key, value in (st or {}).items():
            if key == "step" or not isinstance(value, torch.Tensor):
                if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
                    continue  # not a number (e.g. a flag): the optimizer rebuilds it
                tensors[f"adamw.{name}.{key}"] = torch.as_tensor(value, dtype=torch.float32).reshape(1).cpu()
            else:
                tensors[f"adamw.{name}.{key}"] = value.detach().float().contiguous().cpu()
    return tensors


def _local_inner_state(model: torch.nn.Module, opt: torch.optim.Optimizer, *,
                       snapshot: bool = False) -> dict[str, torch.Tensor]:
    """The optimizer's state in the saved layout; ``snapshot``: copies that the next optimizer
    step will not change (on the CPU the saved layout otherwise shares the state's memory)."""
    states = {name: opt.state.get(p, {}) for name, p in model.named_parameters()}
    tensors = inner_state_tensors(states)
    if snapshot:
        live = {v.data_ptr() for st in states.values() for v in (st or {}).values() if isinstance(v, torch.Tensor)}
        tensors = {k: t.clone() if t.data_ptr() in live else t for k, t in tensors.items()}
    return tensors


class _BufferPool:
    """Host buffers for deltas being written in the background, by size: taken in the training
    thread, given back by the publisher once the delta is written (thread-safe: deque ops)."""

    def __init__(self) -> None:
        self._free: dict[int, collections.deque[torch.Tensor]] = collections.defaultdict(collections.deque)

    def take(self, numel: int) -> torch.Tensor | None:
        try:
            return self._free[numel].popleft()
        except IndexError:
            return None  # the caller allocates a new one, which comes back here after its write

    def give(self, buffer: torch.Tensor) -> None:
        self._free[buffer.numel()].append(buffer)


def _load_inner_state(tensors: dict[str, torch.Tensor], model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for name, p in model.named_parameters():
        prefix = f"adamw.{name}."
        keys = [k for k in tensors if k.startswith(prefix) and "." not in k[len(prefix):]]
        if not keys:
            continue
        state: dict[str, Any] = {}
        for k in keys:
            key, value = k[len(prefix):], tensors[k]
            if key == "step":  # AdamW keeps it as a 0-dim float tensor (on the host unless fused/capturable)
                device = p.device if opt.defaults.get("fused") or opt.defaults.get("capturable") else "cpu"
                state[key] = value.reshape(()).to(device).clone()
            elif value.numel() == p.numel():
                state[key] = value.to(p.device, p.dtype).reshape(p.shape).clone()
            else:  # a per-parameter scalar or other shape: as saved
                state[key] = value.to(p.device).clone()
        opt.state[p] = state


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


class Learner:
    """One learner's state and its three moves: :meth:`step`, :meth:`adopt` and :meth:`save`.

    :func:`run_learner` drives it in real time with a background fetcher; the virtual-clock
    driver in :mod:`atoll.train.virtual` drives the very same object step by step.
    """

    def __init__(self, store: RunStore, learner_id: str, *, log: Callable[[str], None] = print,
                 lockstep: bool | None = None, incarnation: int = 0, device: str | None = None,
                 autocast: str | None = None, publish_in_background: bool = False, rank: int = 0,
                 world: int = 1, start_round: int | None = None, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
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

        # Where it trains: the launch's setting (flow parameter / LearnerOptions) or the recipe's.
        knob = "device (LearnerOptions.device, the learner flow's `device` parameter)" if device is not None else f"LearnerSpec.device of {learner_id}"
        self.device = resolve_device(device if device is not None else self.spec.device, knob=knob)
        self.autocast = check_autocast(autocast if autocast is not None else self.spec.autocast)

        # 1. Model, data shard, global state, own inner state (all on self.device).
        # A user's training loop (atoll.train.hook.join) brings its own model and optimizer, and
        # its own data: then there is no batch stream, and the user's lr schedule is left alone.
        self.user_loop = model is not None
        if model is not None:
            # A DDP/compiled wrapper trains; the module underneath holds the named parameters.
            inner = getattr(model, "module", None)
            self.model = inner if isinstance(inner, torch.nn.Module) else model
            self.device = next(self.model.parameters()).device
        else:
            self.model = self.recipe.model_factory()().to(self.device)
        # An island of ``world`` ranks (atoll.train.island): this is rank ``rank``; the island
        # wraps ``forward_model`` in DDP, every rank trains on its slice of the island's batch and
        # only rank 0 publishes.
        self.rank, self.world = rank, world
        self.forward_model: torch.nn.Module = model if model is not None else self.model
        self.sharded = False
        """An FSDP2 island: parameters, bases and AdamW state are DTensor shards; publishing gathers
        the due fragment's delta on every rank, and adopted fragments wait in ``unwritten`` until
        the ranks write them into their shards together (atoll.train.island)."""
        self.unwritten: dict[int, dict[str, torch.Tensor]] = {}
        """Sharded only: fragments adopted by rank 0 and not yet written into the shards."""
        self.gather_inner_state: Callable[[], dict[str, torch.Tensor]] | None = None
        """Sharded only (rank 0): the island's full AdamW state in the saved layout (collective)."""
        self.params = dict(self.model.named_parameters())
        if set(self.params) != set(self.plan.sizes):
            diff = sorted(set(self.params) ^ set(self.plan.sizes))[:5]
            raise ValueError(f"model parameters do not match the run's fragment plan: {diff} (the run was "
                             "created from a different model definition)")
        for name, param in self.params.items():
            if param.numel() != self.plan.sizes[name]:
                raise ValueError(f"parameter {name} has {param.numel()} elements but the run's fragment plan has "
                                 f"{self.plan.sizes[name]} (the run was created from a different model)")
        self.stream: BatchStream | None = None
        if not self.user_loop:
            context = self.recipe.context_for(self.model)
            self.stream = BatchStream(self.recipe.data.corpus().train, context_tokens=context,
                                      learner_index=self.index, num_learners=self.config.num_learners,
                                      seed=self.recipe.data.seed, interleave=self.recipe.data.shard == "interleaved")
        self.start_round = store.latest_round() if start_round is None else start_round
        state = store.read_global_state(self.start_round)
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state.params[name])
        self.versions = list(state.versions)
        self.bases: list[dict[str, torch.Tensor]] = [
            flat_fragment_to_device(self.plan.select(state.params, p), self.device)
            for p in range(self.plan.num_fragments)]
        self.counters = LearnerCounters.fresh(self.plan.num_fragments)
        for frag, v in enumerate(self.versions):
            self.counters.fragments[frag].base_version = v
        self.opt = optimizer if optimizer is not None else self.recipe.inner.make(self.model.parameters())
        self.step_count, self.tokens_total = 0, 0
        try:
            saved = store.load_learner_state(learner_id)
        except InvalidInput as e:
            # Its payload is gone or damaged (a storage fault, or retention's min_age_s passed while
            # this learner was frozen between its payload and its state.json): rejoin from the
            # global state with fresh inner state rather than not at all.
            self.log(f"{learner_id}: saved inner state unreadable ({e}); rejoining with fresh optimizer state")
            self.summary.inner_state_lost = str(e)
            saved = None
        if saved is not None:
            _load_inner_state(saved.tensors, self.model, self.opt)
            self.step_count = int(saved.meta.get("step", 0))
            self.tokens_total = int(saved.meta.get("tokens", 0))
            if self.stream is not None and isinstance(saved.meta.get("cursor"), dict):
                self.stream.load_state_dict(saved.meta["cursor"])
            self.user_state: dict[str, Any] = dict(saved.meta.get("user") or {})
            """What a user loop saved with the inner state (``LearnerHook.user_state``: its data
            position, scheduler step, ...), JSON only."""
            self.summary.resumed_inner_state = True
        else:
            self.user_state = {}
        self.summary.started_from_round = self.start_round
        self.step_ema: float | None = None
        self.publisher = _Publisher(store) if publish_in_background else None
        self._delta_buffers = _BufferPool()
        if self.publisher is not None:
            self.publisher.start()
        self.pending: list[tuple[int, int, int]] = []  # lock-step: (due step, fragment, base version)
        self.exit_reason = ""
        self.exit_detail = ""
        self.model.train()
        loop = "user loop" if self.user_loop else f"batch {self.spec.batch_size}, slowdown {self.spec.slowdown:g}x"
        log(f"{learner_id}: {'rejoined' if saved else 'joined'} at round {self.start_round}, "
            f"step {self.step_count}, pool {self.spec.pool}, {loop}, "
            f"device {self.device}{' bf16 autocast' if self.autocast else ''}")

    def step(self, *, step_time_s: float | None = None) -> None:
        """One inner step, then publish the fragment that is due (if any).

        ``step_time_s`` overrides the measured step time (the virtual-clock driver); otherwise
        the step is timed, and stretched by the learner's ``slowdown``.
        """
        if self.publisher is not None:
            self.publisher.check()  # a background write failed: stop here, loudly
        if self.stream is None:
            raise RuntimeError("a user-loop learner trains in the user's loop (LearnerHook), not in Learner.step")
        t0 = time.perf_counter()
        step = self.step_count + 1
        # 2. One inner step: warmup on this learner's steps, cosine over the run's progress.
        for group in self.opt.param_groups:
            group["lr"] = lr_at_step(self.recipe.inner, step, self.run_progress())
        b = self.spec.batch_size
        x, y = self.stream.next_batch(b * self.world)  # every rank draws the island's batch ...
        if self.world > 1:  # ... and trains on its own slice of it
            x, y = x[self.rank * b:(self.rank + 1) * b], y[self.rank * b:(self.rank + 1) * b]
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast_context(self.device, self.autocast):
            loss = loss_fn(self.forward_model, x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.recipe.inner.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.inner.grad_clip)
        self.opt.step()
        loss_value = loss.item()
        if step_time_s is None:
            if self.spec.slowdown > 1:  # stand-in for an older chip: stretch the step
                time.sleep((self.spec.slowdown - 1) * (time.perf_counter() - t0))
            step_time_s = time.perf_counter() - t0
        self.record_step(int(x.numel()) * self.world, loss=loss_value, step_time_s=step_time_s)  # the island's tokens

    def record_step(self, n_tokens: int, *, loss: float | None = None, step_time_s: float | None = None) -> None:
        """After one inner step (atoll's own, or a user loop's optimizer step): count it, then
        publish the fragment that is due (if any). This is the one place that does so.

        ``n_tokens`` are the tokens the whole island trained on in this step; ``loss`` is for the
        contribution's info and progress lines only.
        """
        if self.publisher is not None:
            self.publisher.check()  # a background write failed: stop here, loudly
        self.step_count += 1
        step = self.step_count
        self.counters.record_step(n_tokens)
        self.tokens_total += n_tokens
        self.summary.steps += 1
        self.summary.tokens += n_tokens
        self.summary.last_loss = float("nan") if loss is None else float(loss)
        self.summary.losses.append(self.summary.last_loss)
        if len(self.summary.losses) >= 2 * LOSS_WINDOW:
            del self.summary.losses[:-LOSS_WINDOW]
        if step_time_s is not None:
            self.step_ema = step_time_s if self.step_ema is None else 0.9 * self.step_ema + 0.1 * step_time_s

        # 3. Publish the fragment that is due, against the version we last aligned to.
        p = self.plan.fragment_at(step)
        if p is not None and (self.rank == 0 or self.sharded) and self.counters.fragments[p].c_steps > 0 and publish_due(
                self.counters.fragments[p].c_steps, self.config.inner_steps):
            fc = self.counters.fragments[p]
            loss_now = self.summary.last_loss
            # The delta is computed where the model lives, into one flat buffer that reaches the
            # host in one copy.
            buffer: torch.Tensor | None = None
            if self.sharded:  # each rank holds a shard of the delta: every rank gathers (collective)
                shards = learner_delta(self.bases[p], self.plan.select(self.params, p))
                gathered = {n: d.full_tensor() for n, d in shards.items()}  # type: ignore[attr-defined]
                if self.rank != 0:
                    return
                delta = fragment_to_host(gathered)
            else:
                # Into a reused host buffer when writing in the background: a fresh one each
                # publish costs page faults in the training thread (a third of the publish there).
                if self.publisher is not None:
                    numel = self.plan.fragment_numel(p)
                    buffer = self._delta_buffers.take(numel)
                    if buffer is None:
                        buffer = torch.empty(numel, dtype=torch.float32)
                delta = fragment_delta_to_host(self.bases[p], self.plan.select(self.params, p), out=buffer)
            info = {"step": step, "step_time_s": round(self.step_ema or 0.0, 6), "pool": self.spec.pool,
                    "loss": round(loss_now, 6) if math.isfinite(loss_now) else None}
            if self.publisher is not None:  # written in the background (the guard is asked right before)
                args = (self.learner_id, p, fc.base_version, fc.frozen(), delta)
                incarnation = self.incarnation
                done = functools.partial(self._delta_buffers.give, buffer) if buffer is not None else None
                self.publisher.submit(lambda store: store.publish_contribution(*args, info=info, incarnation=incarnation),
                                      guard=self.publish_guard, done=done)
            elif self.publish_guard is None or self.publish_guard():
                self.store.publish_contribution(self.learner_id, p, fc.base_version, fc, delta, info=info,
                                                incarnation=self.incarnation)
            else:
                return  # fenced: nothing published
            self.summary.published += 1
            if self.lockstep:
                self.pending.append((step + self.config.overlap_steps, p, fc.base_version))

    def run_progress(self) -> float | None:
        """The run's progress in [0, 1] for the lr schedule: newest round adopted / max_rounds.

        None under ``schedule="steps"`` (the learner's own step counter drives the cosine)."""
        if self.recipe.inner.schedule != "run":
            return None
        return min(1.0, max(self.versions) / self.recipe.max_rounds)

    def adopt(self, round_: int, fragment: int, tensors: dict[str, torch.Tensor]) -> bool:
        """4. Overwrite a fragment with a newer global version (AdamW moments stay); reset its counters."""
        if round_ <= self.versions[fragment]:
            return False
        if self.sharded:  # written into every rank's shards before the next step (atoll.train.island)
            check_same_layout(self.plan.select(self.params, fragment), tensors, what=f"global fragment {fragment}")
            self.unwritten[fragment] = dict(tensors)
            self.counters.reset(fragment, round_)
            self.versions[fragment] = round_
            self.summary.aligned += 1
            return True
        base = align_fragment(self.params, tensors, counters=self.counters, fragment=fragment, version=round_)
        self.bases[fragment] = flat_fragment_to_device(base, self.device)
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

    def flush(self) -> None:
        """Wait for contributions still being written in the background (raises a failed write)."""
        if self.publisher is not None:
            self.publisher.flush()

    def save(self, *, background: bool = False) -> None:
        """5. Save the inner state (AdamW moments, step counter, data cursor) for rejoin.

        Contributions still being written go first: a saved step never runs ahead of what the
        bucket holds from this learner. ``background=True`` (with a background publisher; the
        periodic saves): snapshot the state here and write it after those contributions on the
        publisher's thread, guarded by the lease like them, so the step does not wait for the
        write; otherwise (the last save, on exit) write it now."""
        background = background and self.publisher is not None
        if not background:
            self.flush()
        tensors = self.gather_inner_state() if self.gather_inner_state is not None else \
            _local_inner_state(self.model, self.opt, snapshot=background)
        meta: dict[str, Any] = {"step": self.step_count, "tokens": self.tokens_total,
                                "cursor": self.stream.state_dict() if self.stream is not None else None}
        if self.user_state:
            meta["user"] = self.user_state
        if background:
            assert self.publisher is not None
            meta = json.loads(json.dumps(meta))  # a snapshot: the loop goes on changing user_state
            learner_id = self.learner_id
            self.publisher.submit(lambda store: store.save_learner_state(learner_id, tensors, meta),
                                  guard=self.publish_guard)
            return
        self.store.save_learner_state(self.learner_id, tensors, meta)

    def progress_line(self) -> str:
        ms = (self.step_ema or 0.0) * 1000
        return (f"{self.learner_id}: step {self.step_count} loss {self.summary.last_loss:.4f} "
                f"published {self.summary.published} aligned {self.summary.aligned} ({ms:.0f} ms/step)")


class LearnerSession:
    """The life of one learner process around its training loop, whoever drives the steps.

    atoll's own loop (:func:`run_learner`) and a user's loop (:func:`atoll.train.hook.join`) both
    run inside one of these, so there is one implementation of everything but the inner step:

    * ``__enter__``: SIGTERM becomes a flag; take the learner's next lease (fencing older copies)
      and heartbeat from a background keeper; build the :class:`Learner` from the bucket (latest
      global state, the learner's own saved inner state); start the background fetcher of new
      global versions;
    * :meth:`exit_reason_now` before each step: why to stop now, if at all (run finished or
      stopped, orphaned, SIGTERM, fenced, ``max_steps``, the caller's ``should_stop``);
    * after each step (:meth:`Learner.step` or, for a user loop, :meth:`Learner.record_step`,
      which publish the due fragment): :meth:`after_step` adopts new global versions, waits for
      the merged version in lock-step mode, saves on schedule and logs progress;
    * ``__exit__``: stop the fetcher, save the inner state (unless fenced), write the last
      ``exited`` heartbeat with the reason; on an error, the heartbeat names it and it propagates.
    """

    def __init__(self, store: RunStore, learner_id: str, *, options: LearnerOptions | None = None,
                 should_stop: Callable[[], bool] = lambda: False, log: Callable[[str], None] = print,
                 link: IslandLink | None = None, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, world: int | None = None) -> None:
        self.store, self.learner_id, self.log = store, learner_id, log
        self.options = options or LearnerOptions()
        self.should_stop, self.link = should_stop, link
        self._model, self._optimizer = model, optimizer
        self._world = world if world is not None else (link.world if link is not None else 1)
        self._stack = contextlib.ExitStack()
        self._sigterm = threading.Event()
        self.keeper: LeaseKeeper | None = None
        self.fetcher: _Fetcher | None = None
        self.learner: Learner | None = None
        self.reason: str | None = None
        """Why the loop stopped (set by exit_reason_now, or by the caller before leaving)."""

    # -- entering -------------------------------------------------------------------------------
    def __enter__(self) -> LearnerSession:
        options = self.options
        if options.threads:
            torch.set_num_threads(options.threads)
        # The handler goes in first: a SIGTERM while the lease is being taken is not lost either.
        self._stack.enter_context(sigterm_flag(self._on_sigterm, enabled=options.handle_sigterm))
        try:
            self._start()
        except BaseException as e:
            self._fail(e)
            raise
        return self

    def _on_sigterm(self) -> None:  # a signal handler: set flags, nothing else
        self._sigterm.set()
        if self.keeper is not None:
            self.keeper.request_exit("sigterm", "SIGTERM received")

    def _start(self) -> None:
        store, learner_id, options, log = self.store, self.learner_id, self.options, self.log
        lease = store.take_learner_lease(learner_id, flow_run_id=options.flow_run_id) if options.take_lease else None
        if lease is not None:
            store.write_heartbeat(lease, reason="starting")
            log(f"{learner_id}: took lease incarnation {lease.incarnation} (pid {lease.pid} on {lease.host})")
        keeper = LeaseKeeper(store.sibling(), learner_id, lease, interval_s=options.heartbeat_interval_s,
                             stall_timeout_s=options.stall_timeout_s, orphan_timeout_s=options.orphan_timeout_s,
                             log=log)
        self.keeper = keeper
        if self._sigterm.is_set():
            keeper.request_exit("sigterm", "SIGTERM received")
        keeper.start()
        learner = Learner(store, learner_id, log=log, lockstep=options.lockstep,
                          incarnation=lease.incarnation if lease is not None else 0,
                          device=options.device, autocast=options.autocast,
                          publish_in_background=options.publish_in_background, world=self._world,
                          model=self._model, optimizer=self._optimizer)
        self.learner = learner
        if self.link is not None:
            self.link.attach(learner)
        if keeper.lease is not None:
            learner.publish_guard = keeper.still_current  # one LIST per publish: never publish once fenced
        fetcher = _Fetcher(store, learner.start_round, options.poll_interval_s, retry=options.fetch_retry, log=log)
        self.fetcher = fetcher
        keeper.latest_round = lambda: fetcher.latest_round
        fetcher.start()

    # -- around each step -----------------------------------------------------------------------
    @property
    def run_finished(self) -> bool:
        assert self.fetcher is not None and self.learner is not None
        return self.fetcher.latest_round >= self.learner.recipe.max_rounds

    def _exit_now(self) -> str | None:
        assert self.keeper is not None
        if self.keeper.exit_reason is not None:
            return self.keeper.exit_reason
        if self.should_stop():
            return "should_stop"
        if self.run_finished:
            return "finished"
        return None

    def exit_reason_now(self) -> str | None:
        """Before a step: why this learner stops now (and remember it), or None to train on.

        Heartbeats the loop's progress; raises FetchError if the fetcher gave up."""
        assert self.keeper is not None and self.fetcher is not None and self.learner is not None
        learner = self.learner
        self.keeper.tick(learner.step_count)
        if (reason := self._exit_now()) is not None:
            self.reason = reason
            return reason
        self.fetcher.check()
        if self.options.max_steps is not None and learner.summary.steps >= self.options.max_steps:
            self.reason = "max_steps"
            return self.reason
        return None

    def adopt_ready(self) -> None:
        """Overwrite every fragment the fetcher has a newer global version of."""
        assert self.fetcher is not None and self.learner is not None
        while True:
            try:
                self.learner.adopt(*self.fetcher.ready.get_nowait())
            except queue.Empty:
                return

    def after_step(self) -> None:
        """After a step was recorded: adopt new versions; in lock-step mode wait for the merged
        version; save on schedule; log progress."""
        assert self.keeper is not None and self.fetcher is not None and self.learner is not None
        learner, keeper, fetcher = self.learner, self.keeper, self.fetcher
        self.adopt_ready()
        # Lock-step mode only: wait (tau steps after publishing) for the merged version.
        while learner.waiting_for() is not None and self._exit_now() is None:
            keeper.tick()
            fetcher.check()
            time.sleep(0.005)
            self.adopt_ready()
        save_every = learner.recipe.save_every_steps
        if save_every and learner.step_count % save_every == 0 and keeper.exit_reason != "fenced":
            if learner.publisher is not None:
                learner.save(background=True)  # the lease is asked right before the write, there
            elif keeper.still_current():
                learner.save()
        if self.options.log_every_steps and learner.step_count % self.options.log_every_steps == 0:
            self.log(learner.progress_line())

    # -- leaving --------------------------------------------------------------------------------
    def _stop_threads(self, *, clean: bool) -> None:
        if self.link is not None and self.learner is not None:  # the other ranks stop with rank 0
            self.link.finish(self.learner, clean=clean)
        if self.fetcher is not None:
            self.fetcher.stop.set()
            self.fetcher.join(timeout=5)

    def _fail(self, e: BaseException) -> None:
        try:
            self._stop_threads(clean=False)
        finally:
            if self.keeper is not None:
                self.keeper.close()
                self.keeper.final_heartbeat(f"error: {type(e).__name__}: {e}")
            self._stack.close()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and not isinstance(exc, LearnerExit):
            self._fail(exc)
            return False
        assert self.keeper is not None and self.learner is not None and self.fetcher is not None
        learner, keeper = self.learner, self.keeper
        self._stop_threads(clean=True)
        reason = self.reason or (exc.reason if isinstance(exc, LearnerExit) else "should_stop")
        details = {"finished": f"finished: round {self.fetcher.latest_round} of {learner.recipe.max_rounds} committed",
                   "max_steps": f"max_steps: {self.options.max_steps} steps done",
                   "should_stop": "should_stop: asked to stop by the caller"}
        learner.exit_reason = reason
        learner.exit_detail = (keeper.exit_detail if reason == keeper.exit_reason
                               else details.get(reason, reason)) or reason
        keeper.close()
        s = learner.summary
        s.exit_reason, s.exit_detail = learner.exit_reason, learner.exit_detail
        try:
            if s.exit_reason != "fenced" and keeper.still_current():
                learner.save()
        except BaseException as e:
            keeper.final_heartbeat(f"error: {type(e).__name__}: {e}")
            self._stack.close()
            raise
        if keeper.fenced:  # seen at any point, even while saving: report it as the reason
            s.exit_reason, s.exit_detail = "fenced", f"fenced by incarnation {keeper.fenced_by}"
        keeper.final_heartbeat(s.exit_detail)
        self._stack.close()
        self.log(f"{self.learner_id}: exited ({s.exit_detail}) at step {learner.step_count} "
                 f"({s.published} published, {s.aligned} aligned)")
        return isinstance(exc, LearnerExit)

    @property
    def summary(self) -> LearnerSummary:
        assert self.learner is not None
        return self.learner.summary


class LearnerExit(Exception):
    """Raised out of a user's training loop (from the optimizer step) when the learner must stop:
    the run is finished or stopped, SIGTERM, orphaned or fenced. The ``with`` block of
    :func:`atoll.train.hook.join` catches it after saving (unless fenced)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def run_learner(
    store: RunStore,
    learner_id: str,
    *,
    options: LearnerOptions | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
    link: IslandLink | None = None,
) -> LearnerSummary:
    """Train as learner ``learner_id`` of the run in ``store`` until it is time to exit.

    Takes the learner's next lease first (unless ``options.take_lease`` is False), then builds the
    learner from the bucket. Returns a summary whose ``exit_reason`` says why it stopped:
    "finished", "stopped", "orphaned", "sigterm", "max_steps", "should_stop" (inner state saved,
    final heartbeat ``exited``) or "fenced" (a newer copy holds the lease: nothing saved, nothing
    published after the fence was seen). Raises FetchError (and any other error) after a final
    ``exited`` heartbeat naming it.

    The loop is atoll's own inner step inside a :class:`LearnerSession`, the same session a
    user's training loop runs in (:func:`atoll.train.hook.join`).
    """
    with LearnerSession(store, learner_id, options=options, should_stop=should_stop, log=log, link=link) as session:
        learner = session.learner
        assert learner is not None
        while session.exit_reason_now() is None:
            if link is not None:  # an island's rank 0: the other ranks take this step too
                link.before_step(learner)
            learner.step()
            session.after_step()
    return session.summary
