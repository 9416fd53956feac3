"""The per-run context of a training-run process: the one place that holds a run's live state.

A training-run flow run creates one :class:`RunContext` for its run and passes it to every round
flow and task; nothing is cached at module level. It holds:

* ``info``: the run as prepared (URL, id, learners and their pools, max rounds);
* ``options``: the flow run's :class:`~atoll.runs.options.TrainingRunOptions`;
* ``store``: the run's :class:`~atoll.storage.synchronizer_side.SynchronizerStore`;
* the **synchronizer** (current fragments, outer-optimizer state, timing EMAs, last-seen times),
  always reloadable from the bucket: :meth:`RunContext.synchronizer` rebuilds it from the latest
  commit when it is not at the state the caller needs (another synchronizer committed, the round
  flow failed half way, the process restarted);
* ``tracker``: the goodput so far (each contribution record read once);
* ``fleet``: the learner flow runs it launched, with their launch counts and back-off
  (None when the options say learners are managed by hand);
* ``recorder``: the run's :class:`~atoll.tasks.recorder.RoundRecorder`, which writes each
  committed round's artifacts and events from a background thread (off the critical path);
  :meth:`RunContext.round_recorder` makes one on first use;
* ``evaluator``: the run's :class:`~atoll.train.evaluator.Evaluator`, a thread that measures the
  validation loss of committed rounds on its own device (``eval_device``) and time; started by the
  first commit it is told of (:meth:`RunContext.committed`), stopped by :meth:`RunContext.release`.

It holds tensors, so it must never be JSON-encoded or hashed: it has ``__slots__`` and is not a
dataclass, so Prefect stores a flow parameter of this type as the placeholder ``<RunContext>``
(``Flow.serialize_parameters`` cannot encode it and does not try to copy it) and tasks that take
it use ``cache_policy=NO_CACHE``.
"""

from __future__ import annotations

from collections.abc import Callable

from atoll.runs.goodput import GoodputTracker
from atoll.runs.manage import RunInfo
from atoll.runs.options import TrainingRunOptions
from atoll.storage.liveness import SYNCHRONIZER_HOLDER, Lease
from atoll.storage.reader import RunReader
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.tasks.fleet import LearnerFleet
from atoll.tasks.logs import task_logger
from atoll.tasks.recorder import RoundRecorder
from atoll.train.evaluator import Evaluator, EvaluatorOptions
from atoll.train.lease import LeaseKeeper
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions

__all__ = ["RunContext"]

STALL_TIMEOUT_S = 300.0
"""The training-run process heartbeats only if some task asked for the synchronizer this recently."""


