"""A learner's background poller: new commits in the bucket -> prefetched global fragment versions.

The training loop never waits for peers: this thread watches the run's commits and reads every
new global version of a fragment ahead of time, and the loop adopts what is ready between steps
(:meth:`atoll.train.session.LearnerSession.adopt_ready`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from atoll.core.retry import FETCH_RETRY, RetryPolicy
from atoll.storage.bucket import RunStore
from atoll.storage.validation import InvalidInput

__all__ = ["FetchError", "Fetcher"]


class FetchError(RuntimeError):
    """The learner could not read the run's commits for ``FETCH_RETRY.attempts`` polls in a row.

    Raised from the training loop (never swallowed): a learner that cannot see new global
    versions would train on stale state forever, so it fails loudly and orchestration restarts it.
    """


class Fetcher(threading.Thread):
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
                self._poll()
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

    def _poll(self) -> None:
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

    def check(self) -> None:
        """Raise FetchError in the caller's thread if the fetcher gave up."""
        if self.failed is not None:
            raise FetchError(
                f"cannot read the commits of {self.store.url} after {self.retry.attempts} attempts: "
                f"{self.failed!r}; the learner stops so that orchestration restarts it"
            ) from self.failed
