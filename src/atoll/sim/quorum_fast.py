"""The quorum decision of :func:`atoll.core.quorum.decide_round`, without the bookkeeping.

``decide_round`` builds a :class:`~atoll.core.quorum.QuorumDecision` with reasons, waiting lists
and rejection messages for logs and the Prefect UI; that costs 25-50 µs a call and dominated the
simulator. :func:`decide_fast` applies the same rules (round pacing included) to the same inputs
and returns only what the simulator acts on. It is not a second policy:
tests/sim/test_quorum_fast.py checks, over random arrivals, timings and policies, that every field
it returns equals core's, and that a simulation run with either gives identical results.

Arrivals are plain tuples ``(arrived_at_s, learner_id, key, c_steps, c_tokens)``
(:func:`as_tuple` converts a core :class:`~atoll.core.quorum.Arrival`).
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from operator import itemgetter
from typing import NamedTuple

from atoll.core.quorum import Arrival, QuorumPolicy, pace_until_s

__all__ = ["FastArrival", "FastDecision", "as_tuple", "decide_fast"]

FastArrival = tuple[float, str, str, int, int]
"""``(arrived_at_s, learner_id, key, c_steps, c_tokens)``."""

_ORDER = itemgetter(0, 1, 2)  # core sorts by (arrived_at_s, learner_id, key), stably


class FastDecision(NamedTuple):
    """The fields of :class:`~atoll.core.quorum.QuorumDecision` that drive a simulation."""

    close: bool
    accepted: tuple[FastArrival, ...]
    """In core's order; empty unless ``close``."""
    rejected: tuple[FastArrival, ...]
    """Core's ``rejected`` without the reasons, in core's order."""
    quorum_at_s: float | None
    close_at_s: float | None
    recheck_at_s: float | None
    paced_at_s: float | None = None
    """Round pacing on: when it let the round go; None when off or still holding."""


def as_tuple(a: Arrival) -> FastArrival:
    return (a.arrived_at_s, a.learner_id, a.key, a.c_steps, a.c_tokens)


def decide_fast(
    now_s: float,
    opened_at_s: float,
    arrivals: Sequence[FastArrival],
    live: AbstractSet[str],
    policy: QuorumPolicy,
    grace_s: float,
    step_s: float | None = None,
) -> FastDecision:
    """Core's decision for the round that opened at ``opened_at_s``, asked at ``now_s``.

    ``live`` is the set of live learner ids; ``grace_s`` is
    ``atoll.core.quorum.grace_window_s(policy, timings)`` and ``step_s`` is ``timings.step_s``
    (round pacing's time bound) for the timings core would be given.
    """
    valid, invalid = _split(arrivals)
    k = policy.min_quorum
    if len(valid) < k:
        return _below_quorum(now_s, opened_at_s, valid, invalid, policy)

    # Quorum met; with round pacing on, the round is also held until the work is in.
    quorum_at = valid[k - 1][0]
    ready_at = quorum_at
    paced_at = None
    if policy.pace_steps > 0 and live:
        until = pace_until_s(policy, opened_at_s, step_s)
        paced_at = _paced_at(now_s, valid, policy.pace_steps * len(live), until)
        if paced_at is None:
            recheck = now_s + policy.poll_interval_s
            return FastDecision(False, (), tuple(invalid), quorum_at, None,
                                recheck if until is None else min(recheck, until))
        ready_at = max(quorum_at, paced_at)
    # Then the grace window: close when every live learner is in, or at its end.
    close_at = ready_at + grace_s
    if valid[-1][0] <= close_at:  # nobody late (the common case)
        in_window, late = valid, []
    else:
        in_window = [a for a in valid if a[0] <= close_at]
        late = [a for a in valid if a[0] > close_at]
    if live and len(live) <= len(in_window) and live <= {a[1] for a in in_window}:
        return FastDecision(
            True,
            tuple(in_window),
            tuple(invalid) + tuple(late),
            quorum_at,
            min(close_at, max(ready_at, max(a[0] for a in in_window))),
            None,
            paced_at,
        )
    if now_s >= close_at:
        return FastDecision(True, tuple(in_window), tuple(invalid) + tuple(late), quorum_at, close_at, None, paced_at)
    return FastDecision(
        False, (), tuple(invalid), quorum_at, close_at, min(close_at, now_s + policy.poll_interval_s), paced_at
    )


def _split(arrivals: Sequence[FastArrival]) -> tuple[list[FastArrival], list[FastArrival]]:
    """Core's order, then ``(valid, invalid)``: an arrival without steps or tokens, or a second
    one of the same learner, is invalid."""
    if len(arrivals) > 1:
        arrivals = sorted(arrivals, key=_ORDER)
    valid: list[FastArrival] = []
    invalid: list[FastArrival] = []
    seen: set[str] = set()
    for a in arrivals:
        if a[3] <= 0 or a[4] <= 0 or a[1] in seen:
            invalid.append(a)
        else:
            seen.add(a[1])
            valid.append(a)
    return valid, invalid


def _below_quorum(now_s: float, opened_at_s: float, valid: list[FastArrival], invalid: list[FastArrival],
                  policy: QuorumPolicy) -> FastDecision:
    """Fewer than K valid: wait, unless ``max_wait_s`` has passed with at least one in."""
    max_wait = policy.max_wait_s
    if max_wait is not None and valid and now_s - opened_at_s >= max_wait:
        return FastDecision(True, tuple(valid), tuple(invalid), None, now_s, None)
    recheck = now_s + policy.poll_interval_s
    if max_wait is not None and valid:
        recheck = min(recheck, max(now_s, opened_at_s + max_wait))
    return FastDecision(False, (), tuple(invalid), None, None, recheck)


def _paced_at(now_s: float, valid: Sequence[FastArrival], target: float, until: float | None) -> float | None:
    """Core's round pacing release: the arrival whose steps met ``target``, or ``until`` if that
    passed first; None while the round is held."""
    work, met_at = 0, None
    for a in valid:
        work += a[3]
        if work >= target:
            met_at = a[0]
            break
    if until is not None and now_s >= until and (met_at is None or until < met_at):
        return until
    return met_at
