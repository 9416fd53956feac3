"""A learner's background poller: new commits in the bucket -> the newest global version of each fragment.

The training loop never waits for peers: this thread watches the run's commits and reads new
global versions ahead of time, and the loop adopts what is ready between steps
(:meth:`atoll.train.session.LearnerSession.adopt_ready`). It downloads only what will be used:

* of the versions one poll finds, only the newest of each fragment is read (adopting a version
  overwrites the fragment, so an older one would be overwritten unseen);
* a version read but not adopted yet is replaced by a newer one, never queued behind it;
* with a compressed downlink (``DilocoConfig.downlink_compression``) the learner holds each
  fragment's *view* (:mod:`atoll.core.downlink`), and brings it forward by applying the chain of
  compressed updates it missed when that is fewer bytes than rebuilding the newest view from its
  snapshot (the newest version at or below it that publishes its view whole, then the updates
  after it: :meth:`~atoll.storage.reader.RunReader.view_chain`), else by that rebuild. An update
  that does not read is skipped with its reason (:attr:`Follower.skipped`) and the view is
  rebuilt from its snapshot; a view that does not rebuild falls back to the fp32 master (within
  one quantization error of it), and the next version is then rebuilt in full. Nothing here
  raises for a bad object: the learner keeps its current version.

The whole state is read only when a learner joins or rejoins
(:meth:`atoll.storage.reader.RunReader.read_global_state` with ``view=True``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import torch

from atoll.core.downlink import apply_update
from atoll.core.retry import FETCH_RETRY, RetryPolicy
from atoll.storage.reader import RunReader
from atoll.storage.records import CommitRecord
from atoll.storage.validation import InvalidInput, StorageError, TransientStorageError

__all__ = ["FetchError", "Fetcher", "Follower"]

Tensors = dict[str, torch.Tensor]


class FetchError(RuntimeError):
    """The learner could not read the run's commits for ``FETCH_RETRY.attempts`` polls in a row.

    Raised from the training loop (never swallowed): a learner that cannot see new global
    versions would train on stale state forever, so it fails loudly and orchestration restarts it.
    """


SKIPPED_KEPT = 100
"""How many skip reasons a follower keeps (the newest)."""


class Follower:
    """What a learner holds of each fragment, and how to bring it to a newer version with the
    fewest bytes (the module docstring says how). One thread advances it."""

    def __init__(self, store: RunReader, versions: list[int] | tuple[int, ...],
                 views: Mapping[int, Mapping[str, torch.Tensor]] | None = None, *,
                 log: Callable[[str], None] = print) -> None:
        self.store, self.log = store, log
        self.versions = list(versions)
        """Per fragment, the version the learner holds once it adopts what was handed over."""
        self.views: dict[int, Tensors] = {p: dict(v) for p, v in (views or {}).items()}
        """Fragments whose held version's published view is held here exactly (a compressed
        downlink; the learner adopted a copy of it): the start of a chain of updates."""
        self.reads: Counter[str] = Counter()
        """Fragment objects read, by kind: 'master' (fp32), 'view' (fp32: a snapshot) and 'update'
        (compressed; those that rebuild a view from its snapshot included)."""
        self.skipped: list[str] = []
        """Why an object was not used (unreadable update, view or master), newest last."""

    def advance(self, records: list[CommitRecord]) -> Iterator[tuple[int, int, Tensors]]:
        """(version, fragment, values): the newest version of each fragment the commit records
        give a newer version of, as the learner holds it. Each is final once yielded; a storage
        error raised midway leaves the fragments not yet yielded as they were."""
        new: dict[int, list[int]] = {}
        for rec in records:
            if rec.updated and rec.round > self.versions[rec.fragment]:
                new.setdefault(rec.fragment, []).append(rec.round)
        for p, versions in sorted(new.items()):
            try:
                values = self._bring(p, versions)
            except TransientStorageError:
                raise  # the store is unwell: the poll is retried
            except (StorageError, ValueError) as e:  # a void slot, a pruned or non-regular object
                self._skip(f"fragment {p} v{versions[-1]}: unreadable ({type(e).__name__}: {str(e)[:300]}); "
                           f"keeping v{self.versions[p]} until its next version")
                continue
            if values is not None:
                self.versions[p] = versions[-1]
                yield versions[-1], p, values

    def _skip(self, why: str) -> None:
        self.log(f"fetcher: {why}")
        self.skipped.append(why)
        del self.skipped[:-SKIPPED_KEPT]

    def _bring(self, p: int, versions: list[int]) -> Tensors | None:
        """Fragment ``p`` at ``versions[-1]`` (the versions after the held one, oldest first)."""
        newest = versions[-1]
        dl = self.store.fragment_state(p, newest).downlink
        if dl is None:  # learners hold the fp32 master
            return self._master(p, newest)
        try:
            chain = self.store.view_chain(p, newest)  # its snapshot and the updates after it
        except InvalidInput as e:
            self._skip(f"fragment {p} v{newest}: view unreadable ({e}); using the fp32 master")
            return self._master(p, newest)
        if self._chain_bytes(p, versions) < chain.nbytes:
            view = self.views[p]
            for v in versions:
                try:
                    view = apply_update(view, self.store.read_fragment_update(p, v)[1])
                except InvalidInput as e:
                    self._skip(f"fragment {p} v{v}: downlink update unreadable ({e}); reading v{newest}'s view")
                    break
                self.reads["update"] += 1
            else:
                self.views[p] = view
                return view
        try:
            view = self.store.read_fragment_view(p, newest, chain=chain)
        except InvalidInput as e:
            self._skip(f"fragment {p} v{newest}: view unreadable ({e}); using the fp32 master")
            return self._master(p, newest)
        self.reads["view"] += 1
        self.reads["update"] += len(chain.updates)
        self.views[p] = view
        return view

    def _chain_bytes(self, p: int, versions: list[int]) -> float:
        """Bytes of the compressed updates from the held view to ``versions[-1]``; infinite when
        there is no unbroken chain (no exact view held, a version missing, no update published)."""
        if p not in self.views:
            return float("inf")
        total, base = 0, self.versions[p]
        for v in versions:
            dl = self.store.fragment_state(p, v).downlink
            if dl is None or dl.update is None or dl.base != base:
                return float("inf")
            total, base = total + dl.update.nbytes, v
        return total

    def _master(self, p: int, version: int) -> Tensors | None:
        try:
            values = self.store.read_global_fragment(p, version)
        except InvalidInput as e:  # that version's object is unreadable: skip it
            self._skip(f"round {version}'s fragment {p} is unreadable ({e}); keeping the current version")
            return None
        self.reads["master"] += 1
        self.views.pop(p, None)  # what the learner holds now is not a published view
        return values


class Fetcher(threading.Thread):
    """Background poller: new commits -> the newest version of each fragment, ready to adopt
    (:meth:`take`); a version not taken yet is replaced by a newer one.

    ``versions``: what the learner holds of each fragment; ``views``: the fragments it holds as
    their published view, as host tensors (a compressed downlink: the start of update chains).
    A failed poll is logged and counted, and retried with backoff (``retry``); after the last
    attempt the fetcher stops and sets ``failed``, which the training loop raises as FetchError.
    """

    def __init__(self, store: RunReader, after_round: int, poll_interval_s: float, *,
                 versions: list[int] | tuple[int, ...], views: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
                 retry: RetryPolicy = FETCH_RETRY, log: Callable[[str], None] = print) -> None:
        super().__init__(daemon=True, name="atoll-fetcher")
        self.store = store.sibling()  # own caches; the object store itself is shared
        self.after = after_round
        self.poll_interval_s = poll_interval_s
        self.retry = retry
        self.log = log
        self.follower = Follower(self.store, versions, views, log=log)
        self._ready: dict[int, tuple[int, Tensors]] = {}
        self._lock = threading.Lock()
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
                self.poll_once()
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

    def poll_once(self) -> None:
        """One poll (the thread does one every ``poll_interval_s``): new commits, then the newest
        version of each fragment they give a newer version of, into its slot."""
        records = self.store.poll_commits(self.after)
        for version, p, values in self.follower.advance(records):
            with self._lock:
                self._ready[p] = (version, values)  # a version not adopted yet is replaced
        if records:
            self.after = self.latest_round = records[-1].round

    def take(self) -> list[tuple[int, int, Tensors]]:
        """(version, fragment, values) of every fragment with a newer version ready, oldest
        version first; the slots are empty afterwards."""
        with self._lock:
            ready, self._ready = self._ready, {}
        return sorted(((v, p, values) for p, (v, values) in ready.items()), key=lambda item: (item[0], item[1]))

    @property
    def reads(self) -> Counter[str]:
        """Fragment objects read so far, by kind (:attr:`Follower.reads`)."""
        return self.follower.reads

    def check(self) -> None:
        """Raise FetchError in the caller's thread if the fetcher gave up."""
        if self.failed is not None:
            raise FetchError(
                f"cannot read the commits of {self.store.url} after {self.retry.attempts} attempts: "
                f"{self.failed!r}; the learner stops so that orchestration restarts it"
            ) from self.failed
