"""Pipelined rounds (atoll.train.commit_pipeline): the synchronizer killed between any two steps of
a round's commit resumes to the round an uninterrupted run would, with bit-identical state.

A kill is simulated in-process: at the chosen step every write of the killed synchronizer's handle
blocks for good (its threads never write again, as after SIGKILL), and a new synchronizer on a
fresh handle resumes from the bucket. Contributions are published deterministically per round (a
seeded delta per learner and round, counters at H so no trust bound clips them), once each, so an
uninterrupted run and a killed-and-resumed one merge exactly the same inputs.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from atoll.core.compress import DecodeBuffers, encoded_nbytes
from atoll.core.downlink import downlink_step as core_downlink_step
from atoll.core.weights import Counters
from atoll.storage import LearnerStore, RunReader, SynchronizerStore
from atoll.storage import paths as P
from atoll.train import synchronizer as synchronizer_module
from atoll.train.recipe import smoke_recipe
from atoll.train.run import TokenBounds, create_run
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions

ROUNDS = 8
SYNC_BLOBS = P.blob_key("0" * 64).rsplit("/", 1)[0]
KILL_ROUND = 4
LEARNERS = ("learner-0", "learner-1")


class Killed(BaseException):
    """What a killed synchronizer's blocked writes raise when the test ends (nothing is written)."""


@dataclass
class Run:
    url: str
    options: dict[str, Any] | None
    tokens_per_step: int
    published: set[int] = field(default_factory=set)

    def sync_store(self) -> SynchronizerStore:
        return SynchronizerStore.open(self.url, self.options)

    def publish(self, learners: LearnerStore, round_: int, fragment: int, base: int) -> None:
        """Round ``round_``'s inputs: one seeded delta per learner, published once per run."""
        if round_ in self.published:
            return
        self.published.add(round_)
        shapes = learners.manifest.fragment_shapes(fragment)
        for i, lid in enumerate(LEARNERS):
            gen = torch.Generator().manual_seed(1000 * round_ + i)
            delta = {n: 1e-3 * torch.randn(s, generator=gen) for n, s in shapes.items()}
            learners.publish_contribution(lid, fragment, base, Counters(c_steps=2, c_tokens=2 * self.tokens_per_step),
                                          delta, info={"step_time_s": 1.0})


def new_run(base_url: str, options: dict[str, Any] | None, masters: int = 1) -> Run:
    config, recipe = smoke_recipe(len(LEARNERS), max_rounds=1000)
    url = P.join_url(base_url, f"run-{uuid.uuid4().hex[:8]}")
    create_run(url, config.replace(initial_grace_s=0.0, downlink_compression="int4", master_snapshot_every=masters),
               recipe, storage_options=options)
    bounds = TokenBounds.of_recipe(recipe)
    assert bounds is not None
    return Run(url, options, bounds.of(LEARNERS[0]))


def drive(run: Run, sync: Synchronizer, until: int, *, stop: threading.Event | None = None) -> None:
    """Publish each round's inputs and step the pipelined loop until round ``until`` has landed."""
    learners = LearnerStore.open(run.url, run.options)
    now = [0.0]
    sync.clock = lambda: now[0]
    landed = sync.round
    while landed < until and not (stop is not None and stop.is_set()):
        if not sync.schedule.is_last(sync.round) and sync.round < until:
            r = sync.round + 1
            p = sync.fragment_of_round(r)
            run.publish(learners, r, p, sync.versions[p])
        now[0] += 10.0
        summaries, _ = sync.step() if sync.round < until else (sync.drain(), None)
        for s in summaries:
            assert isinstance(s, RoundSummary) and s.won and s.record.updated, s.line()
            assert len(s.record.accepted) == len(LEARNERS), s.line()
            landed = s.record.round


