"""Leases, heartbeats and the stop marker in the bucket (atoll.storage.liveness), on a local
folder and on moto's S3 server: create-once incarnations under races, liveness as the bucket
says it, hostile objects ignored with a reason, read-only handles, and the fault hook."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from storage_helpers import counters, fragment_delta, init_run, plant_contribution

from atoll.storage import LearnerStore, RunReader, SynchronizerStore, paths
from atoll.storage import liveness as lc
from atoll.storage.codec import dump_record
from atoll.storage.records import KIND_CONTRIBUTION, ContributionRecord
from atoll.storage.validation import ReadOnlyError

Backend = Any

RACERS = 8


def test_racing_takers_get_distinct_consecutive_incarnations(hostile_backend: Backend) -> None:
    url = hostile_backend.new_url()
    handles = [hostile_backend.open(url, fresh=True, role=LearnerStore) for _ in range(RACERS)]  # one "process" each
    start = threading.Barrier(RACERS)
    got: list[int] = []
    errors: list[BaseException] = []

    def take(store: LearnerStore) -> None:
        start.wait()
        try:
            got.append(store.take_learner_lease("l0").incarnation)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=take, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(got) == list(range(1, RACERS + 1))
    reader = hostile_backend.open(url, fresh=True)
    assert reader.current_incarnation("l0") == RACERS
    live = reader.learner_liveness("l0")
    assert live.incarnation == RACERS and live.lease is not None and live.lease.holder == "l0"
    # The synchronizer's leases are numbered on their own.
    assert SynchronizerStore.beside(reader).take_synchronizer_lease(flow_run_id="fr-1").incarnation == 1
    assert reader.synchronizer_liveness().lease.flow_run_id == "fr-1"  # type: ignore[union-attr]


def test_liveness_is_the_newest_lease_and_its_own_heartbeat(hostile_backend: Backend) -> None:
    url = hostile_backend.new_url()
    store = hostile_backend.open(url, role=LearnerStore)
    assert store.current_incarnation("l0") == 0
    never = store.learner_liveness("l0")
    assert never.lease is None and never.incarnation == 0 and never.heartbeat_age_s(time.time()) is None
    old = store.take_learner_lease("l0", flow_run_id="run-a")
    store.write_heartbeat(old, step=7, round=3)
    live = store.learner_liveness("l0")
    assert live.incarnation == 1 and live.heartbeat is not None and live.heartbeat.step == 7
    assert live.heartbeat.round == 3 and live.exited_reason is None
    assert 0 <= live.heartbeat_age_s(time.time()) < 5 and live.is_alive(time.time(), 5)  # type: ignore[operator]
    assert live.heartbeat_stored_at is not None  # both backends report when an object was written
    assert live.heartbeat_age_s(live.heartbeat_stored_at + 100) == pytest.approx(100)

    new = store.take_learner_lease("l0")
    assert new.incarnation == 2
    after = hostile_backend.open(url, fresh=True).learner_liveness("l0")
    assert after.incarnation == 2 and after.heartbeat is None  # the new one has not beaten yet
    store.write_heartbeat(old, step=8)  # a fenced copy writes only its own key
    assert store.learner_liveness("l0").heartbeat is None
    store.write_heartbeat(new, status="exited", reason="stopped: maintenance", step=1)
    done = hostile_backend.open(url, fresh=True).learner_liveness("l0")
    assert done.exited_reason == "stopped: maintenance" and not done.is_alive(time.time(), 60)
    with pytest.raises(ValueError, match="status"):
        store.write_heartbeat(new, status="sleeping")

    ro = hostile_backend.open(url, read_only=True, role=LearnerStore)
    ro_sync = hostile_backend.open(url, read_only=True, role=SynchronizerStore)
    assert ro.learner_liveness("l0").incarnation == 2 and ro.current_incarnation("l0") == 2
    for write in (lambda: ro.take_learner_lease("l0"), lambda: ro_sync.take_synchronizer_lease(),
                  lambda: ro.write_heartbeat(new), lambda: ro_sync.mark_stopped("x", "y"),
                  lambda: ro_sync.clear_stopped()):
        with pytest.raises(ReadOnlyError):
            write()


@pytest.mark.parametrize("skew_s", [600.0, -600.0])
def test_ages_are_on_the_store_s_clock_whatever_the_writer_s_clock_says(hostile_backend: Backend,
                                                                        skew_s: float) -> None:
    """A learner whose clock is ten minutes fast (or slow) writes its lease and heartbeats with
    those times inside; the reader measures their ages against the time the store recorded for
    each object, so the learner is alive now and its age grows from the moment it was written."""
    url = hostile_backend.new_url()
    store = hostile_backend.open(url)
    skewed = lambda: time.time() + skew_s  # noqa: E731 - the writer's wall clock
    # Ages are bounded by the time the write and read took here (plus the store's one-second
    # resolution), not by a fixed figure: a loaded machine makes them slow.
    before = time.time()
    lease = lc.take_lease(store.store, "l0", clock=skewed)
    starting = store.learner_liveness("l0")  # no heartbeat yet: the lease's age counts
    now = time.time()
    assert starting.heartbeat is None and starting.lease_stored_at is not None
    assert 0 <= starting.lease_age_s(now) <= now - before + 1  # type: ignore[operator]
    assert starting.lease_age_s(now + 90) == pytest.approx(now + 90 - starting.lease_stored_at)
    assert starting.lease.started_at == pytest.approx(before + skew_s, abs=now - before + 1)  # type: ignore[union-attr]
    before = time.time()
    lc.write_heartbeat(store.store, lease, step=1, clock=skewed)
    live = store.learner_liveness("l0")
    now = time.time()
    took_s = now - before + 1
    assert live.heartbeat is not None and live.heartbeat.time == pytest.approx(before + skew_s, abs=took_s)
    age_s = live.heartbeat_age_s(now)
    assert age_s is not None and 0 <= age_s <= took_s and live.is_alive(now, 30 + took_s)
    # Dead a heartbeat timeout after its last heartbeat, not ten minutes early or late.
    assert not live.is_alive(now + 31, 30) and live.is_alive(now + 29 - age_s, 30)
    assert live.lease_stored_at is None  # read only while there is no heartbeat


def test_stop_marker_round_trip(hostile_backend: Backend) -> None:
    url = hostile_backend.new_url()
    store = hostile_backend.open(url, role=SynchronizerStore)
    assert store.stop_marker() is None
    store.mark_stopped("maintenance window", by="alice")
    marker = hostile_backend.open(url, fresh=True, read_only=True).stop_marker()
    assert marker is not None and marker.stopped and marker.reason == "maintenance window" and marker.by == "alice"
    assert abs(marker.time - time.time()) < 60
    raw = json.loads(hostile_backend.raw_get(url, paths.STOP))
    assert raw["schema"] == "atoll/stop" and raw["stopped"] is True
    store.clear_stopped(by="alice")
    again = hostile_backend.open(url, fresh=True).stop_marker()
    assert again is not None and not again.stopped


def test_corrupt_or_oversized_lifecycle_objects_are_ignored_with_a_reason(hostile_backend: Backend) -> None:
    url = hostile_backend.new_url()
    store = hostile_backend.open(url, role=LearnerStore)
    store.write_heartbeat(store.take_learner_lease("l0"))
    # A garbage lease at the next number: it still counts as the newest (fences incarnation 1),
    # its content is ignored, and the next taker moves past it.
    hostile_backend.raw_put(url, paths.learner_lease_key("l0", 2), b"{not json")
    live = store.learner_liveness("l0")
    assert live.lease is None and live.newest == 2 and store.current_incarnation("l0") == 2
    assert any("corrupt" in p for p in live.problems), live.problems
    assert store.take_learner_lease("l0").incarnation == 3

    # An oversized heartbeat, a heartbeat claiming another incarnation, a lease of another holder.
    hostile_backend.raw_put(url, paths.learner_heartbeat_key("l0", 3), b" " * (lc.MAX_LIFECYCLE_RECORD_BYTES + 10))
    live = store.learner_liveness("l0")
    assert live.incarnation == 3 and live.heartbeat is None and any("oversize" in p for p in live.problems)
    body = {"holder": "l0", "incarnation": 9, "time": time.time(), "status": "alive", "reason": "",
            "step": None, "round": None}
    hostile_backend.raw_put(url, paths.learner_heartbeat_key("l0", 3), dump_record(lc.KIND_HEARTBEAT, body))
    live = store.learner_liveness("l0")
    assert live.heartbeat is None and any("incarnation 9" in p for p in live.problems)
    forged = lc.Lease("l1", 4, time.time(), "h", 1).to_dict()
    hostile_backend.raw_put(url, paths.learner_lease_key("l0", 4), dump_record(lc.KIND_LEASE, forged))
    live = store.learner_liveness("l0")
    assert live.lease is None and live.newest == 4 and any("'l1'" in p for p in live.problems)
    # Odd names under leases/ are not incarnations.
    hostile_backend.raw_put(url, paths.learner_leases_prefix("l0") + "99999999999.json", b"{}")
    hostile_backend.raw_put(url, paths.learner_leases_prefix("l0") + "notes.txt", b"{}")
    assert store.current_incarnation("l0") == 4

    # A stop marker that does not parse is ignored (running), with the reason available.
    hostile_backend.raw_put(url, paths.STOP, dump_record(lc.KIND_STOP, {"stopped": "yes", "reason": "", "by": "",
                                                                       "time": 0}))
    marker, why = store.read_stop_marker()
    assert marker is None and store.stop_marker() is None and why is not None and "stopped" in why


def test_a_forged_top_incarnation_only_stops_its_own_learner(hostile_backend: Backend) -> None:
    url = hostile_backend.new_url()
    store = hostile_backend.open(url, role=LearnerStore)
    hostile_backend.raw_put(url, paths.learner_lease_key("l0", paths.MAX_INCARNATION), b"{}")
    with pytest.raises(lc.LeaseError, match="forged"):
        store.take_learner_lease("l0")
    assert store.take_learner_lease("l1").incarnation == 1


def _tiny_run(url: str) -> LearnerStore:
    store = LearnerStore.open(url)
    init_run(store)
    return store


def test_contributions_carry_their_incarnation_and_old_records_read_as_zero(tmp_path: Path) -> None:
    store = _tiny_run(str(tmp_path / "run"))
    rec = store.publish_contribution("l0", 0, 0, counters(), fragment_delta(store, 0), incarnation=3)
    assert rec.incarnation == 3
    again = RunReader.open(store.url).list_contributions(0, 0, ["l0"]).records
    assert [r.incarnation for r in again] == [3]
    plain = store.publish_contribution("l1", 0, 0, counters(), fragment_delta(store, 0))
    assert plain.incarnation == 0
    body = rec.to_dict()
    del body["incarnation"]  # a record written before leases existed
    assert ContributionRecord.from_body(body, rec.key).incarnation == 0
    with pytest.raises(ValueError, match="incarnation"):
        store.publish_contribution("l0", 0, 0, counters(3), fragment_delta(store, 0), incarnation=-1)
    raw = json.loads((tmp_path / "run" / rec.key).read_bytes())
    assert raw["schema"] == KIND_CONTRIBUTION and raw["incarnation"] == 3


def test_fault_hook_signals_between_payloads_and_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _tiny_run(str(tmp_path / "run"))
    assert not lc.fault_hold_before_commit(1)  # unset: a no-op
    signals = tmp_path / "signals"
    # Held long enough for this thread to see the flag before the commit goes on, even on a loaded
    # machine (1.5 s once was not: the commit landed before the poll below ran).
    monkeypatch.setenv(lc.FAULT_HOLD_ENV, "4")
    monkeypatch.setenv(lc.FAULT_SIGNAL_DIR_ENV, str(signals))
    done = threading.Event()

    def commit() -> None:
        params = {n: torch.full(s, 2.0) for n, s in store.manifest.fragment_shapes(0).items()}
        SynchronizerStore.beside(store).commit_round(1, 0, params=params)
        done.set()

    blobs = tmp_path / "run" / "sync" / "blobs" / "sha256"
    before = len(list(blobs.iterdir()))
    t = threading.Thread(target=commit)
    t0 = time.monotonic()
    t.start()
    flag = signals / "payloads-written-00000001"
    while not flag.exists():
        assert time.monotonic() - t0 < 30, "the hook never signalled"
        time.sleep(0.01)
    assert flag.read_text() == str(os.getpid())
    assert not done.is_set() and not (tmp_path / "run" / paths.commit_key(1)).exists()
    assert len(list(blobs.iterdir())) == before + 1  # the round's new fragment payload is written
    t.join(30)
    assert done.is_set() and time.monotonic() - t0 >= 3.9
    assert RunReader.open(store.url).latest_round() == 1


@pytest.mark.parametrize("bad", [True, -1, "3", 2**60, 1.5])
def test_a_contribution_with_a_bad_incarnation_is_a_schema_rejection(hostile_backend: Backend, bad: Any) -> None:
    url = hostile_backend.new_url()
    store = hostile_backend.open(url)
    init_run(store)
    key = plant_contribution(hostile_backend, url, fragment=0, tensors=fragment_delta(store, 0),
                             extra={"incarnation": bad})
    listing = hostile_backend.open(url, fresh=True).list_contributions(0, 0)
    assert not listing.records and listing.rejected[key].kind.value == "schema"
    assert "incarnation" in listing.rejected[key].detail


def test_an_armed_fault_hook_holds_one_commit_per_arming(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/chaos.py arms the hold only when it wants to kill a synchronizer before a commit."""
    signals = tmp_path / "signals"
    signals.mkdir()
    monkeypatch.setenv(lc.FAULT_HOLD_ENV, "7")
    monkeypatch.setenv(lc.FAULT_SIGNAL_DIR_ENV, str(signals))
    monkeypatch.setenv(lc.FAULT_ARMED_ENV, "1")
    slept: list[float] = []
    assert not lc.fault_hold_before_commit(1, sleep=slept.append)  # not armed: no hold, no signal
    (signals / "arm").write_text("")
    assert lc.fault_hold_before_commit(2, sleep=slept.append)
    assert not lc.fault_hold_before_commit(3, sleep=slept.append)  # the arming was used up
    assert slept == [7.0] and not (signals / "arm").exists()
    assert sorted(p.name for p in signals.iterdir()) == ["payloads-written-00000002"]
