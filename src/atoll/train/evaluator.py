"""The evaluator: validation loss of committed rounds, off the round's critical path.

No round waits for evaluation. The evaluator reads what is committed, the commit chain and a
round's global state (:meth:`~atoll.storage.reader.RunReader.read_global_state`, through its own
handle, metered apart from the synchronizer's), evaluates it on its own device under the
recipe's autocast, and writes the loss as that round's **evaluation record**
``sync/evals/<round>.json`` (create-once; docs/protocol.md section 2). ``atoll status``, the round
artifacts and the run's plots read the loss from there, tagged with the round it measured
(:mod:`atoll.runs.losses`; runs from before this record read it from the commit's stats).

**Where it runs.** By default it is a thread of the synchronizer process (:func:`run_synchronizer
<atoll.train.sync_loop.run_synchronizer>` and the training run's
:class:`~atoll.tasks.context.RunContext` start and stop it). A thread needs nothing deployed,
shares the process's bucket credentials and recipe, and hears of each commit at once
(:meth:`Evaluator.committed`, which only sets a number); the forward passes run in torch kernels
that release the GIL, so the synchronizer's loop keeps its pace. On a CPU-only host both share the
cores: ``eval_batches`` bounds what one evaluation costs (below). To move evaluation elsewhere,
turn the thread off (device ``off``) and run ``python -m atoll.train.evaluator <run-url>
--device cuda`` anywhere that holds the synchronizer's grant on ``sync/evals/``: it finds new
commits by polling the bucket. As a Prefect flow run on a GPU pool, a flow whose body calls
:func:`follow_run` is all it takes; the bucket, not the process, carries everything it needs.

**Falling behind.** The evaluator holds one target, never a queue: the newest committed round
that the recipe's schedule evaluates (:meth:`~atoll.train.run.RoundSchedule.newest_evaluated`).
When an evaluation ends and rounds have been committed meanwhile, it skips the scheduled rounds it
missed, straight to the newest, and its log line says how many it skipped.

**Cost.** One evaluation predicts ``min(eval_batches x 16, windows in the split)`` windows of the
recipe's context, the same every time: ``tokens`` in each log line and record. Reading the state
is one fp32 copy of the model from the bucket (with masters by replay, a rebuild of the masters
it names and does not hold), unless the synchronizer of this process offered its own copy of the
round (:meth:`Evaluator.offer`): then it only hashes it against the round's record.

**The end of a run.** :meth:`Evaluator.close` with ``final_round`` waits until that round (the
schedule always evaluates the last) is evaluated, at most ``final_wait_s``, so a run's final
validation loss is in the bucket when the run ends.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from atoll.storage.codec import tensors_sha256
from atoll.storage.records import EvalRecord
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.train.device import check_autocast, resolve_device
from atoll.train.round_stats import RoundSummary
from atoll.train.run import RoundSchedule, load_recipe, make_evaluator

__all__ = ["EvaluatorOptions", "Evaluator", "follow_run", "main"]

Evaluate = Callable[[Mapping[str, torch.Tensor]], float]

OFF = "off"
"""The device setting that runs no evaluator in this process."""


@dataclass(frozen=True, kw_only=True)
class EvaluatorOptions:
    """Where and how often the evaluator runs; nothing here changes what is trained."""

    device: str = "auto"
    """'auto' (CUDA if present, else MPS, else CPU), 'cpu', 'cuda', 'cuda:N', 'mps'; 'off': no
    evaluator in this process (another process evaluates, or nobody)."""

    autocast: str | None = None
    """'' (fp32) or 'bf16' for the forward passes; None: as the recipe's learners train (bf16 when
    every learner autocasts to bf16)."""

    poll_interval_s: float = 5.0
    """When no commit is announced (:meth:`Evaluator.committed`), look in the bucket this often."""

    final_wait_s: float = 300.0
    """Longest the end of a run waits for its last round's evaluation."""

    evaluator_id: str = "synchronizer"
    """Written into every evaluation record (who measured it)."""

    nice: int = 10
    """On Linux, the evaluator thread's niceness (0: as the process): on a busy CPU the rounds' thread
    comes first, and an evaluator that falls behind skips to the newest round."""

    @property
    def enabled(self) -> bool:
        return self.device.strip().lower() != OFF


