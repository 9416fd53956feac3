"""The life of one learner process around its training loop, whoever drives the steps.

atoll's own loop (:func:`atoll.train.inner.run_learner`) and a user's loop
(:func:`atoll.train.hook.join`) both run inside a :class:`LearnerSession`, through the same
:class:`~atoll.train.hook.LearnerHook`, so there is one implementation of everything but the
inner step. Its life in the bucket (:mod:`atoll.train.lease`): the session first takes the
learner's next lease (fencing any older copy), then builds the :class:`~atoll.train.learner.Learner`
(so it loads the state the old copy left), tags every contribution with its incarnation and
heartbeats while the loop makes progress. It stops when the run is finished or stopped
(``sync/stop.json``), when no commit has appeared for ``orphan_timeout_s``, on SIGTERM (saving
its state first), or, without saving anything, when a newer incarnation fenced it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from atoll.storage.learner_side import LearnerStore
from atoll.train.fetcher import Fetcher
from atoll.train.learner import Learner, LearnerExit, LearnerOptions, LearnerSummary
from atoll.train.lease import LeaseKeeper, sigterm_flag
from atoll.train.publisher import BackgroundOutbox, Outbox
from atoll.train.save_pacing import SavePacer

__all__ = ["Build", "LearnerSession"]

Build = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer, str | None]]
"""What a session builds its learner on: the model, its optimizer, and how the loop trains them."""


class LearnerSession:
    """The life of one learner process around its training loop (see the module docstring):

    * ``__enter__``: SIGTERM becomes a flag; take the learner's next lease (fencing older copies)
      and heartbeat from a background keeper; ``build()`` the model and optimizer the loop trains
      (a user's loop: the ones it brought; atoll's own: from the recipe, once the lease is held, so
      a failure to build them is in the final heartbeat), and the :class:`Learner` on them from the
      bucket (latest global state, the learner's own saved inner state); start the background
      fetcher of new global versions;
    * :meth:`exit_reason_now` before each step: why to stop now, if at all (run finished or
      stopped, orphaned, SIGTERM, fenced, ``max_steps``, the caller's ``should_stop``);
    * after each step (:meth:`Learner.record_step`, which publishes the due fragment):
      :meth:`after_step` adopts new global versions, waits for the merged version in lock-step
      mode, saves when its pacing says so (:mod:`atoll.train.save_pacing`: a byte and time
      budget, or ``save_every_steps``; in the background, never queued) and logs progress;
    * ``__exit__``: stop the fetcher, save the inner state (unless fenced), write the last
      ``exited`` heartbeat with the reason; on an error, the heartbeat names it and it propagates.

    ``build()`` returns the model, its optimizer and how the loop trains them (for the log; None:
    a user's loop).
    """

    def __init__(self, store: LearnerStore, learner_id: str, build: Build, *, options: LearnerOptions | None = None,
                 should_stop: Callable[[], bool] = lambda: False, log: Callable[[str], None] = print) -> None:
        self.store, self.learner_id, self.log = store, learner_id, log
        self.options = options or LearnerOptions()
        self.should_stop = should_stop
        self._build = build
        self._stack = contextlib.ExitStack()
        self._sigterm = threading.Event()
        self.keeper: LeaseKeeper | None = None
        self.fetcher: Fetcher | None = None
        self.learner: Learner | None = None
        self.saves: SavePacer | None = None
        """When the learner saves its inner state (built with the learner)."""
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
        model, optimizer, loop = self._build()
        learner = Learner(store, learner_id, model, optimizer, log=log, lockstep=options.lockstep,
                          incarnation=lease.incarnation if lease is not None else 0, loop=loop,
                          outbox=BackgroundOutbox if options.publish_in_background else Outbox)
        self.learner = learner
        wire = store.store
        self.saves = SavePacer.for_recipe(learner.recipe, uplink_bytes=lambda: wire.wire_counts().bytes_up,
                                          save_bytes=learner.save_bytes_estimate())
        log(f"{learner_id}: {self.saves.describe()}")
        if keeper.lease is not None:
            learner.publish_guard = keeper.still_current  # one LIST per publish: never publish once fenced
        fetcher = Fetcher(store, learner.start_round, options.poll_interval_s, versions=learner.versions,
                          views=learner.held_views(), retry=options.fetch_retry, log=log)
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
        """Overwrite every fragment the fetcher has a newer global version of (its newest)."""
        assert self.fetcher is not None and self.learner is not None
        for version, fragment, values in self.fetcher.take():
            self.learner.adopt(version, fragment, values)

    def after_step(self) -> None:
        """After a step was recorded: adopt new versions; in lock-step mode wait for the merged
        version; save when paced to; log progress."""
        assert self.keeper is not None and self.fetcher is not None and self.learner is not None
        learner, keeper, fetcher = self.learner, self.keeper, self.fetcher
        self.adopt_ready()
        # Lock-step mode only: wait (tau steps after publishing) for the merged version.
        while learner.waiting_for() is not None and self._exit_now() is None:
            keeper.tick()
            fetcher.check()
            time.sleep(0.005)
            self.adopt_ready()
        self._save_if_due()
        if self.options.log_every_steps and learner.step_count % self.options.log_every_steps == 0:
            self.log(learner.progress_line())

    def _save_if_due(self) -> None:
        """Save the inner state when the pacing says so (:mod:`atoll.train.save_pacing`): in the
        background, never queued behind a save still being written."""
        assert self.keeper is not None and self.learner is not None and self.saves is not None
        learner, keeper = self.learner, self.keeper
        if keeper.exit_reason == "fenced" or not self.saves.due(learner.step_count, in_flight=learner.saving):
            return
        if learner.outbox.background:
            self.saves.started(learner.save(background=True))  # the lease is asked right before the write
        elif keeper.still_current():
            self.saves.started(learner.save())

    # -- leaving --------------------------------------------------------------------------------
    def _stop_fetcher(self) -> None:
        if self.fetcher is not None:
            self.fetcher.stop.set()
            self.fetcher.join(timeout=5)

    def _fail(self, e: BaseException) -> None:
        try:
            self._stop_fetcher()
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
        self._stop_fetcher()
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
                 f"({s.published} published, {s.aligned} aligned{self._saves_note()})")
        return isinstance(exc, LearnerExit)

    def _saves_note(self) -> str:
        saves = self.saves
        if saves is None or not (saves.saves or saves.skipped):
            return ""
        return (f", {saves.saves} periodic saves of {saves.saved_bytes / 2**20:,.1f} MiB"
                + (f", {saves.skipped} skipped while one was being written" if saves.skipped else ""))

    @property
    def summary(self) -> LearnerSummary:
        assert self.learner is not None
        return self.learner.summary
