"""Goodput from the bucket, computed by hand for a run with a learner restart and re-run steps.

The tracker reads only commit records and the contribution records they name, so the bucket is
written here record by record with numbers chosen to make the arithmetic easy to follow.

Run: P = 2 fragments; round r synchronizes fragment (r - 1) mod 2.

=====  =======  ====  ==========  ========  =======  ===================================
key    learner  step  created_at  step_t s  c_steps  fate
=====  =======  ====  ==========  ========  =======  ===================================
a2     a        2     1.0         0.1       2        merged in round 1
a4     a        4     2.0         0.1       4        merged in round 2
a6     a        6     3.0         0.1       4        merged in round 3
a8     a        8     4.0         0.5       4        late in round 4 (never merged)
b3     b        3     1.5         0.2       3        merged in round 1
b6     b        6     2.5         0.2       6        merged in round 2
b9     b        9     3.5         0.4       6        superseded in round 3 (b was killed)
b7     b        7     4.5         0.2       2        late in round 3, merged in round 5
b10    b        10    5.5         0.3       3        merged in round 4
d2     d        2     1.2         0.5       2        outlier in round 1
d4     d        4     2.2         0.5       2        non-finite in round 2
=====  =======  ====  ==========  ========  =======  ===================================

b was killed after step 9 and restarted from its state saved at step 5: its counter reads
3, 6, 9, then 7, 10 -- steps 6..9 ran twice (9 - 7 = 2 of them show up as a drop in the counter).

* a: useful (2 + 4 + 4) / P = 5 steps; spent = highest step 8, no re-runs = 8; step time median(0.1, 0.1, 0.1, 0.5) = 0.1 s.
* b: useful (3 + 6 + 2 + 3) / P = 7 steps; spent = 10 + (9 - 7) = 12; step time median(0.2, 0.2, 0.4, 0.2, 0.3) = 0.2 s.
* d: useful 0; spent 4; step time 0.5 s.

merged = 5 * 0.1 + 7 * 0.2 + 0 = 1.9 s; training = 8 * 0.1 + 12 * 0.2 + 4 * 0.5 = 5.2 s; merged-work
share = 1.9 / 5.2. These records carry no process clocks (``up_s``, ``train_s``): each learner counts as
training all its available time, so goodput is steps not redone over steps run: (5.2 - 2 * 0.2) / 5.2.

Each contribution is against its learner's last alignment of the fragment (``BASES``). One
published again against the same version as the learner's previous merged one would carry that
work again: only its steps beyond it count (the last test).
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid

import pytest
import torch

from atoll.core import DilocoConfig, plan_fragments
from atoll.core.rejection import Rejection, RejectionKind
from atoll.runs.goodput import GoodputTracker
from atoll.storage import RunCreator, SynchronizerStore, paths
from atoll.storage.codec import dump_record
from atoll.storage.integrity import seal
from atoll.storage.records import KIND_CONTRIBUTION, AcceptedContribution, BlobRef, ContributionRecord

SHAPES = {"w": (3,), "v": (2,)}

# key: (learner, step, created_at, step_time_s, fragment, c_steps)
CONTRIBUTIONS = {
    "a2": ("a", 2, 1.0, 0.1, 0, 2), "a4": ("a", 4, 2.0, 0.1, 1, 4), "a6": ("a", 6, 3.0, 0.1, 0, 4),
    "a8": ("a", 8, 4.0, 0.5, 1, 4),
    "b3": ("b", 3, 1.5, 0.2, 0, 3), "b6": ("b", 6, 2.5, 0.2, 1, 6), "b9": ("b", 9, 3.5, 0.4, 0, 6),
    "b7": ("b", 7, 4.5, 0.2, 0, 2), "b10": ("b", 10, 5.5, 0.3, 1, 3),
    "d2": ("d", 2, 1.2, 0.5, 0, 2), "d4": ("d", 4, 2.2, 0.5, 1, 2),
}
# The version each one is against: the learner's last alignment of that fragment (fragment 0 is
# synchronized by rounds 1, 3, 5 and fragment 1 by rounds 2, 4). b restarted from its save at step
# 5, taken after it had aligned fragment 0 to round 1.
BASES = {"a2": 0, "a4": 0, "a6": 1, "a8": 2, "b3": 0, "b6": 0, "b9": 1, "b7": 1, "b10": 2, "d2": 0, "d4": 0}
# round: (accepted, rejected: name -> kind)
ROUNDS = {
    1: (["a2", "b3"], {"d2": RejectionKind.OUTLIER}),
    2: (["a4", "b6"], {"d4": RejectionKind.NON_FINITE}),
    3: (["a6"], {"b9": RejectionKind.SUPERSEDED, "b7": RejectionKind.LATE}),
    4: (["b10"], {"a8": RejectionKind.LATE}),
    5: (["b7"], {}),
}
MERGED_S, TRAINING_S = 5 * 0.1 + 7 * 0.2, 8 * 0.1 + 12 * 0.2 + 4 * 0.5


def write_run(contributions: dict = CONTRIBUTIONS, clocks: dict | None = None) -> tuple[SynchronizerStore, dict[str, str]]:
    """``clocks``: name -> (up_s, train_s, meter) of the process that published it."""
    store = SynchronizerStore.open(f"memory://atoll-goodput-{uuid.uuid4().hex[:8]}/run")
    config = DilocoConfig(num_learners=3, num_fragments=2, inner_steps=2, overlap_steps=1, min_quorum=1)
    plan = plan_fragments(SHAPES, num_fragments=2, inner_steps=2)
    RunCreator.beside(store).init_run(config, plan, {n: torch.zeros(s) for n, s in SHAPES.items()}, run_id="goodput")
    keys: dict[str, str] = {}
    for name, (learner, step, created, step_time, fragment, c_steps) in contributions.items():
        sha = hashlib.sha256(name.encode()).hexdigest()
        key = paths.contribution_key(fragment, BASES[name], learner, c_steps, sha)
        rec = ContributionRecord(key=key, learner_id=learner, fragment=fragment, base_version=BASES[name], c_steps=c_steps,
                                 c_tokens=64 * c_steps, payload=BlobRef(sha, 100),
                                 tensors={n: {"codec": "fp32", "shape": list(SHAPES[n])} for n in plan.fragments[fragment]},
                                 created_at=created, info={"step": step, "step_time_s": step_time, "pool": "p"})
        if clocks and name in clocks:
            up, train, meter = clocks[name]
            rec = dataclasses.replace(rec, info={**rec.info, "up_s": up, "train_s": train, "wire": {"meter": meter}})
        assert store.store.create(key, dump_record(KIND_CONTRIBUTION, seal(KIND_CONTRIBUTION, rec.to_dict())))
        keys[name] = key
    return store, keys


def commit(store: SynchronizerStore, keys: dict[str, str], round_: int) -> None:
    accepted, rejected = ROUNDS[round_]
    fragment = (round_ - 1) % 2
    rows = []
    for name in accepted:
        learner, _, _, _, frag, c_steps = CONTRIBUTIONS[name]
        assert frag == fragment
        rows.append(AcceptedContribution(keys[name], learner, 1.0 / len(accepted), BASES[name], c_steps, 64 * c_steps))
    assert store.commit_round(round_, fragment, params=None, accepted=rows,
                              rejected={keys[n]: Rejection(kind, "test") for n, kind in rejected.items()}).won


def test_goodput_by_hand_with_a_restart_and_re_run_steps() -> None:
    store, keys = write_run()
    for r in ROUNDS:
        commit(store, keys, r)
    report = GoodputTracker(store).update()
    assert report.merged_s == pytest.approx(MERGED_S) and report.merged_s == pytest.approx(1.9)
    assert report.training_s == pytest.approx(TRAINING_S) and report.training_s == pytest.approx(5.2)
    assert report.merged_share == pytest.approx(1.9 / 5.2)
    assert report.merged_per_learner == pytest.approx({"a": 5 / 8, "b": 7 / 12, "d": 0.0})
    assert report.goodput == pytest.approx(4.8 / 5.2) and report.available_s == pytest.approx(5.2)
    assert report.per_learner == pytest.approx({"a": 1.0, "b": 10 / 12, "d": 1.0})
    assert report.learners["b"].restarting_s == pytest.approx(0.4) and report.learners["b"].waiting_s == 0
    assert report.line() == ("goodput 92.3% (4.8 s in useful training steps of 5.2 s learner time); "
                             "merged-work share 36.5% (1.9 s of 5.2 s of training merged)")


def test_goodput_followed_round_by_round_equals_the_whole_run_at_once() -> None:
    """b7 is read twice (late in round 3, merged in round 5); it must count once either way."""
    store, keys = write_run()
    tracker = GoodputTracker(store)
    assert tracker.update().goodput is None  # nothing committed yet
    commit(store, keys, 1)
    commit(store, keys, 2)
    # After two rounds: a useful 3 of 4 steps; b 4.5 of 6; d 0 of 4 (step times as above).
    partial = tracker.update()
    assert partial.merged_s == pytest.approx(3 * 0.1 + 4.5 * 0.2)
    assert partial.training_s == pytest.approx(4 * 0.1 + 6 * 0.2 + 4 * 0.5)
    for r in (3, 4, 5):
        commit(store, keys, r)
        tracker.update()
    assert tracker.update().merged_share == pytest.approx(1.9 / 5.2)
    assert tracker.update() == GoodputTracker(store).update()


def test_no_restart_means_no_re_run_steps() -> None:
    """The same run without b's restart: b's counter only rises, so b spent exactly its highest step."""
    steady = {**CONTRIBUTIONS, "b7": ("b", 11, 4.5, 0.2, 0, 2), "b10": ("b", 14, 5.5, 0.3, 1, 3)}
    store, keys = write_run(steady)
    for r in ROUNDS:
        commit(store, keys, r)
    report = GoodputTracker(store).update()
    assert report.merged_per_learner["b"] == pytest.approx(7 / 14)
    assert report.training_s == pytest.approx(8 * 0.1 + 14 * 0.2 + 4 * 0.5)


def test_a_repeat_against_the_same_version_counts_only_its_new_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """a publishes fragment 0 again before adopting round 1 (a6 against version 0, not 1): it
    carries a2's 2 merged steps again, so merging it adds 4 - 2 = 2 useful steps, not 4."""
    monkeypatch.setitem(BASES, "a6", 0)
    store, keys = write_run()
    for r in ROUNDS:
        commit(store, keys, r)
    report = GoodputTracker(store).update()
    assert report.merged_per_learner["a"] == pytest.approx((2 + 4 + 2) / 2 / 8)
    assert report.merged_s == pytest.approx(MERGED_S - 2 / 2 * 0.1)