class Evaluator:
    """Evaluates committed rounds on its own thread (see the module docstring).

    ``evaluate``: measure with this instead of the recipe's model (tests); ``tokens`` is then its cost.
    """

    def __init__(self, store: SynchronizerStore, *, options: EvaluatorOptions | None = None,
                 log: Callable[[str], None] = print, evaluate: Evaluate | None = None, tokens: int = 0) -> None:
        self.options = options or EvaluatorOptions()
        self.store = store.sibling(metered_apart=True)  # its reads are not the rounds' traffic
        self.schedule = RoundSchedule.of(self.store)
        self.log = log
        self._evaluate = evaluate
        self.tokens = tokens
        """Tokens one evaluation predicts."""
        self.device = torch.device("cpu") if evaluate is not None else None
        self._cv = threading.Condition()
        self._known = 0  # the newest committed round it was told of or found
        self._done = 0  # no round up to this one is waiting for it (evaluated, found evaluated, or skipped)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.written: list[EvalRecord] = []
        """The records this evaluator wrote (the newest 100)."""
        self.skipped = 0
        """Scheduled evaluations skipped because a newer round was committed meanwhile."""
        self.failures = 0
        self._offered: tuple[int, dict[str, torch.Tensor]] | None = None
        """(round, a copy of its state) from the synchronizer of this process (:meth:`offer`)."""

    # -- the synchronizer's side: nothing here waits on an evaluation ----------------------
    def committed(self, round_: int) -> None:
        """Round ``round_`` is committed (the newest it knows of; an older number changes nothing)."""
        with self._cv:
            if round_ > self._known:
                self._known = round_
                self._cv.notify_all()

    def offer(self, round_: int, copy: Callable[[], dict[str, torch.Tensor]]) -> None:
        """The synchronizer of this process made round ``round_``'s state (its commit may still be
        in flight): if the schedule evaluates that round, keep ``copy()`` (the whole model), so that
        its evaluation does not read the state from the bucket (with masters by replay, rebuild it),
        once the copy proves to be what the round's record names (every fragment's sha256)."""
        if self.options.enabled and self.schedule.evaluates(round_):
            params = copy()
            with self._cv:
                self._offered = (round_, params)

    def _offered_state(self, round_: int) -> dict[str, torch.Tensor] | None:
        """The offered copy of committed round ``round_``, if every fragment of it hashes to what the
        round's record names (another synchronizer may have won the round); else None."""
        with self._cv:
            offered, self._offered = self._offered, None
        record = self.store.read_commit(round_)
        if offered is None or offered[0] != round_ or record is None:
            return None
        params = offered[1]
        for p, st in enumerate(record.state):
            names = self.store.manifest.fragment_shapes(p)
            if tensors_sha256({n: params[n] for n in names})[0] != st.params.sha256:
                return None
        return params

    def after(self, on_round: Callable[[RoundSummary], None] | None) -> Callable[[RoundSummary], None]:
        """``on_round`` that also announces each committed round to this evaluator, first."""
        def announce(summary: RoundSummary) -> None:
            self.committed(summary.record.round)
            if on_round is not None:
                on_round(summary)
        return announce

    def start(self) -> Evaluator:
        """Start the thread (once; not at all if the recipe never evaluates)."""
        if self._thread is None and self.schedule.evaluate and self.options.enabled:
            self._thread = threading.Thread(target=self._run, name="atoll-evaluator", daemon=True)
            self._thread.start()
        return self

    @property
    def busy(self) -> bool:
        """Whether the thread is still running (building its model, evaluating or waiting)."""
        return self._thread is not None and self._thread.is_alive()

    def evaluated_through(self) -> int:
        """No round up to this one still waits for this evaluator."""
        with self._cv:
            return self._done

    def close(self, *, final_round: int | None = None, join_s: float = 5.0) -> None:
        """Stop the thread. ``final_round`` (the run's last round, committed): first wait until no
        round up to it that the schedule evaluates is left (the last round always is), at most
        ``final_wait_s``. An evaluation in progress is abandoned after ``join_s``
        (the thread is a daemon: it never holds the process)."""
        thread = self._thread
        if thread is None:
            return
        if final_round is not None:
            self.committed(final_round)
            deadline = time.monotonic() + self.options.final_wait_s
            with self._cv:
                while self._left(final_round) and thread.is_alive() and time.monotonic() < deadline:
                    self._cv.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                waited_out = self._left(final_round) and thread.is_alive()
            if waited_out:
                self.log(f"evaluator: round {final_round} not evaluated within {self.options.final_wait_s:g} s; "
                         "the run ends without its final validation loss")
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        thread.join(join_s)
        self._thread = None

    def _left(self, through: int) -> bool:
        """Whether a round up to ``through`` still waits for an evaluation (call holding the lock)."""
        return self.schedule.newest_evaluated(self._done, through)[0] is not None

    # -- the evaluator's thread ------------------------------------------------------------
    def _run(self) -> None:
        self._lower_priority()
        try:
            self._prepare()
        except Exception as e:  # noqa: BLE001 - a model atoll cannot build must not stop the rounds
            self.failures += 1
            self.log(f"evaluator: cannot evaluate this run ({type(e).__name__}: {e}); no validation loss is written")
            with self._cv:
                self._done = sys.maxsize
                self._cv.notify_all()
            return
        while (target := self._next()) is not None:
            if not self._landed(target[0]):
                continue
            self._measure(*target)

    def _landed(self, round_: int) -> bool:
        """Whether round ``round_``'s commit reads in the bucket yet (a round can be announced while
        its record is still being written); if not, wait a moment (or until told of a newer one)."""
        try:
            if self.store.readable_commit(round_) is not None:
                return True
        except Exception as e:  # noqa: BLE001 - a storage hiccup: look again
            self.log(f"evaluator: could not read round {round_}'s commit: {type(e).__name__}: {e}")
        with self._cv:
            self._cv.wait(min(0.05, self.options.poll_interval_s))
        return False

    def _lower_priority(self) -> None:
        """Linux schedules threads one by one: lower this thread's priority only (see ``nice``)."""
        if self.options.nice and sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.options.nice)
            except OSError:  # not permitted here: evaluate at the process's priority
                pass

    def _prepare(self) -> None:
        """Build the recipe's model on the evaluator's device (on this thread: off the round's path)."""
        if self._evaluate is not None:
            return
        recipe = load_recipe(self.store)
        autocast = self.options.autocast
        if autocast is None:
            modes = {check_autocast(s.autocast) for s in recipe.learners}
            autocast = "bf16" if modes == {"bf16"} else ""
        self.device = resolve_device(self.options.device, knob="EvaluatorOptions.device")
        evaluator = make_evaluator(self.store, device=self.device, autocast=check_autocast(autocast))
        self._evaluate, self.tokens = evaluator, evaluator.tokens
        self.log(f"evaluator: on {self.device}{' (bf16 autocast)' if autocast else ''}; "
                 f"{self.tokens:,} tokens per evaluation")

    def _next(self) -> tuple[int, int] | None:
        """(the round to evaluate next, scheduled evaluations skipped to get there); waits for a
        commit, looking in the bucket every ``poll_interval_s``. None once stopping."""
        while True:
            with self._cv:
                if self._stopping:
                    return None
                newest, skipped = self.schedule.newest_evaluated(self._done, self._known)
                if newest is not None:
                    return newest, skipped
                announced = self._cv.wait(self.options.poll_interval_s)
            if not announced:
                self._look_in_bucket()

    def _look_in_bucket(self) -> None:
        try:
            self.committed(self.store.latest_round())
        except Exception as e:  # noqa: BLE001 - the next look may succeed; evaluation is not the rounds' business
            self.failures += 1
            self.log(f"evaluator: could not read the latest round: {type(e).__name__}: {e}")

    def _measure(self, round_: int, skipped: int) -> None:
        """Evaluate committed round ``round_`` and write its record (unless one exists)."""
        behind = self._known - round_
        try:
            if self.store.read_eval(round_) is not None:  # measured already (before a restart, or elsewhere)
                return
            assert self._evaluate is not None and self.device is not None
            t0 = time.monotonic()
            params = self._offered_state(round_)
            if params is None:
                params = self.store.read_global_state(round_, momentum=False).params
            loss = float(self._evaluate(params))
            eval_s = time.monotonic() - t0
            note = (f"; {skipped} scheduled evaluation(s) skipped to catch up" if skipped else "") + (
                f"; {behind} round(s) committed since" if behind else "")
            if not math.isfinite(loss):
                self.failures += 1
                self.log(f"evaluator: round {round_} val_loss {loss} (not finite: no record written){note}")
                return
            record = EvalRecord(round=round_, val_loss=round(loss, 6), tokens=self.tokens, eval_s=round(eval_s, 4),
                                device=str(self.device), evaluated_at=time.time(), by=self.options.evaluator_id)
            if self.store.write_eval(record):
                self.written = [*self.written[-99:], record]
            self.log(f"evaluator: round {round_} val_loss={loss:.4f} ({self.tokens:,} tokens on {self.device}, "
                     f"{eval_s:.2f} s){note}")
        except Exception as e:  # noqa: BLE001 - one failed evaluation (a pruned state, a storage error) is skipped
            self.failures += 1
            self.log(f"evaluator: round {round_} not evaluated: {type(e).__name__}: {e}")
        finally:
            with self._cv:
                self.skipped += skipped
                self._done = max(self._done, round_)
                self._cv.notify_all()


