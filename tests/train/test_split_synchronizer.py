"""A split synchronizer (``SynchronizerOptions.fragment_group``): G merger processes, each merging
the rounds of its own fragments, pass the commit chain along in round order.

The mergers run as real, independent Synchronizer objects on handles of their own over one
bucket (threads here; ``test_split_processes`` runs them as processes): the chain they write
together is the one a single synchronizer writes, bit for bit; a merger that is gone has its
rounds committed empty by the others and its contributions merged once it is back; leases fence
per group. Contributions are published once per round before the mergers start (a seeded delta
per learner, against the version the fragment holds then), and each synchronizer runs on a clock
that moves 10 s a call, so no trust bound or grace window depends on how fast this machine is.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from atoll.cli import main
from atoll.core.fragments import FragmentGroup
from atoll.core.weights import Counters
from atoll.storage import LearnerStore, RunReader, SynchronizerStore
from atoll.storage import paths as P
from atoll.train.lease import Fenced
from atoll.train.recipe import smoke_recipe
from atoll.train.run import TokenBounds, create_run
from atoll.train.synchronizer import Synchronizer, SynchronizerOptions

FRAGMENTS = 4
LEARNERS = ("learner-0", "learner-1")


def new_run(base_url: str, rounds: int, options: dict[str, Any] | None = None, *,
            checkpoint_every_rounds: int = 0) -> str:
    config, recipe = smoke_recipe(len(LEARNERS), max_rounds=rounds)
    recipe = recipe.replace(checkpoint_every_rounds=checkpoint_every_rounds)
    config = config.replace(num_fragments=FRAGMENTS, inner_steps=FRAGMENTS, initial_grace_s=0.0,
                            downlink_compression="int4", outer_momentum=0.9)
    url = P.join_url(base_url, f"run-{uuid.uuid4().hex[:8]}")
    create_run(url, config, recipe, storage_options=options)
    return url


def publish(url: str, rounds: Any, *, base_of: Any = None, options: dict[str, Any] | None = None,
            fragment: int | None = None) -> None:
    """Each round's inputs: a seeded delta per learner against ``base_of(r)`` (default: the round
    that last merged the fragment when every round merges, r - P, or version 0 in the first pass)."""
    learners = LearnerStore.open(url, options)
    bounds = TokenBounds.of_recipe(smoke_recipe(len(LEARNERS))[1])
    assert bounds is not None
    tokens = bounds.of(LEARNERS[0])
    for r in rounds:
        p = (r - 1) % FRAGMENTS if fragment is None else fragment
        base = base_of(r) if base_of is not None else max(0, r - FRAGMENTS)
        for i, lid in enumerate(LEARNERS):
            gen = torch.Generator().manual_seed(1000 * r + i)
            delta = {n: 1e-3 * torch.randn(s, generator=gen) for n, s in learners.manifest.fragment_shapes(p).items()}
            learners.publish_contribution(lid, p, base, Counters(c_steps=2, c_tokens=2 * tokens), delta,
                                          info={"step_time_s": 1.0})


def fast_clock() -> Any:
    lock, ticks = threading.Lock(), itertools.count()

    def clock() -> float:
        with lock:
            return 10.0 * next(ticks)
    return clock


def run_to_end(url: str, group: FragmentGroup, *, peer_timeout_s: float = 30.0, until: int | None = None,
               options: dict[str, Any] | None = None, errors: list[BaseException] | None = None) -> Synchronizer:
    """One merger (or the whole synchronizer) with a lease of its group, stepped until the
    schedule ends (or the bucket holds round ``until``)."""
    sync = Synchronizer(SynchronizerStore.open(url, options), clock=fast_clock(),
                        options=SynchronizerOptions(fragment_group=group, peer_timeout_s=peer_timeout_s,
                                                    poll_interval_s=0.01, synchronizer_id=f"sync-{group}"))
    try:
        sync.hold_lease()
        while not sync.finished and (until is None or sync.store.latest_round() < until):
            _, decision = sync.step()
            if decision is not None:
                time.sleep(0.01)
        sync.drain()
    except BaseException as e:  # noqa: BLE001 - handed to the test's thread
        if errors is None:
            raise
        errors.append(e)
    finally:
        sync.shutdown()
    return sync


def run_split(url: str, groups: int, **kw: Any) -> list[Synchronizer]:
    errors: list[BaseException] = []
    out: list[Synchronizer] = []
    threads = [threading.Thread(target=lambda g=g: out.append(run_to_end(url, FragmentGroup(g, groups), errors=errors,
                                                                           **kw)))
               for g in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return out


def chain_state(url: str, round_: int, options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    reader = RunReader.open(url, options)
    st = reader.read_global_state(round_)
    out = {f"param.{n}": t for n, t in st.params.items()}
    out.update({f"momentum.{p}.{n}": t for p, m in st.momentum.items() for n, t in m.items()})
    out.update({f"view.{n}": t for n, t in reader.read_global_state(round_, momentum=False, view=True).params.items()})
    return out


def records(url: str, options: dict[str, Any] | None = None) -> list[Any]:
    reader = RunReader.open(url, options)
    return [reader.read_commit(r) for r in range(1, reader.latest_round() + 1)]


def same_chain_split_or_not(base_url: str, groups: int, options: dict[str, Any] | None = None) -> None:
    rounds = 3 * FRAGMENTS
    # Checkpoints every P + 1 rounds fall on fragments of every group (rounds 5 and 10), and the last.
    every = FRAGMENTS + 1
    single, split = (new_run(base_url, rounds, options, checkpoint_every_rounds=every),
                     new_run(base_url, rounds, options, checkpoint_every_rounds=every))
    for url in (single, split):
        publish(url, range(1, rounds + 1), options=options)
    run_to_end(single, FragmentGroup(), options=options)
    mergers = run_split(split, groups, options=options)
    for sync in mergers:  # each merger holds its own group's state, 1/G of the model, nothing else
        mine = [p for p in range(FRAGMENTS) if sync.group.owns(p)]
        assert [p for p, f in enumerate(sync.fragments) if f] == mine
        assert sync.views is not None and [p for p, v in enumerate(sync.views) if v] == mine
        assert [p for p, opt in enumerate(sync.optimizers) if opt.buffers] == mine  # outer momentum 0.9
    a, b = records(single, options), records(split, options)
    assert len(a) == len(b) == rounds
    for ra, rb in zip(a, b, strict=True):
        assert ra is not None and rb is not None
        assert rb.updated and len(rb.accepted) == len(LEARNERS)
        assert [x.key for x in ra.accepted] == [x.key for x in rb.accepted]
        assert ra.state == rb.state  # the same payloads (content-addressed) and versions for every fragment
        assert rb.committed_by == f"sync-{FragmentGroup(0, groups).owner_of(rb.fragment)}"
    sa, sb = chain_state(single, rounds, options), chain_state(split, rounds, options)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # A split synchronizer's checkpoints are built from the bucket by the merger whose round they
    # follow (it holds only its own group's fragments current): the same models, bit for bit.
    one, many = RunReader.open(single, options), RunReader.open(split, options)
    assert one.list_checkpoints() == many.list_checkpoints() == [every, 2 * every, rounds]
    for r in one.list_checkpoints():
        ca, cb = one.load_checkpoint(r), many.load_checkpoint(r)
        assert ca.keys() == cb.keys() and all(torch.equal(ca[n], cb[n]) for n in ca), r


@pytest.mark.parametrize("groups", [2, 3])
def test_split_commits_the_chain_a_single_synchronizer_commits(tmp_path: Any, groups: int) -> None:
    same_chain_split_or_not(str(tmp_path), groups)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    import moto_s3

    with moto_s3.serving("atoll-split") as endpoint:
        yield endpoint


def test_split_commits_the_chain_a_single_synchronizer_commits_on_s3(moto_endpoint: str) -> None:
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"}}
    same_chain_split_or_not(f"s3://atoll-split/{uuid.uuid4().hex[:8]}", 2, options)


class Fleet:
    """Replay learners on a thread: each publishes one seeded delta per fragment version it sees
    (against that version), as learners that adopt every version do."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Fleet:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        reader, done = RunReader.open(self.url), set()
        while not self.stop.is_set():
            latest = reader.latest_round()
            versions = [0] * FRAGMENTS if latest == 0 else [e.version for e in reader.read_commit(latest).state]
            for p, v in enumerate(versions):
                if (p, v) not in done:
                    done.add((p, v))
                    publish(self.url, [v + p + 1], base_of=lambda _r, v=v: v, fragment=p)
            time.sleep(0.02)