def test_goodput_from_the_learners_process_clocks() -> None:
    """With ``up_s`` and ``train_s`` (seconds since its process came up, and in steps), a learner's
    time splits into training, waiting and down. b's first process came up at t = 0.5 (b3 at 1.5
    after 1.0 s up) and reported last at 3.5 (b9: up 3.0 s, 1.8 s in steps); its second came up
    at 4.0 (b7 at 4.5 after 0.5 s up) and reported last at 5.5 (b10: up 1.5 s, 1.0 s in steps).
    So b was available 5.0 s, up 4.5 s, down 0.5 s, in steps 2.8 s, waiting 1.7 s; steps 6..9 ran
    twice (2 steps x 0.2 s redone): useful 2.4 s, goodput 2.4 / 5.0; merged 7 of 12 steps."""
    clocks = {"b3": (1.0, 0.6, "m1"), "b6": (2.0, 1.2, "m1"), "b9": (3.0, 1.8, "m1"),
              "b7": (0.5, 0.4, "m2"), "b10": (1.5, 1.0, "m2")}
    store, keys = write_run(clocks=clocks)
    for r in ROUNDS:
        commit(store, keys, r)
    b = GoodputTracker(store).update().learners["b"]
    assert b.available_s == pytest.approx(5.0) and b.down_s == pytest.approx(0.5)
    assert b.training_s == pytest.approx(2.8) and b.waiting_s == pytest.approx(1.7)
    assert b.redone_s == pytest.approx(0.4) and b.restarting_s == pytest.approx(0.9)
    assert b.goodput == pytest.approx(2.4 / 5.0) and b.merged_share == pytest.approx(7 / 12)