def follow_run(store: SynchronizerStore, *, options: EvaluatorOptions | None = None,
               should_stop: Callable[[], bool] = lambda: False, log: Callable[[str], None] = print) -> int:
    """Evaluate a run from a process of its own until its last round is evaluated (or
    ``should_stop()``): new commits are found by polling the bucket. Returns the newest round
    it has no evaluation left to do for."""
    options = options or EvaluatorOptions()
    evaluator = Evaluator(store, options=options, log=log).start()
    last = evaluator.schedule.max_rounds
    try:
        while evaluator.busy and not should_stop():
            if last is not None and evaluator.evaluated_through() >= last:
                break
            time.sleep(min(1.0, options.poll_interval_s))
    finally:
        evaluator.close()
    return min(evaluator.evaluated_through(), store.latest_round())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atoll.train.evaluator",
                                     description="Evaluate a run's committed rounds from a process of its own.")
    parser.add_argument("url", help="the run's URL")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda[:N], mps")
    parser.add_argument("--autocast", default=None, help="'' or bf16 (default: as the recipe's learners)")
    parser.add_argument("--poll-interval-s", type=float, default=EvaluatorOptions().poll_interval_s)
    parser.add_argument("--id", default="evaluator", help="written into every evaluation record")
    args = parser.parse_args(argv)
    options = EvaluatorOptions(device=args.device, autocast=args.autocast, poll_interval_s=args.poll_interval_s,
                               evaluator_id=args.id)
    follow_run(SynchronizerStore.open(args.url), options=options, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
