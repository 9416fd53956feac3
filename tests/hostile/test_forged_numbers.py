"""Numbers from observation, not testimony (docs/threat-model.md), against the real synchronizer.

One confined learner (``evil``, writing only under ``learners/evil/``) tries to stall the run with
one reported step time, to steer a fragment with counters the step bound still admitted, to set a
fragment alone in a K = 1 round, and to make the next commit record unreadable with junk in its own
prefix. Real learners and the real synchronizer on a fake clock (tests/hostile/hostile_helpers.py),
on a local folder and on moto's S3 server (the junk test on a local folder only: it writes 20,000
objects).
"""

from __future__ import annotations

import torch
from hostile_helpers import HONEST, Backend, HostileRun

from atoll.core.rejection import MAX_RECORDED_PER_LEARNER, RejectionKind
from atoll.core.weights import MIN_STEP_S, UNOBSERVED_INTERVALS, max_steps_since
from atoll.storage import paths
from atoll.storage.reader import LIST_LIMIT, MAX_LISTED_PER_PREFIX
from atoll.storage.records import CommitRecord
from atoll.train.synchronizer import RoundSummary

DT = 1.0
"""Fake seconds per tick; honest learners report this as their step time (one step per tick)."""


def drive(run: HostileRun, n: int, *, max_ticks: int = 40) -> list[RoundSummary]:
    """n rounds: each tick every honest learner steps (reporting DT as its step time), then the
    synchronizer ticks until nothing more closes. AssertionError if n rounds take max_ticks."""
    out: list[RoundSummary] = []
    for _ in range(max_ticks):
        for lr in run.learners:
            lr.step(step_time_s=DT)
        run.clock.t += DT
        while isinstance(s := run.sync.tick(), RoundSummary):
            out.append(s)
            run.learners_adopt()
        if len(out) >= n:
            return out
    raise AssertionError(f"only {len(out)} of {n} rounds closed in {max_ticks} ticks of {DT}s: {s.reason}")


def test_one_huge_step_time_then_silence_does_not_stall_later_rounds(backend: Backend) -> None:
    """The forger's record is alone in round 1 (K = 1) and reports 1e300 s per step, then the
    forger falls silent. A first record gives no step-time sample (nothing observed bounds it), so
    the grace window and liveness follow the honest learners: rounds 2-5 close within a few
    ticks (one round waited 43,200 s of grace before), and the forger stops counting as live."""
    run = HostileRun(backend)
    key = run.contribution(changes={"info": {"step_time_s": 1e300}})
    run.clock.t += DT
    first = run.sync.tick()
    assert isinstance(first, RoundSummary) and [a.key for a in first.record.accepted] == [key]
    run.learners_adopt()
    later = drive(run, 4, max_ticks=20)
    assert [s.record.round for s in later[:4]] == [2, 3, 4, 5]
    step = run.sync.ema.get("step_s")
    assert step is not None and step <= DT  # the honest learners' observed pace, not the forger's day
    assert sum(s.record.stats["wait_s"] for s in later[:4]) <= 20 * DT
    run.clock.t += 60.0  # silence: max(5 s, 3 H step) later the forger is not live
    assert "evil" not in run.sync._live_learners(run.clock())
    assert set(HONEST) & {a.learner_id for s in later for a in s.record.accepted}


def _forged_steps(run: HostileRun) -> tuple[int, int, int]:
    """Counters the step bound of :func:`max_steps_since` admits right now for the next round, with
    tokens at the recipe's batch x context: (fragment, c_steps, c_tokens)."""
    p, v = run.next_fragment()
    sync = run.sync
    elapsed = run.clock() - sync.screen.base_seen_at_s(v)
    steps = max_steps_since(v, sync.round + 1, sync.config.inner_steps, elapsed_s=elapsed)
    assert steps > 1000 and elapsed / MIN_STEP_S > 1000
    per_step = sync.token_bounds.of("evil") if sync.token_bounds is not None else 512
    return p, steps, steps * per_step