class RunContext:
    """One run's live state in the training-run process (see the module docstring)."""

    __slots__ = ("info", "options", "store", "tracker", "fleet", "recorder", "evaluator", "on_landed", "_sync",
                 "_lease", "_keeper")

    def __init__(self, info: RunInfo, options: TrainingRunOptions, *, evaluate: bool = True) -> None:
        """``evaluate=False``: no evaluator in this process (tests, benchmarks)."""
        self.info = info
        self.options = options
        self.store: SynchronizerStore = SynchronizerStore.open(info.run_url, options.storage_options)
        # The recorder's reads are for people: counted apart from the synchronizer's (commit stats.wire).
        self.tracker = GoodputTracker(RunReader.beside(self.store).sibling(metered_apart=True))
        self.fleet: LearnerFleet | None = None
        if options.fleet.manage:
            self.fleet = LearnerFleet(
                run_url=info.run_url, run_id=info.run_id, learners=list(info.learners),
                deployments=dict(options.fleet.deployments), storage_options=options.storage_options,
                learner_parameters=options.fleet.learner_parameters(), policy=options.fleet.policy(),
            )
        self.recorder: RoundRecorder | None = None
        eval_options = EvaluatorOptions(device=options.eval_device)
        self.evaluator: Evaluator | None = None
        if evaluate and eval_options.enabled:
            log = task_logger("atoll.evaluator")  # the training run's logger: a line per evaluation in its logs
            self.evaluator = Evaluator(self.store, options=eval_options, log=log.info)
        self.on_landed: Callable[[RoundSummary], None] | None = None
        """Told of each round the synchronizer's commit pipeline lands, on its thread, as it lands
        (recorded rounds stamp the round's end with it); kept across reloads."""
        self._sync: Synchronizer | None = None
        self._lease: Lease | None = None
        self._keeper: LeaseKeeper | None = None

    def __repr__(self) -> str:
        return f"RunContext(run_id={self.run_id!r}, run_url={self.run_url!r})"

    @property
    def run_id(self) -> str:
        return self.info.run_id

    @property
    def run_url(self) -> str:
        return self.info.run_url

    def synchronizer(self, next_round: int | None = None) -> Synchronizer:
        """The run's synchronizer; (re)built from the bucket if there is none yet, or if it is not
        at the state right before ``next_round`` (given: the caller is about to work on that round)."""
        sync = self._sync
        if sync is None or (next_round is not None and sync.round != next_round - 1):
            sync = self.reload()
        if self._keeper is not None:
            self._keeper.tick(sync.round)  # every task asks for the synchronizer: this process makes progress
        return sync

    def reload(self) -> Synchronizer:
        """Rebuild the synchronizer from the bucket's latest commit (after a failed round); it keeps
        holding this process's synchronizer lease, if one was taken."""
        if self._sync is not None:  # its rounds still in flight are dropped: merged on a state the bucket may not hold
            self._sync.shutdown()
        sync = Synchronizer(self.store, options=SynchronizerOptions(poll_interval_s=self.options.poll_interval_s,
                                                                    device=self.options.merge_device))
        sync.on_landed = self._tell_landed
        if self.evaluator is not None:
            sync.on_state = self.evaluator.offer
        if self._lease is not None:
            sync.hold_lease(lease=self._lease)
        self._sync = sync
        return sync

    def _tell_landed(self, summary: RoundSummary) -> None:
        if self.on_landed is not None:
            self.on_landed(summary)

    def hold_lease(self, flow_run_id: str | None = None) -> Lease:
        """Take the run's next synchronizer lease (fencing any older training run of the run): from
        now on every poll heartbeats in the bucket and checks the stop marker and the fence."""
        sync = self.synchronizer()
        self._lease = sync.hold_lease(flow_run_id)
        # Heartbeats also come from a background thread while the process makes progress (any task
        # asking for the synchronizer within STALL_TIMEOUT_S): starting up, launching learners,
        # merging or evaluating must not look like death to the supervisor. A frozen or killed
        # process stops heartbeating at once; a hung one after STALL_TIMEOUT_S.
        self._keeper = LeaseKeeper(self.store.sibling(), SYNCHRONIZER_HOLDER, self._lease,
                                   interval_s=sync.options.heartbeat_interval_s, stall_timeout_s=STALL_TIMEOUT_S,
                                   log=lambda line: None)
        self._keeper.start()
        return self._lease

    def round_recorder(self, *, progress_artifact_id: str | None = None, run_flow_run_id: object = None,
                       round_run_tags: list[str] | None = None) -> RoundRecorder:
        """The run's round recorder, started on first use (its writer thread runs in a copy of the
        caller's context: call this first from the training run's flow). ``round_run_tags``:
        recorded rounds (the recorder creates each round's flow run, with these tags)."""
        if self.recorder is None:
            self.recorder = RoundRecorder(self.tracker.store, run_id=self.run_id, max_rounds=self.info.max_rounds,
                                          inner_steps=self.store.config.inner_steps,
                                          progress_artifact_id=progress_artifact_id, tracker=self.tracker,
                                          run_flow_run_id=run_flow_run_id, round_run_tags=round_run_tags).start()
        return self.recorder

    def committed(self, round_: int) -> None:
        """Round ``round_`` is committed: the evaluator (started now if it was not) measures it if
        the schedule says so, on its own thread; this returns at once."""
        if self.evaluator is not None:
            self.evaluator.start().committed(round_)

    def finish_evaluation(self) -> None:
        """If the run's last round is committed: wait (bounded by the evaluator's ``final_wait_s``)
        for its validation loss, so the run's summary reports it."""
        sync = self.synchronizer()
        if self.evaluator is not None and sync.finished:
            self.evaluator.start().close(final_round=sync.round)

    def release(self, *, drain: bool = True) -> None:
        """Stop the background heartbeat and the evaluator, and drain the round recorder (the
        training run is ending). ``drain=False``: do not wait for the recorder (a fenced run: its
        successor records)."""
        if self.evaluator is not None:
            self.evaluator.close()
        if self.recorder is not None:
            if drain:
                self.recorder.close()
            else:
                self.recorder.close(timeout_s=0.0)
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        if self._sync is not None:  # a segment drains its rounds first; a fenced one drops them
            self._sync.shutdown()

    @property
    def finished(self) -> bool:
        return self.synchronizer().finished

    @property
    def next_round(self) -> int:
        return self.synchronizer().round + 1

    @property
    def last_round_closed(self) -> bool:
        """The schedule's last round is merged: committed, or handed to the commit pipeline."""
        sync = self.synchronizer()
        return sync.schedule.is_last(sync.round)