def state_of(url: str, options: dict[str, Any] | None, round_: int) -> dict[str, torch.Tensor]:
    reader = RunReader.open(url, options)
    st = reader.read_global_state(round_)
    out = {f"param.{n}": t for n, t in st.params.items()}
    out.update({f"momentum.{p}.{n}": t for p, m in st.momentum.items() for n, t in m.items()})
    views = reader.read_global_state(round_, momentum=False, view=True)
    out.update({f"view.{n}": t for n, t in views.params.items()})
    return out


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class KillSwitch:
    """Wraps one synchronizer handle: ``arm(point)`` picks where the kill happens; once killed,
    every write of the handle blocks until :meth:`release` (then raises :class:`Killed`)."""

    def __init__(self, store: SynchronizerStore) -> None:
        self.killed = threading.Event()
        self._released = threading.Event()
        self.record_landed: dict[int, threading.Event] = {}
        self.payloads_written: dict[int, threading.Event] = {}
        obj = store.store
        for name in ("put", "create"):
            setattr(obj, name, self._guard(getattr(obj, name), name))
        self._commit, self._payloads = store.commit_round, store.write_round_payloads
        store.commit_round = self._commit_round  # type: ignore[method-assign]
        store.write_round_payloads = self._write_payloads  # type: ignore[method-assign]
        self.before_commit: Callable[[int], None] = lambda r: None
        self.before_payloads: Callable[[int], None] = lambda r: None
        self.on_put: Callable[[str], None] = lambda key: None

    def kill(self) -> None:
        self.killed.set()
        self._block()

    def _block(self) -> None:
        self._released.wait()
        raise Killed

    def release(self) -> None:
        self._released.set()

    def _guard(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def guarded(key: str, *args: Any, **kwargs: Any) -> Any:
            if self.killed.is_set():
                self._block()
            out = fn(key, *args, **kwargs)
            self.on_put(key)
            return out
        return guarded

    def _commit_round(self, round_: int, *args: Any, **kwargs: Any) -> Any:
        self.before_commit(round_)
        out = self._commit(round_, *args, **kwargs)
        self.record_landed.setdefault(round_, threading.Event()).set()
        return out

    def _write_payloads(self, round_: int, *args: Any, **kwargs: Any) -> Any:
        self.before_payloads(round_)
        out = self._payloads(round_, *args, **kwargs)
        self.payloads_written.setdefault(round_, threading.Event()).set()
        return out

    def event(self, table: dict[int, threading.Event], round_: int) -> threading.Event:
        return table.setdefault(round_, threading.Event())


def arm(switch: KillSwitch, point: str) -> int:
    """Arm the kill at ``point`` around round K = KILL_ROUND; the round the bucket then ends at."""
    k = KILL_ROUND
    if point == "payloads-written-record-not":
        switch.before_commit = lambda r: switch.kill() if r == k else None
        return k - 1
    if point == "next-payloads-written-record-not":  # K + 1's payloads land while K's record waits
        def hold(r: int) -> None:
            if r == k:
                assert switch.event(switch.payloads_written, k + 1).wait(30)
                switch.kill()
        switch.before_commit = hold
        return k - 1
    if point == "record-written-next-payloads-in-flight":
        def wait_for_record(r: int) -> None:
            if r == k + 1:
                assert switch.event(switch.record_landed, k).wait(30)
                switch.on_put = lambda key: switch.kill() if key.startswith(SYNC_BLOBS) else None  # one blob, then
        switch.before_payloads = wait_for_record
        return k
    if point == "some-payloads-written":  # one of K's blobs is written, then the kill
        def after_record(r: int) -> None:
            if r == k:
                assert switch.event(switch.record_landed, k - 1).wait(30)
                switch.on_put = lambda key: switch.kill() if key.startswith(SYNC_BLOBS) else None
        switch.before_payloads = after_record
        return k - 1
    if point == "record-written-head-not":
        switch.on_put = lambda key: switch.kill() if key == P.commit_key(k) else None
        return k
    raise ValueError(point)


POINTS = ["payloads-written-record-not", "next-payloads-written-record-not", "record-written-next-payloads-in-flight",
          "some-payloads-written", "record-written-head-not"]


def killed_and_resumed(base_url: str, options: dict[str, Any] | None, point: str, masters: int = 1) -> str:
    reference = new_run(base_url, options, masters)
    drive(reference, Synchronizer(reference.sync_store(), options=SynchronizerOptions(live_timeout_s=1e9)), ROUNDS)

    run = new_run(base_url, options, masters)
    store = run.sync_store()
    switch = KillSwitch(store)
    expected = arm(switch, point)
    doomed = Synchronizer(store, options=SynchronizerOptions(live_timeout_s=1e9))
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            drive(run, doomed, ROUNDS, stop=stop)
        except Killed:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        assert switch.killed.wait(60), "the kill point was never reached"
        stop.set()
        resumed = Synchronizer(run.sync_store(), options=SynchronizerOptions(live_timeout_s=1e9))
        assert resumed.round == expected, (point, resumed.round)
        assert_identical(state_of(run.url, options, expected), state_of(reference.url, options, expected))
        drive(run, resumed, ROUNDS)
        resumed.shutdown()
    finally:
        switch.release()
        thread.join(30)
    assert not errors, errors
    assert_identical(state_of(run.url, options, ROUNDS), state_of(reference.url, options, ROUNDS))
    ref, got = RunReader.open(reference.url, options), RunReader.open(run.url, options)
    assert got.latest_round() == ref.latest_round() == ROUNDS
    for r in range(1, ROUNDS + 1):
        a, b = ref.read_commit(r), got.read_commit(r)
        assert a is not None and b is not None
        assert [x.key.rsplit("/", 1)[-1] for x in a.accepted] != [] and b.versions == a.versions
        assert [(x.learner_id, x.weight) for x in a.accepted] == [(x.learner_id, x.weight) for x in b.accepted]
    return run.url


@pytest.mark.parametrize("point", POINTS)
def test_a_synchronizer_killed_between_steps_resumes_bit_identical_on_a_local_store(tmp_path, point: str) -> None:
    killed_and_resumed(str(tmp_path), None, point)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    import moto_s3

    with moto_s3.serving("atoll-test") as endpoint:
        yield endpoint


@pytest.mark.parametrize("point", ["next-payloads-written-record-not", "record-written-next-payloads-in-flight"])
def test_a_synchronizer_killed_between_steps_resumes_bit_identical_on_s3(moto_endpoint: str, point: str) -> None:
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"}}
    killed_and_resumed(f"s3://atoll-test/{uuid.uuid4().hex[:8]}", options, point)


@pytest.mark.parametrize("point", POINTS)
def test_a_synchronizer_killed_between_steps_resumes_bit_identical_with_masters_by_replay(tmp_path, point: str) -> None:
    # M = 4: at round K = 4 both fragments stand at depth 2 (versions 3 and 4 name their masters,
    # write none), so the resumed synchronizer rebuilds them by replay.
    url = killed_and_resumed(str(tmp_path), None, point, masters=4)
    assert [st.master_depth for st in RunReader.open(url).read_commit(KILL_ROUND).state] == [2, 2]


def test_masters_by_replay_survive_a_kill_on_s3(moto_endpoint: str) -> None:
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"}}
    killed_and_resumed(f"s3://atoll-test/{uuid.uuid4().hex[:8]}", options, "next-payloads-written-record-not", masters=4)


def test_pipelined_and_sequential_runs_commit_the_same_state(tmp_path, monkeypatch) -> None:
    encoded_on: list[str] = []  # the thread that encoded each round's downlink update
    update_bytes: list[int] = []  # and the update's tensor bytes

    def downlink_step(*args: Any, **kwargs: Any) -> Any:
        encoded_on.append(threading.current_thread().name)
        step = core_downlink_step(*args, **kwargs)
        update_bytes.append(sum(encoded_nbytes(e) for e in step.update.values()))
        return step

    taken: dict[int, list[list[int]]] = defaultdict(list)  # by pool, each take: where its tensors lie
    real_take = DecodeBuffers.take

    def take(self: DecodeBuffers, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        out = real_take(self, *args, **kwargs)
        taken[id(self)].append([t.data_ptr() for t in out.values()])
        return out

    monkeypatch.setattr(synchronizer_module, "downlink_step", downlink_step)
    monkeypatch.setattr(DecodeBuffers, "take", take)
    piped, plain = new_run(str(tmp_path), None), new_run(str(tmp_path), None)
    pipelined = Synchronizer(piped.sync_store(), options=SynchronizerOptions(live_timeout_s=1e9))
    drive(piped, pipelined, ROUNDS)
    # Pipelined: off the loop's thread, by the payload writers (beside the next round's merge).
    assert len(encoded_on) == ROUNDS and all(name.startswith("atoll-payloads") for name in encoded_on), encoded_on
    encoded_on.clear()
    # Contributions are decoded into buffers given back after each merge: a round's decodes reuse
    # the ones before (at most the tensors of the round that took the most at once stay).
    decoded_into = [ptr for take in taken[id(pipelined.merger.decoded)] for ptr in take]
    assert len(set(decoded_into)) <= len(decoded_into) // ROUNDS * 2 < len(decoded_into), decoded_into
    # New versions and momentum copies go into what earlier rounds retired: once the first rounds
    # have retired theirs, a round takes no fresh tensor (the last two rounds' takes: 4 of them).
    spares = taken[id(pipelined.merger.spares)]
    recycled = {ptr for take in spares[:-4] for ptr in take}
    assert all(take and set(take) <= recycled for take in spares[-4:]), spares
    # The sequential run below gets fresh buffers for every decode: the same state, bit for bit,
    # says no recycled buffer was written while a round still read it.
    monkeypatch.setattr(DecodeBuffers, "give_back", lambda self, tensors: None)
    sync = Synchronizer(plain.sync_store(), options=SynchronizerOptions(live_timeout_s=1e9))
    learners = LearnerStore.open(plain.url)
    while sync.round < ROUNDS:
        r = sync.round + 1
        plain.publish(learners, r, sync.fragment_of_round(r), sync.versions[sync.fragment_of_round(r)])
        assert isinstance(sync.tick(), RoundSummary)
    assert encoded_on == [threading.main_thread().name] * ROUNDS  # a sequential close encodes in place
    assert_identical(state_of(piped.url, None, ROUNDS), state_of(plain.url, None, ROUNDS))
    # A record counts its update's bytes from the shapes, before the encoding: their true size.
    # The payload writers may finish two rounds' encodes in either order, so the pipelined run's
    # bytes are compared as a multiset (each fragment's update has its own size).
    for i, run in enumerate((piped, plain)):
        records = [RunReader.open(run.url).read_commit(r) for r in range(1, ROUNDS + 1)]
        counted = [rec.stats["bytes_out_per_learner"] if rec else None for rec in records]
        assert Counter(counted) == Counter(update_bytes[i * ROUNDS:(i + 1) * ROUNDS])
    assert counted == update_bytes[ROUNDS:]  # sequential: round by round


def test_a_round_lost_to_another_synchronizer_in_flight_is_adopted_and_later_rounds_dropped(tmp_path) -> None:
    run = new_run(str(tmp_path), None)
    learners = LearnerStore.open(run.url)
    store = run.sync_store()
    hold, held = threading.Event(), threading.Event()
    real_commit = store.commit_round

    def held_commit(round_: int, *args: Any, **kwargs: Any) -> Any:
        if round_ == 1:
            held.set()
            assert hold.wait(30)
        return real_commit(round_, *args, **kwargs)

    store.commit_round = held_commit  # type: ignore[method-assign]
    ours = Synchronizer(store, options=SynchronizerOptions(live_timeout_s=1e9), clock=lambda: 0.0)
    for r in (1, 2):  # both fragments' inputs: round 2 merges on our round 1 while round 1 is held
        run.publish(learners, r, ours.fragment_of_round(r), 0)
    assert ours.step() == ([], None)
    assert held.wait(30)
    assert ours.step() == ([], None) and ours.round == 2  # round 2 handed over on top of the held round 1
    other = Synchronizer(run.sync_store(), options=SynchronizerOptions(live_timeout_s=1e9), clock=lambda: 0.0)
    theirs = other.tick()
    assert isinstance(theirs, RoundSummary) and theirs.won and theirs.record.round == 1
    hold.set()
    ours._commits.drain()  # type: ignore[union-attr]
    assert RunReader.open(run.url).read_commit(2) is None  # merged on our round 1: dropped, never recorded
    landed, _ = ours.step()
    assert [(s.record.round, s.won, s.record.nonce) for s in landed] == [(1, False, theirs.record.nonce)]
    assert ours.round in (1, 2)  # the winner's round 1 reloaded (and round 2 maybe handed over again)
    while ours.round < 2:
        ours.step()
    (again,) = ours.drain()
    assert again.won and again.record.round == 2 and again.record.versions == (1, 2)
    assert {a.learner_id for a in again.record.accepted} == set(LEARNERS)  # round 2's inputs, merged on theirs
    ours.shutdown()


def test_a_failed_commit_is_raised_after_the_rounds_before_it_and_nothing_after_it_lands(tmp_path) -> None:
    from atoll.storage.validation import TransientStorageError

    run = new_run(str(tmp_path), None)
    learners = LearnerStore.open(run.url)
    store = run.sync_store()
    real_commit = store.commit_round

    def failing(round_: int, *args: Any, **kwargs: Any) -> Any:
        if round_ == 3:
            raise TransientStorageError("put", "sync/commits/00000003.json", 5, ConnectionResetError("reset"))
        return real_commit(round_, *args, **kwargs)

    store.commit_round = failing  # type: ignore[method-assign]
    sync = Synchronizer(store, options=SynchronizerOptions(live_timeout_s=1e9), clock=lambda: 0.0)
    reported: list[int] = []
    with pytest.raises(TransientStorageError):
        for _ in range(50):
            r = sync.round + 1
            if r <= 4:
                run.publish(learners, r, sync.fragment_of_round(r), sync.versions[sync.fragment_of_round(r)])
            reported += [s.record.round for s in sync.step()[0]]
    sync.shutdown()
    assert reported == [1, 2]
    assert RunReader.open(run.url).latest_round() == 2  # round 4 (merged on round 3) never got a record
    assert Synchronizer(run.sync_store()).round == 2