def test_forged_counters_after_a_stall_get_only_what_observed_time_could_produce(backend: Backend) -> None:
    """The synchronizer stalls for 10 s; the forger then claims every step the step bound admits
    (10,000 more for the stall at 1 ms a step) with full batches. Its weight counts only the steps
    H + 4 x (time since its base was committed) / (the honest learners' observed step time) could
    produce, its share stays under the cap, and the claim is named in the commit's stats."""
    run = HostileRun(backend)
    drive(run, 6)
    run.clock.t += 10.0  # the synchronizer stalls (no polls, no learner steps on the clock)
    p, steps, tokens = _forged_steps(run)
    v = run.next_fragment()[1]
    base_seen = run.sync.screen.base_seen_at_s(v)
    key = run.contribution(changes={"c_steps": steps, "c_tokens": tokens})
    done = drive(run, 2)
    merged = [(s.record, a) for s in done for a in s.record.accepted if a.key == key]
    assert merged, f"the forged contribution was not merged: {run.rejection(key)}"
    record, forged = merged[0]
    # The forger was first listed at most one tick after the stall; the fastest honest step is DT.
    bound = run.sync.config.inner_steps + int(4.0 * (run.clock() - base_seen) / DT)
    assert forged.c_steps <= bound < steps // 50
    assert record.stats["steps_clipped"]["evil"] == {"claimed": steps, "weighed": forged.c_steps}
    honest = [a for a in record.accepted if a.learner_id in HONEST]
    if honest:  # the weight is what the clipped counters earn, and never above the cap
        assert forged.weight <= 0.9
        assert forged.weight < 0.99


def test_a_lone_forged_update_far_above_the_fragments_history_is_an_outlier(backend: Backend) -> None:
    """K = 1 and the forger alone in the round: its delta would set the fragment to chosen values
    (+35 everywhere). Compared with the fragment's recent merged update norms it is an outlier;
    the fragment keeps its value and the honest learners carry on."""
    run = HostileRun(backend)
    drive(run, 8)  # every fragment has a history of merged update norms
    p, v = run.next_fragment()
    before = {n: t.clone() for n, t in run.sync.fragments[p].items()}
    key = run.contribution(fill=-50.0)
    for _ in range(5):  # the forger's record is the only one for this round: K = 1 closes on it
        run.clock.t += DT
        if isinstance(s := run.sync.tick(), RoundSummary):
            break
    assert isinstance(s, RoundSummary)
    assert key not in {a.key for a in s.record.accepted}
    why = s.record.rejected[key]
    assert why.kind is RejectionKind.OUTLIER and "recent median update norm" in why.detail, why
    assert all(torch.equal(before[n], t) for n, t in run.sync.fragments[p].items())
    run.learners_adopt()
    drive(run, 3)


def test_a_lone_forged_update_on_a_fragment_without_history_is_an_outlier_against_the_run(backend: Backend) -> None:
    """The same forger on a fragment merged only once: its own history is too short, so the guard
    compares with the run's recent update norms (other fragments', scaled to its size)."""
    run = HostileRun(backend)
    drive(run, 3)  # P = 2: the run has merged 3 rounds, the next fragment only once
    p, v = run.next_fragment()
    assert sum(1 for s in run.reader().history(1, run.sync.round) if s.fragment == p and s.updated) < 3
    before = {n: t.clone() for n, t in run.sync.fragments[p].items()}
    key = run.contribution(fill=-50.0)
    for _ in range(5):
        run.clock.t += DT
        if isinstance(s := run.sync.tick(), RoundSummary):
            break
    assert isinstance(s, RoundSummary)
    why = s.record.rejected[key]
    assert why.kind is RejectionKind.OUTLIER and "the run's scaled to its size" in why.detail, why
    assert all(torch.equal(before[n], t) for n, t in run.sync.fragments[p].items())


def _junk(run: HostileRun, count: int) -> str:
    p, v = run.next_fragment()
    prefix = paths.contributions_prefix(p, v, "evil")
    run.backend.pipe_many({f"{prefix}junk-{i:06d}.json": b'{"schema": "x"}' for i in range(count)})
    return prefix


def _small_and_readable(run: HostileRun, records: list[CommitRecord]) -> None:
    for rec in records:
        data = run.commit_bytes(rec.round)
        assert len(data) < 64 * 1024, f"round {rec.round}: {len(data)} bytes"
        evil = [k for k in rec.rejected if k.startswith("learners/evil/")]
        assert len(evil) <= MAX_RECORDED_PER_LEARNER
    again = run.reader(fresh=True).history(records[0].round, records[-1].round)
    assert again == records