def test_a_gone_merger_s_rounds_are_committed_empty_and_its_work_merged_when_it_is_back(tmp_path: Any) -> None:
    rounds = 4 * FRAGMENTS
    url = new_run(str(tmp_path), rounds)
    with Fleet(url):
        merger = run_to_end(url, FragmentGroup(0, 2), peer_timeout_s=0.5, until=2 * FRAGMENTS)  # group 1 is gone
        alone = records(url)
        assert len(alone) >= 2 * FRAGMENTS
        for rec in alone:
            assert rec is not None
            if FragmentGroup(1, 2).owns(rec.fragment):
                assert not rec.updated and not rec.accepted and rec.stats["filled_for_group"] == "1/2"
                assert rec.committed_by == "sync-0/2"
            else:
                assert rec.updated and rec.accepted
        assert merger.peers is not None and merger.peers.filled == [r.round for r in alone if not r.updated]
        run_split(url, 2)  # group 1 is back: the contributions its rounds never merged are merged now
    recs = records(url)
    assert len(recs) == rounds
    back = [rec for rec in recs[len(alone):] if rec is not None and FragmentGroup(1, 2).owns(rec.fragment)]
    assert back and all(rec.updated and rec.accepted for rec in back)
    first_back = {rec.fragment: rec for rec in reversed(back)}
    for rec in first_back.values():  # against version 0: published while group 1 was gone
        assert all(a.base_version == 0 for a in rec.accepted), rec.accepted


