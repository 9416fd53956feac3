"""The WAN lab (benchmarks/wanlab.py), for real: network namespaces, veths shaped by tbf, moto's S3
server in the cloud namespace, learners and the synchronizer as processes of
``python -m atoll.train.local`` in their sites and in the cloud.

* one site on a 20 Mbit/s link still trains and its work is merged; its kernel counters carry at
  least the bytes atoll counted;
* a site cut off mid-run is merged again once its link is back: no second live copy of its
  learner, no committed round lost;
* a site whose wall clock is 10 minutes slow (libfaketime) is alive to the other side, and a dead
  learner whose clock is 10 minutes fast looks dead within the heartbeat timeout.

Each test builds its own lab (names and subnet from the test process's pid and a counter) and
tears it down: afterwards no namespace, link or process of it is left. Without root or network
namespaces the module skips and says why. Speed is not asserted here (benchmarks/wan.py)."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import wanlab  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_WHY = wanlab.unavailable()
if _WHY:
    pytest.skip(_WHY, allow_module_level=True)

LEARNER_ARGS = ("--heartbeat-interval-s", "1", "--poll-interval-s", "0.2", "--log-every", "10")


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, lab: wanlab.Lab | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(1.0)
    tail = lab.log_tail(2500) if lab is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{tail}")


@pytest.fixture
def lab_of(tmp_path: Path) -> Iterator[Callable[..., wanlab.Lab]]:
    """Build a lab (torn down after the test, whatever happens) and check nothing of it is left."""
    labs: list[wanlab.Lab] = []

    def build(*sites: wanlab.SiteSpec) -> wanlab.Lab:
        lab = wanlab.Lab(list(sites), log_dir=tmp_path / "logs").start()
        labs.append(lab)
        return lab

    yield build
    for lab in labs:
        lab.stop()
        # Namespaces are destroyed by the kernel a moment after their last process is gone.
        wait_for(lambda lab=lab: not lab.leftovers(), 30, f"lab {lab.tag} to be gone")
        assert all(p.popen.poll() is not None for p in lab.procs)


def new_run(moto: wanlab.Moto, learners: int, **config_changes: Any) -> tuple[str, Any]:
    from atoll.storage import RunReader
    from atoll.train.recipe import smoke_recipe
    from atoll.train.run import create_run

    config, recipe = smoke_recipe(learners, max_rounds=10**6)
    config = dataclasses.replace(config, **config_changes)
    recipe = recipe.replace(eval_every_rounds=0)
    url = f"s3://{wanlab.BUCKET}/run-{time.time_ns() % 10**12}"
    create_run(url, config, recipe, storage_options=moto.options())
    return url, RunReader.open(url, moto.options())


def merged_after(store: Any, after_round: int) -> dict[str, int]:
    """Contributions merged per learner in the rounds committed after ``after_round``."""
    out: dict[str, int] = {}
    latest = store.latest_round()
    if latest <= after_round:
        return out
    for rec in store.history(after_round + 1, latest):
        for a in rec.accepted:
            out[a.learner_id] = out.get(a.learner_id, 0) + 1
    return out


def test_a_site_on_a_20_mbit_link_still_trains_and_is_merged(lab_of) -> None:
    lab = lab_of(wanlab.SiteSpec(name="s0"), wanlab.SiteSpec(name="s1", rate_mbit=20))
    assert all("tbf" in q and "rate 20Mbit" in q for q in lab.qdisc("s1"))  # both directions
    assert not any("tbf" in q for q in lab.qdisc("s0"))
    moto = wanlab.Moto(lab)
    url, store = new_run(moto, 2)
    run = wanlab.LabRun(lab, moto, url, {"learner-0": "s0", "learner-1": "s1"}, learner_args=LEARNER_ARGS).start()
    try:
        wait_for(lambda: min(merged_after(store, 0).get(lid, 0) for lid in ("learner-0", "learner-1")) >= 3,
                 600, "both learners merged three times", lab)
        # The newest round that merged learner-1 carries its latest report (with K = 1 the newest
        # round of all may have merged learner-0 alone).
        reported = next(wire["learner-1"] for rec in reversed(store.history())
                        if "learner-1" in (wire := rec.stats.get("learner_wire") or {}))
    finally:
        run.stop()
    sent, received = lab.counters("s1")
    assert sent > 0 and received > 0
    # What the kernel saw leave the site is at least the object bytes atoll counted (HTTP, TCP and
    # IP add their own on top).
    assert sent >= reported["bytes_up"] > 0
    assert received >= reported["bytes_down"] > 0
    report = store.verify()
    assert report.ok, report.problems


def test_a_site_cut_off_is_merged_again_once_its_link_is_back(lab_of) -> None:
    lab = lab_of(wanlab.SiteSpec(name="s0"), wanlab.SiteSpec(name="s1", rate_mbit=20))
    moto = wanlab.Moto(lab)
    url, store = new_run(moto, 2)
    run = wanlab.LabRun(lab, moto, url, {"learner-0": "s0", "learner-1": "s1"}, learner_args=LEARNER_ARGS).start()
    try:
        wait_for(lambda: merged_after(store, 0).get("learner-1", 0) >= 2, 600, "learner-1 merged", lab)
        lab.link_down("s1")
        cut_at = store.latest_round()
        # The run goes on without the site: K = 1, so rounds commit with learner-0 alone.
        wait_for(lambda: merged_after(store, cut_at).get("learner-0", 0) >= 3, 300,
                 "rounds without the cut-off site", lab)
        during = merged_after(store, cut_at)
        lab.link_up("s1")
        healed_at = store.latest_round()
        wait_for(lambda: merged_after(store, healed_at).get("learner-1", 0) >= 2, 600,
                 "learner-1 merged again after the partition", lab)
        liveness = store.learner_liveness("learner-1")
        live_procs = [p for p in lab.procs if p.name.startswith("learner-1") and p.popen.poll() is None]
    finally:
        run.stop()
    # Whatever learner-1 sent while cut off could not arrive; at most what it had published just before (one per fragment).
    assert during.get("learner-1", 0) <= 2
    # One live copy: the newest lease's process (a relaunch fences the copy it replaces).
    assert len(live_procs) == 1
    assert liveness.lease is not None and liveness.lease.pid == live_procs[0].popen.pid
    report = store.verify()
    assert report.ok, report.problems
    assert [r.round for r in store.history(1, store.latest_round())] == list(range(1, store.latest_round() + 1))


@pytest.mark.skipif(wanlab.faketime_library() is None,
                    reason="libfaketime is not installed (apt-get install faketime; `make test` installs it)")
def test_sites_ten_minutes_fast_and_slow_stay_alive_are_fenced_orphaned_and_counted(lab_of) -> None:
    """Site s0's wall clock is 10 minutes fast, s1's 10 minutes slow (libfaketime). Liveness is
    measured on the store's clock, so both are alive, and s0's learner is dead within the timeout
    once it is killed; fencing (lease numbers) and the orphan exit (the learner's monotonic clock)
    do not read wall clocks; goodput counts both learners' merged work."""
    from atoll.runs.goodput import GoodputTracker

    lab = lab_of(wanlab.SiteSpec(name="s0"), wanlab.SiteSpec(name="s1"))
    moto = wanlab.Moto(lab)
    url, store = new_run(moto, 2)
    run = wanlab.LabRun(lab, moto, url, {"learner-0": "s0", "learner-1": "s1"}, clock_skew={"s0": "+10m", "s1": "-10m"},
                        learner_args=LEARNER_ARGS).start()
    try:
        wait_for(lambda: min(merged_after(store, 0).get(lid, 0) for lid in ("learner-0", "learner-1")) >= 2,
                 600, "both skewed learners merged", lab)
        now = time.time()
        lives = {lid: store.learner_liveness(lid) for lid in ("learner-0", "learner-1")}
        for lid, skew in (("learner-0", 600), ("learner-1", -600)):
            beat = lives[lid].heartbeat
            assert beat is not None and abs(beat.time - now - skew) < 120  # the writer's clock is off
            assert lives[lid].is_alive(now, 30), (lid, lives[lid])  # ... and it is alive all the same

        # Fencing: a second copy of learner-1 takes the next lease; the first exits fenced. (The
        # second copy's orphan timeout is short, for the end of the test.)
        first = run.learners["learner-1"]
        run.start_learner("learner-1", "--orphan-timeout-s", "30")
        wait_for(lambda: first.poll() is not None, 300, "the older copy of learner-1 to exit", lab)
        assert "exit_reason=fenced" in (lab.log_dir / "learner-1-1.log").read_text()
        assert store.learner_liveness("learner-1").incarnation == 2

        # Death: learner-0 (clock 10 minutes fast) is dead to the reader within the timeout.
        run.kill("learner-0")
        wait_for(lambda: not store.learner_liveness("learner-0").is_alive(time.time(), 10), 120,
                 "the killed fast-clock learner to look dead", lab)

        # Goodput: both learners' merged work counts, and the figures are fractions.
        tracker = GoodputTracker(store)
        report = tracker.update()
        assert report.goodput is not None and 0 < report.goodput <= 1
        assert set(report.per_learner) == {"learner-0", "learner-1"}
        assert all(0 < g <= 1 for g in report.per_learner.values())

        # Orphan exit: with no synchronizer, the slow-clock learner exits by itself (its timeout
        # runs on its monotonic clock).
        assert run.synchronizer is not None
        run.synchronizer.terminate()
        run.synchronizer.wait(timeout=60)
        wait_for(lambda: (store.learner_liveness("learner-1").exited_reason or "").startswith("orphaned"), 300,
                 "learner-1 to exit orphaned", lab)
    finally:
        run.stop()