def test_tens_of_thousands_of_junk_records_keep_every_commit_small(backend: Backend) -> None:
    """20,000 tiny junk records in the forger's own prefix (612 on S3): the listing asks for LIST_LIMIT names
    (one request), reads the newest MAX_LISTED_PER_PREFIX and counts the rest, the commit lists a few rejections per learner and
    counts the rest by kind, so every commit (and a restarted synchronizer's) stays small and
    readable, and honest learners are still merged."""
    junk = 20_000 if backend.local else LIST_LIMIT + 100  # S3: past one LIST page of ours, in moto's time
    run = HostileRun(backend)
    drive(run, 2)
    _junk(run, junk)
    done = drive(run, 3)
    records = [s.record for s in done]
    _small_and_readable(run, records)
    hit = next(r for r in records if "listing_skipped" in r.stats)
    assert hit.stats["listing_skipped"] == {"evil": LIST_LIMIT - MAX_LISTED_PER_PREFIX}
    assert hit.stats["rejected_unlisted"]["by_learner"]["evil"] == {"schema": MAX_LISTED_PER_PREFIX
                                                                    - MAX_RECORDED_PER_LEARNER}
    assert set(HONEST) & {a.learner_id for r in records for a in r.accepted}
    run.sync = run.new_synchronizer(fresh=True)  # a restarted synchronizer meets the same junk
    _junk(run, junk)
    again = drive(run, 3)
    _small_and_readable(run, [s.record for s in again])


def _forged_alongside_honest(run: HostileRun, *, stall_s: float) -> tuple[RoundSummary, str, int]:
    """The synchronizer stalls ``stall_s``, then the forger claims every step the step bound admits
    (full batches) for the next round while the honest learners publish theirs; the round that
    merges it, the forged key, and the claimed steps."""
    run.clock.t += stall_s
    p, steps, tokens = _forged_steps(run)
    key = run.contribution(changes={"c_steps": steps, "c_tokens": tokens, "info": {"step_time_s": 1e-9}})
    for s in drive(run, 2):
        if key in {a.key for a in s.record.accepted}:
            return s, key, steps
    raise AssertionError(f"the forged contribution was not merged: {run.rejection(key)}")


def _forgers_share(record: CommitRecord, key: str) -> tuple[int, float, int]:
    """The forged contribution's weighed steps, its share, and the round's contributions."""
    forged = next(a for a in record.accepted if a.key == key)
    return forged.c_steps, forged.weight, len(record.accepted)


def test_forged_counters_in_a_new_runs_first_round_count_at_most_the_prior(backend: Backend) -> None:
    """Nothing has been observed yet (a new run): the forger's claim of every step the step bound
    admits after a 30 s stall counts for at most the prior UNOBSERVED_INTERVALS x H steps, and with honest learners
    in the round it carries at most 0.9 of the round's steps (the rules before counted it in
    full: 0.999 of the round)."""
    run = HostileRun(backend)
    s, key, claimed = _forged_alongside_honest(run, stall_s=30.0)
    steps, share, n = _forgers_share(s.record, key)
    h = run.sync.config.inner_steps
    assert steps <= UNOBSERVED_INTERVALS * h < claimed
    assert s.record.stats["steps_clipped"]["evil"]["claimed"] == claimed
    if n > 1:
        assert share <= 0.9 + 1e-12


def test_a_restarted_synchronizer_reads_back_what_it_observed(backend: Backend) -> None:
    """Every commit names the fastest step times its synchronizer observed; a synchronizer
    restarted on a fresh handle reads them back, so the forger's claim in its first round is
    bounded by the honest learners' pace from the start (H + 4 x elapsed / their step time),
    not left unbounded until it has seen another learner twice."""
    run = HostileRun(backend)
    done = drive(run, 6)
    observed = done[-1].record.stats["observed_step_s"]
    assert set(observed) <= {*HONEST, "evil"} and set(HONEST) & set(observed)
    assert all(0 < t <= DT for t in observed.values())
    run.sync = run.new_synchronizer(fresh=True)
    assert run.sync.screen.observed.fastest_other("evil") == min(observed[h] for h in HONEST if h in observed)
    started = run.clock()
    s, key, claimed = _forged_alongside_honest(run, stall_s=10.0)
    steps, share, n = _forgers_share(s.record, key)
    bound = run.sync.config.inner_steps + int(4.0 * (run.clock() - started) / min(observed.values()))
    assert steps <= bound < claimed
    if n > 1:
        assert share <= 0.9 + 1e-12