def test_each_group_s_lease_fences_only_its_own(tmp_path: Any) -> None:
    url = new_run(str(tmp_path), 4)
    store = SynchronizerStore.open(url)
    make = lambda g: Synchronizer(SynchronizerStore.open(url), options=SynchronizerOptions(  # noqa: E731
        fragment_group=g, heartbeat_interval_s=0.0))
    whole, first, second = make(FragmentGroup()), make(FragmentGroup(0, 2)), make(FragmentGroup(1, 2))
    whole.hold_lease()
    first.hold_lease()
    second.hold_lease()
    for sync in (whole, first, second):
        sync.check_lifecycle(force=True)  # no group's lease fences another's
    assert store.current_synchronizer_incarnation() == 1
    assert store.current_synchronizer_incarnation((1, 2)) == 1
    again = make(FragmentGroup(1, 2))
    again.hold_lease()
    with pytest.raises(Fenced):
        second.check_lifecycle(force=True)
    first.check_lifecycle(force=True)
    assert store.synchronizer_liveness((1, 2)).incarnation == 2
    assert P.sync_lease_key(2, (1, 2)) == "sync/groups/1of2/leases/00000002.json"
    assert set(store.store.list(P.sync_leases_prefix((1, 2)))) == {"00000001.json", "00000002.json"}


def test_a_merger_waiting_for_its_turn_keeps_heartbeating(tmp_path: Any) -> None:
    """Round 1 is group 0's and no group-0 merger runs: group 1's merger waits for it (cancelled
    after a while, never filling it) and heartbeats meanwhile, so peers and `atoll status` see it alive."""
    url = new_run(str(tmp_path), 4)
    sync = Synchronizer(SynchronizerStore.open(url), options=SynchronizerOptions(
        fragment_group=FragmentGroup(1, 2), heartbeat_interval_s=0.0, peer_timeout_s=600.0, poll_interval_s=0.01))
    sync.hold_lease()
    first = sync.store.synchronizer_liveness((1, 2)).heartbeat
    assert first is not None
    until = time.monotonic() + 0.5
    assert not sync._await_chain(2, cancelled=lambda: time.monotonic() > until)
    last = sync.store.synchronizer_liveness((1, 2)).heartbeat
    assert last is not None and last.status == "alive" and last.time > first.time
    assert sync.peers is not None and sync.peers.filled == [] and sync.store.latest_round() == 0


def test_split_processes_sigkilled_and_restarted(tmp_path: Any) -> None:
    """Two merger processes of ``python -m atoll.train.local synchronizer --group``; one is
    SIGKILLed mid-run and started again: the run ends with every round committed and verified."""
    rounds = 6 * FRAGMENTS
    url = P.to_url(str(tmp_path / "run"))
    config, recipe = smoke_recipe(len(LEARNERS), max_rounds=rounds)
    create_run(url, config.replace(num_fragments=FRAGMENTS, inner_steps=FRAGMENTS, initial_grace_s=0.0,
                                   downlink_compression="int4"), recipe)
    with Fleet(url):
        cmd = [sys.executable, "-m", "atoll.train.local", "synchronizer", url, "--eval-device", "off",
               "--poll-interval-s", "0.02", "--peer-timeout-s", "2"]
        procs = [subprocess.Popen([*cmd, "--group", f"{g}/2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for g in range(2)]
        try:
            reader = RunReader.open(url)
            deadline = time.monotonic() + 120
            while reader.latest_round() < FRAGMENTS and time.monotonic() < deadline:
                time.sleep(0.1)
            procs[1].kill()
            procs[1].wait()
            # Merger 0 fills group 1's rounds meanwhile: merger 1 is restarted once it has filled one
            # (a round count alone races a test process starved on a loaded machine).
            deadline = time.monotonic() + 120
            while not any("filled_for_group" in rec.stats for rec in records(url) if rec is not None):
                assert time.monotonic() < deadline, "merger 0 filled none of the killed group's rounds"
                time.sleep(0.1)
            procs[1] = subprocess.Popen([*cmd, "--group", "1/2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for proc in procs:
                out, _ = proc.communicate(timeout=180)
                assert proc.returncode == 0, out.decode()[-3000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    recs = records(url)
    assert len(recs) == rounds and all(rec is not None for rec in recs)
    assert any("filled_for_group" in rec.stats for rec in recs if rec is not None)  # merger 0 went on alone
    assert RunReader.open(url).latest_round() == rounds
    assert main(["verify", url]) == 0
    merged = [a.key for rec in recs if rec is not None for a in rec.accepted]
    assert len(merged) == len(set(merged))  # no contribution merged twice
    assert {rec.fragment for rec in recs if rec is not None and rec.updated} == set(range(FRAGMENTS))
