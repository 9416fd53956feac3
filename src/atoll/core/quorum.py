"""Quorum and adaptive grace window: when does an outer round close?

The decision is a pure function of the clock and what has arrived (torchft style): the caller
passes ``now_s`` and gets back a :class:`QuorumDecision` that says whether to close now or when
to look again, which contributions are in, which are out and why, and one human-readable line.
Nothing here sleeps, reads a clock or touches storage, so the real synchronizer and the fleet
simulator make exactly the same decisions.

Grace window (paper Eq. 3)::

    slack = tau * steps_between_rounds * xi_step - (xi_quorum + xi_sync)
    grace = max(0, gamma * slack)

``xi_*`` are exponential moving averages (:class:`TimingEma`) of the measured inner-step time,
time from round open to quorum, and time to merge+publish. When H > P the rounds for two
fragments are ``H / P`` inner steps apart, so the slack counts those steps instead of one.

Round pacing (``QuorumPolicy.pace_steps``, off by default): with K = 1 every arrival can close a
round, and each merged contribution then carries only the few steps its learner ran since it
last adopted the fragment. Pacing holds a quorate round until its valid contributions carry
``pace_steps`` inner steps per live learner (their ``c_steps``, summed), bounded so that a fleet
that cannot supply the work does not stall the run: the target counts only live learners, and
the hold ends ``pace_steps * xi_step`` after the round opened (or at ``max_wait_s``). The grace
window then runs from the later of quorum and that instant. See :func:`decide_round`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.weights import unweighable

__all__ = [
    "Arrival",
    "QuorumDecision",
    "QuorumPolicy",
    "TimingEma",
    "TimingEstimates",
    "bounded_step_sample",
    "decide_round",
    "grace_window_s",
    "pace_until_s",
    "publication_steps",
]


@dataclass(frozen=True, kw_only=True)
class QuorumPolicy:
    """The knobs of the quorum/grace decision."""

    min_quorum: int = 1
    """K: the round never closes with fewer accepted contributions than this."""

    grace_factor: float = 0.5
    """gamma in [0, 1): the fraction of the slack spent waiting for more learners after quorum."""

    overlap_steps: int = 2
    """tau: inner steps a learner keeps computing before it needs the merged fragment."""

    steps_between_rounds: float = 1.0
    """Inner steps between two consecutive rounds (H / P); 1 when H = P."""

    initial_grace_s: float = 0.0
    """Grace used before any inner-step time has been measured (the EMA is empty)."""

    poll_interval_s: float = 1.0
    """Longest time the caller should sleep before asking again while the round is open."""

    max_wait_s: float | None = None
    """If set, close once this long after the round opened with whatever valid contributions
    arrived (at least one); None waits for quorum indefinitely."""

    pace_steps: float = 0.0
    """Round pacing: inner steps of new work per live learner a quorate round waits for (the
    valid contributions' ``c_steps``, summed, against ``pace_steps`` x live learners), for at
    most ``pace_steps`` estimated step times after the round opened; 0 turns pacing off."""

    def __post_init__(self) -> None:
        if not isinstance(self.min_quorum, int) or self.min_quorum < 1:
            raise ValueError(f"min_quorum (K) must be an integer >= 1, got {self.min_quorum!r}")
        if not (0.0 <= self.grace_factor < 1.0):
            raise ValueError(f"grace_factor (gamma) must be in [0, 1), got {self.grace_factor!r}")
        if not isinstance(self.overlap_steps, int) or self.overlap_steps < 0:
            raise ValueError(f"overlap_steps (tau) must be an integer >= 0, got {self.overlap_steps!r}")
        if not (self.steps_between_rounds > 0 and math.isfinite(self.steps_between_rounds)):
            raise ValueError(
                f"steps_between_rounds must be a finite number > 0, got {self.steps_between_rounds!r}"
            )
        if not (self.initial_grace_s >= 0 and math.isfinite(self.initial_grace_s)):
            raise ValueError(f"initial_grace_s must be finite and >= 0, got {self.initial_grace_s!r}")
        if not (self.poll_interval_s > 0 and math.isfinite(self.poll_interval_s)):
            raise ValueError(f"poll_interval_s must be finite and > 0, got {self.poll_interval_s!r}")
        if self.max_wait_s is not None and not (self.max_wait_s > 0):
            raise ValueError(f"max_wait_s must be > 0 or None, got {self.max_wait_s!r}")
        if not (self.pace_steps >= 0 and math.isfinite(self.pace_steps)):
            raise ValueError(f"pace_steps must be finite and >= 0, got {self.pace_steps!r}")


@dataclass(frozen=True, kw_only=True)
class TimingEstimates:
    """Current EMA estimates in seconds; None means nothing measured yet."""

    step_s: float | None = None
    """xi_step: one inner step of a learner."""

    quorum_s: float | None = None
    """xi_quorum: round open -> K-th contribution."""

    sync_s: float | None = None
    """xi_sync: merge + outer step + publish."""


class TimingEma:
    """Exponential moving averages of xi_step, xi_quorum and xi_sync.

    ``value <- decay * value + (1 - decay) * sample``; the first sample initialises the value so
    the estimate is not biased towards zero. Round-trips through a JSON-able dict so the
    synchronizer's estimates survive a restart (they live in the bucket, not in Prefect).
    """

    NAMES = ("step_s", "quorum_s", "sync_s")

    def __init__(self, decay: float = 0.9, values: Mapping[str, float | None] | None = None) -> None:
        if not (0.0 <= decay < 1.0):
            raise ValueError(f"ema_decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self._values: dict[str, float | None] = {n: None for n in self.NAMES}
        for name, value in (values or {}).items():
            self._check_name(name)
            self._values[name] = None if value is None else float(value)

    def _check_name(self, name: str) -> None:
        if name not in self.NAMES:
            raise KeyError(f"unknown timing {name!r}; expected one of {self.NAMES}")

    def update(self, name: str, sample_s: float) -> float:
        """Fold one measurement (seconds, finite, >= 0) into the named average; returns it."""
        self._check_name(name)
        if not (math.isfinite(sample_s) and sample_s >= 0):
            raise ValueError(f"timing sample for {name} must be finite and >= 0, got {sample_s!r}")
        old = self._values[name]
        new = float(sample_s) if old is None else self.decay * old + (1.0 - self.decay) * sample_s
        self._values[name] = new
        return new

    def get(self, name: str) -> float | None:
        self._check_name(name)
        return self._values[name]

    def estimates(self) -> TimingEstimates:
        return TimingEstimates(**self._values)

    def to_dict(self) -> dict[str, float | None]:
        return {"decay": self.decay, **self._values}

    @classmethod
    def from_dict(cls, data: Mapping[str, float | None]) -> TimingEma:
        data = dict(data)
        decay = data.pop("decay", 0.9)
        return cls(decay=float(decay if decay is not None else 0.9), values=data)


def grace_window_s(policy: QuorumPolicy, timings: TimingEstimates) -> float:
    """Paper Eq. 3: ``max(0, gamma * (tau * steps_between_rounds * xi_step - xi_quorum - xi_sync))``.

    Before the step time is known the policy's ``initial_grace_s`` is used. Unknown quorum or
    sync times count as zero.
    """
    if timings.step_s is None:
        return policy.initial_grace_s
    slack = (
        policy.overlap_steps * policy.steps_between_rounds * timings.step_s
        - (timings.quorum_s or 0.0)
        - (timings.sync_s or 0.0)
    )
    return max(0.0, policy.grace_factor * slack)


def pace_until_s(policy: QuorumPolicy, opened_at_s: float, step_s: float | None) -> float | None:
    """When round pacing stops holding a round that opened at ``opened_at_s``, whatever work has
    arrived: ``pace_steps`` step times (``xi_step``) after it opened, or ``max_wait_s`` after it
    if that is sooner. None: no time bound (pacing off, or no step time measured and no
    ``max_wait_s``; the hold is then bounded by the live learners alone)."""
    if policy.pace_steps <= 0:
        return None
    ends = []
    if step_s is not None:
        ends.append(opened_at_s + policy.pace_steps * step_s)
    if policy.max_wait_s is not None:
        ends.append(opened_at_s + policy.max_wait_s)
    return min(ends) if ends else None


def publication_steps(offsets: Sequence[int], from_fragment: int, to_fragment: int, inner_steps: int) -> int:
    """Inner steps an honest learner runs between publishing ``from_fragment`` and publishing
    ``to_fragment`` next (the schedule's offsets t_p: ``(t_to - t_from) mod H``, a whole H when it
    is the same slot). A learner that skipped publishes ran more, never fewer: dividing the time
    between the two arrivals by this gives an upper bound on its step time."""
    gap = (int(offsets[to_fragment]) - int(offsets[from_fragment])) % int(inner_steps)
    return gap if gap > 0 else int(inner_steps)


def bounded_step_sample(reported_s: float | None, observed_s: float | None) -> float | None:
    """One learner's step-time sample for xi_step: its own report only as a hint inside what the
    synchronizer observed of it (the time between two of its records arriving, per inner step
    the schedule puts between them). No observation yet (a learner's first record since this
    synchronizer started) gives no sample, whatever it reports. No report gives no sample either:
    the observation alone overstates the step time whenever rounds, not learners, set the pace
    (records wait to be listed until their fragment's round opens)."""
    if observed_s is None or reported_s is None or not (observed_s >= 0 and math.isfinite(observed_s)):
        return None
    return min(reported_s, observed_s)


@dataclass(frozen=True, kw_only=True)
class Arrival:
    """One contribution as the synchronizer sees it (no tensors, just the facts it decides on)."""

    learner_id: str
    """Who sent it."""

    arrived_at_s: float
    """When the synchronizer first saw it, on the same clock as ``now_s``."""

    c_steps: int
    """Inner steps since the learner last aligned this fragment."""

    c_tokens: int
    """Tokens since the learner last aligned this fragment."""

    key: str = ""
    """Opaque id of the contribution (e.g. its record path), carried through to the decision."""


@dataclass(frozen=True)
class QuorumDecision:
    """What :func:`decide_round` concluded at ``now_s``."""

    close: bool
    """True: merge ``accepted`` now. False: look again at ``recheck_at_s``."""

    accepted: tuple[Arrival, ...]
    """Contributions to merge (only meaningful when ``close``), in arrival order."""

    rejected: tuple[tuple[Arrival, Rejection], ...]
    """Contributions that will not be merged in this round, each with its typed reason (only
    ``RejectionKind.LATE`` is not final)."""

    reason: str
    """One line for logs and the Prefect UI."""

    grace_s: float
    """The grace window the policy computed for this round."""

    quorum_at_s: float | None
    """When the K-th valid contribution arrived (None if quorum not reached)."""

    close_at_s: float | None
    """When the round closes (or closed) by the grace rule; None before quorum (and while round
    pacing holds it)."""

    recheck_at_s: float | None = None
    """When to call again if not closing now."""

    waiting_for: tuple[str, ...] = field(default=())
    """Live learners that have not contributed yet."""

    paced_at_s: float | None = None
    """Round pacing on: when it let the round go (the valid contributions first carried the work
    target, or the hold's time bound passed); None when pacing is off or still holding."""


def _validate(arrivals: Iterable[Arrival]) -> tuple[list[Arrival], list[tuple[Arrival, Rejection]]]:
    """Drop zero-step and duplicate contributions, with reasons; keep arrival order."""
    valid: list[Arrival] = []
    rejected: list[tuple[Arrival, Rejection]] = []
    seen: set[str] = set()
    for a in sorted(arrivals, key=lambda a: (a.arrived_at_s, a.learner_id, a.key)):
        why = unweighable(a.c_steps, a.c_tokens)
        if why is not None:
            rejected.append((a, why))
        elif a.learner_id in seen:
            rejected.append((a, Rejection(RejectionKind.DUPLICATE,
                                          "an earlier contribution from this learner is in the round")))
        else:
            seen.add(a.learner_id)
            valid.append(a)
    return valid, rejected


@dataclass(frozen=True)
class _RoundView:
    """What every rule of :func:`decide_round` looks at: the clock, who is live, what is valid."""

    now_s: float
    opened_at_s: float
    live: frozenset[str]
    policy: QuorumPolicy
    grace_s: float
    valid: tuple[Arrival, ...]
    """Valid contributions, in arrival order."""

    rejected: tuple[tuple[Arrival, Rejection], ...]
    """Contributions rule 1 turned away."""

    pace_until_s: float | None = None
    """Round pacing: when the hold ends whatever has arrived (:func:`pace_until_s`)."""

    @property
    def waiting(self) -> tuple[str, ...]:
        """Live learners with no valid contribution yet."""
        return tuple(sorted(self.live - {a.learner_id for a in self.valid}))

    @property
    def pace_target(self) -> float:
        """Round pacing's work target: ``pace_steps`` inner steps per live learner (0: no hold)."""
        return self.policy.pace_steps * len(self.live)

    def work_by(self, t_s: float) -> int:
        """Inner steps the valid contributions that arrived by ``t_s`` carry."""
        return sum(a.c_steps for a in self.valid if a.arrived_at_s <= t_s)


@dataclass(frozen=True)
class _Pace:
    """Round pacing's release: when, and why, it stopped holding the round."""

    at_s: float
    """The instant (``-inf`` when there was nothing to hold for)."""

    by: str
    """'off' (pacing off), 'nobody' (no live learner), 'work' (the target was met) or 'bound'."""


def _pace(r: _RoundView) -> _Pace | None:
    """Rule 4 (pacing): when the valid contributions, in arrival order, first carried the work
    target, or the hold's time bound if that passed first; None while the round is held."""
    if r.policy.pace_steps <= 0 or not r.live:
        return _Pace(-math.inf, "off" if r.policy.pace_steps <= 0 else "nobody")
    work, met_at = 0, None
    for a in r.valid:
        work += a.c_steps
        if work >= r.pace_target:
            met_at = a.arrived_at_s
            break
    bound = r.pace_until_s if r.pace_until_s is not None and r.now_s >= r.pace_until_s else None
    if bound is not None and (met_at is None or bound < met_at):
        return _Pace(bound, "bound")
    return _Pace(met_at, "work") if met_at is not None else None


@dataclass(frozen=True)
class _Quorum:
    """The grace rule's cut once K valid contributions (and, with pacing, the work) are in."""

    quorum_at_s: float
    """When the K-th valid contribution arrived."""

    pace: _Pace
    """When round pacing let the round go."""

    close_at_s: float
    """``max(quorum_at_s, pace.at_s) + grace``: the instant the round closes by the grace rule."""

    in_window: tuple[Arrival, ...]
    """Valid contributions that arrived by ``close_at_s``."""

    late: tuple[Arrival, ...]
    """Valid contributions that arrived after it."""

    @property
    def ready_at_s(self) -> float:
        """Where the grace window starts: quorum, or pacing's release if later."""
        return max(self.quorum_at_s, self.pace.at_s)

    @property
    def paced_at_s(self) -> float | None:
        return self.pace.at_s if self.pace.by in ("work", "bound") else None

    def rejected(self, r: _RoundView) -> tuple[tuple[Arrival, Rejection], ...]:
        """Rule 1's rejections and the late ones, each late one with how late it was."""
        return r.rejected + tuple((a, _late_reason(a, self.close_at_s)) for a in self.late)


def decide_round(
    *,
    now_s: float,
    opened_at_s: float,
    arrivals: Sequence[Arrival],
    live_learners: Iterable[str],
    policy: QuorumPolicy,
    timings: TimingEstimates,
) -> QuorumDecision:
    """Decide whether the round that opened at ``opened_at_s`` closes at ``now_s``.

    Rules, in order:

    1. Contributions with no steps/tokens and second contributions from one learner are rejected.
    2. Fewer than K valid contributions: stay open (unless ``max_wait_s`` has passed and at least
       one is valid). The round never closes below K otherwise.
    3. Round pacing (``pace_steps`` > 0): K is met, but the valid contributions carry fewer than
       ``pace_steps`` x (live learners) inner steps: stay open, until the work arrives or the hold
       ends ``pace_steps`` step times after the round opened (:func:`pace_until_s`). No live
       learner: no hold. The round is *ready* at the later of quorum and pacing's release.
    4. Every live learner has contributed, and the round is ready: close now, no need to wait
       for grace.
    5. Ready at ``t_r`` (the K-th valid arrival, or pacing's release): the round closes at
       ``t_r + grace``; contributions that arrived after that instant are rejected as late even
       if the caller polled late, so the outcome does not depend on polling jitter.
    """
    valid, rejected = _validate(arrivals)
    r = _RoundView(now_s=now_s, opened_at_s=opened_at_s, live=frozenset(live_learners), policy=policy,
                   grace_s=grace_window_s(policy, timings), valid=tuple(valid), rejected=tuple(rejected),
                   pace_until_s=pace_until_s(policy, opened_at_s, timings.step_s))
    if len(r.valid) < policy.min_quorum:
        return _below_quorum(r)
    pace = _pace(r)
    if pace is None:
        return _wait_for_work(r)
    q = _quorum(r, pace)
    if r.live and r.live <= {a.learner_id for a in q.in_window}:
        return _close_early(r, q)
    if now_s >= q.close_at_s:
        return _close_after_grace(r, q)
    return _wait_in_grace(r, q)


def _below_quorum(r: _RoundView) -> QuorumDecision:
    """Rule 2: wait for K valid contributions, or close with what is valid once ``max_wait_s`` passed."""
    policy, k = r.policy, r.policy.min_quorum
    waited = r.now_s - r.opened_at_s
    if policy.max_wait_s is not None and waited >= policy.max_wait_s and r.valid:
        return QuorumDecision(
            close=True,
            accepted=r.valid,
            rejected=r.rejected,
            reason=(
                f"deadline: {waited:.1f}s >= max_wait_s={policy.max_wait_s:g}s with "
                f"{len(r.valid)}/{k} contributions; closing below quorum"
            ),
            grace_s=r.grace_s,
            quorum_at_s=None,
            close_at_s=r.now_s,
            waiting_for=r.waiting,
        )
    recheck = r.now_s + policy.poll_interval_s
    if policy.max_wait_s is not None and r.valid:
        recheck = min(recheck, max(r.now_s, r.opened_at_s + policy.max_wait_s))
    note = "" if len(r.live) >= k else f"; only {len(r.live)} live learner(s) for K={k}"
    return QuorumDecision(
        close=False,
        accepted=(),
        rejected=r.rejected,
        reason=f"waiting for quorum: {len(r.valid)}/{k} contributions{note}",
        grace_s=r.grace_s,
        quorum_at_s=None,
        close_at_s=None,
        recheck_at_s=recheck,
        waiting_for=r.waiting,
    )


def _wait_for_work(r: _RoundView) -> QuorumDecision:
    """Rule 3: quorum is in but not the work; look again at the next poll, or when the hold ends."""
    k = r.policy.min_quorum
    recheck = r.now_s + r.policy.poll_interval_s
    if r.pace_until_s is not None:
        recheck = min(recheck, r.pace_until_s)
        bound = f"for {r.pace_until_s - r.now_s:.2f}s more at most"
    else:
        bound = "while the live learners can add work (no step time measured yet)"
    return QuorumDecision(
        close=False,
        accepted=(),
        rejected=r.rejected,
        reason=(
            f"pacing: quorum {k} met ({len(r.valid)} in) with {r.work_by(r.now_s)}/{r.pace_target:g} inner steps "
            f"of new work ({r.policy.pace_steps:g} per live learner, {len(r.live)} live); holding {bound}"
        ),
        grace_s=r.grace_s,
        quorum_at_s=r.valid[k - 1].arrived_at_s,
        close_at_s=None,
        recheck_at_s=recheck,
        waiting_for=r.waiting,
    )


def _quorum(r: _RoundView, pace: _Pace) -> _Quorum:
    """Rule 5's cut: the later of the K-th valid arrival and pacing's release, plus the grace window."""
    quorum_at = r.valid[r.policy.min_quorum - 1].arrived_at_s
    close_at = max(quorum_at, pace.at_s) + r.grace_s
    return _Quorum(quorum_at_s=quorum_at, pace=pace, close_at_s=close_at,
                   in_window=tuple(a for a in r.valid if a.arrived_at_s <= close_at),
                   late=tuple(a for a in r.valid if a.arrived_at_s > close_at))


def _pace_note(r: _RoundView, q: _Quorum) -> str:
    """Why round pacing let the round go, for the decision's reason ('' when pacing is off)."""
    by, at = q.pace.by, q.pace.at_s - r.opened_at_s
    if by == "off":
        return ""
    if by == "nobody":
        return "; pacing: no live learner to wait for"
    work = f"{r.work_by(q.pace.at_s)}/{r.pace_target:g} inner steps of new work"
    if by == "work":
        return f"; paced: {work} at +{at:.2f}s"
    return f"; pacing bound +{at:.2f}s passed with {work} (the live learners did not supply it in time)"


def _close_early(r: _RoundView, q: _Quorum) -> QuorumDecision:
    """Rule 4: nobody else is coming, waiting longer only wastes the slack."""
    return QuorumDecision(
        close=True,
        accepted=q.in_window,
        rejected=q.rejected(r),
        reason=f"every live learner contributed ({len(q.in_window)}/{len(r.live)}); closing early{_pace_note(r, q)}",
        grace_s=r.grace_s,
        quorum_at_s=q.quorum_at_s,
        close_at_s=min(q.close_at_s, max(q.ready_at_s, max(a.arrived_at_s for a in q.in_window))),
        waiting_for=(),
        paced_at_s=q.paced_at_s,
    )


def _close_after_grace(r: _RoundView, q: _Quorum) -> QuorumDecision:
    """Rule 5, the grace window is over: close with what arrived in it."""
    waiting = tuple(sorted(r.live - {a.learner_id for a in q.in_window}))
    return QuorumDecision(
        close=True,
        accepted=q.in_window,
        rejected=q.rejected(r),
        reason=(
            f"quorum {r.policy.min_quorum} reached at +{q.quorum_at_s - r.opened_at_s:.2f}s, "
            f"grace {r.grace_s:.2f}s over: {len(q.in_window)} in, {len(waiting)} live learner(s) not in time"
            f"{_pace_note(r, q)}"
        ),
        grace_s=r.grace_s,
        quorum_at_s=q.quorum_at_s,
        close_at_s=q.close_at_s,
        waiting_for=waiting,
        paced_at_s=q.paced_at_s,
    )


def _wait_in_grace(r: _RoundView, q: _Quorum) -> QuorumDecision:
    """Rule 5, the grace window is still open: look again when it ends (or at the next poll)."""
    return QuorumDecision(
        close=False,
        accepted=(),
        rejected=r.rejected,
        reason=(
            f"quorum {r.policy.min_quorum} reached ({len(r.valid)} in); grace window open for "
            f"{q.close_at_s - r.now_s:.2f}s more, waiting for {len(r.waiting)} live learner(s){_pace_note(r, q)}"
        ),
        grace_s=r.grace_s,
        quorum_at_s=q.quorum_at_s,
        close_at_s=q.close_at_s,
        recheck_at_s=min(q.close_at_s, r.now_s + r.policy.poll_interval_s),
        waiting_for=r.waiting,
        paced_at_s=q.paced_at_s,
    )


def _late_reason(a: Arrival, close_at_s: float) -> Rejection:
    return Rejection(RejectionKind.LATE, f"arrived {a.arrived_at_s - close_at_s:.2f}s after the grace window closed")
