"""Decoupled DiLoCo on a simulated fleet: islands, learners, and the real quorum/grace policy.

**Islands.** The fleet is split into M islands, one learner each. Each island runs the elastic
mechanics of :func:`atoll.sim.fleet.elastic_schedule` on its own share of the failure trace: a
failure pauses only that island for ``reconfig_s`` while it re-forms its mesh without the failed
slice, it trains on the slices in service meanwhile, and a slice that is back is re-admitted by
the island's next reconfiguration (or one of its own after ``readmit_window_s``). The step in flight
resumes after a pause. So M = 1 is elastic DP, and M learners on N chips pay what elastic DP pays
on N / M chips.

**Learners.** Inner steps take ``step_s * speed * max(0.1, 1 + spread * z)`` seconds (z ~ N(0,1)).
After its step t a learner publishes fragment p when ``t mod H = t_p`` (t_p = floor(p H / P)). It
adopts the merged fragment τ steps later: before starting step ``t + τ + 1`` it needs the round its
contribution went into to have closed, plus ``sync_s`` for the result to reach it (streaming
overlap). With K < M and the paper's grace window that wait is rare; with K = M it is the lock-step
barrier, and that wait is lost chip-time.

**Synchronizer.** One stream of rounds per fragment. A contribution joins the open round of its
fragment, or opens one (contributions with an older base are re-anchored by the real protocol,
never dropped, so none is lost; a learner that missed a round simply lands in the next one). A round
closes exactly when :func:`atoll.core.quorum.decide_round` would say so. By default the simulator
asks :func:`atoll.sim.quorum_fast.decide_fast`, which returns core's decision without its log
strings (``quorum="core"`` calls ``decide_round`` itself; tests check both give identical runs).
It asks whenever the answer can change: at quorum, when every live learner is in, when a learner
pauses, and at the grace deadline it returned. The grace window comes from
:class:`atoll.core.quorum.TimingEma` fed with simulated step, quorum and sync times, as the real
synchronizer feeds it with measured ones.

**Outputs.** Goodput = chip-seconds spent computing inner steps / (N x horizon), at the island's
size at each moment (waiting at the τ barrier is not computing), so a fleet with no failures has
goodput 1 and M = 1 with K = 1 equals elastic DP; uptime = the fraction of time at least one island
computes; rounds per hour; merged contributions per round.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from atoll.core.quorum import (
    Arrival,
    QuorumPolicy,
    TimingEma,
    decide_round,
    grace_window_s,
)
from atoll.sim.fleet import (
    TIMELINE_BINS,
    CostModel,
    FailureTrace,
    Schedule,
    SystemResult,
    elastic_schedule,
)
from atoll.sim.quorum_fast import FastArrival, FastDecision, as_tuple, decide_fast

__all__ = ["DecoupledSetup", "Island", "equal_islands", "simulate_decoupled", "two_speed_islands"]

QuorumPath = Literal["fast", "core"]


@dataclass(frozen=True, kw_only=True)
class Island:
    """One learner's share of the fleet."""

    share: float
    """Fraction of the fleet's chips (the islands' shares sum to 1)."""

    speed: float = 1.0
    """Step-time multiplier: 1.18 = 18% slower."""


def equal_islands(m: int) -> tuple[Island, ...]:
    """M equal islands at speed 1."""
    if not (isinstance(m, int) and m >= 1):
        raise ValueError(f"number of islands M must be an integer >= 1, got {m!r}")
    return tuple(Island(share=1.0 / m) for _ in range(m))


def two_speed_islands(m: int, slow_factor: float = 1.18) -> tuple[Island, ...]:
    """Two halves of the fleet: islands ``0 .. m//2 - 1`` at speed 1, the rest ``slow_factor``."""
    if not (isinstance(m, int) and m >= 2):
        raise ValueError(f"the two-speed fleet needs an integer M >= 2, got {m!r}")
    return tuple(Island(share=1.0 / m, speed=1.0 if i < m // 2 else slow_factor) for i in range(m))


@dataclass(frozen=True, kw_only=True)
class DecoupledSetup:
    """Algorithm and timing knobs of a simulated Decoupled DiLoCo run."""

    islands: tuple[Island, ...]
    policy: QuorumPolicy
    """K, gamma, tau, H/P: from :meth:`atoll.core.config.DilocoConfig.quorum_policy` or direct."""

    num_fragments: int = 24
    """P."""

    inner_steps: int = 24
    """H (>= P)."""

    step_s: float = 1.0
    """Mean inner-step time of a speed-1 island."""

    step_spread: float = 0.0
    """Relative standard deviation of one step's time (0.10 = 10% noise)."""

    sync_s: float = 0.0
    """Merge + publish: a learner sees a round's result this long after it closes."""

    ema_decay: float = 0.9
    """Decay of the timing EMAs behind the grace window."""

    label: str | None = None
    """Name in tables; default ``decoupled M=<M>``."""

    def __post_init__(self) -> None:
        if not self.islands:
            raise ValueError("need at least one island")
        total = sum(i.share for i in self.islands)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"island shares must sum to 1, got {total}")
        if any(i.share <= 0 or i.speed <= 0 for i in self.islands):
            raise ValueError("island shares and speeds must be > 0")
        if not (1 <= self.num_fragments <= self.inner_steps):
            raise ValueError(f"need 1 <= P <= H, got P={self.num_fragments}, H={self.inner_steps}")
        if self.policy.overlap_steps >= self.inner_steps:
            raise ValueError(f"tau must be < H, got tau={self.policy.overlap_steps}, H={self.inner_steps}")
        if self.policy.min_quorum > len(self.islands):
            raise ValueError(f"K={self.policy.min_quorum} exceeds M={len(self.islands)}: rounds could never close")
        if not (self.step_s > 0 and math.isfinite(self.step_s)):
            raise ValueError(f"step_s must be finite and > 0, got {self.step_s!r}")
        if not (0 <= self.step_spread < 10):
            raise ValueError(f"step_spread must be in [0, 10), got {self.step_spread!r}")
        if not (self.sync_s >= 0 and math.isfinite(self.sync_s)):
            raise ValueError(f"sync_s must be finite and >= 0, got {self.sync_s!r}")

    @property
    def name(self) -> str:
        return self.label or f"decoupled M={len(self.islands)}"


# Event kinds. At equal times island pauses come first, so a step that would end at the very
# instant its island pauses is paused instead.
_PAUSE, _RESUME, _STEP, _RECHECK, _START = 0, 1, 2, 3, 4


@dataclass
class _Round:
    serial: int
    opened_at: float = 0.0
    arrivals: list[FastArrival] = field(default_factory=list)
    members: set[str] = field(default_factory=set)
    deadline_at: float | None = None


class _Sim:
    def __init__(
        self, trace: FailureTrace, costs: CostModel, setup: DecoupledSetup, seed: int, quorum: QuorumPath
    ) -> None:
        if quorum not in ("fast", "core"):
            raise ValueError(f"quorum must be 'fast' or 'core', got {quorum!r}")
        self.trace, self.costs, self.setup = trace, costs, setup
        self.quorum = quorum
        self.T = trace.horizon_s
        M = self.M = len(setup.islands)
        self.chips = [i.share * trace.chips for i in setup.islands]
        self.mean_step = [setup.step_s * i.speed for i in setup.islands]
        self.rng = np.random.default_rng(seed)
        self.noise: list[list[float]] = [[] for _ in range(M)]
        self._init_schedule(setup)
        self._init_islands(trace, costs, setup)
        self._init_learners(M)
        self._init_synchronizer(M)

    def _init_schedule(self, setup: DecoupledSetup) -> None:
        """H, P, tau, K, which fragment each inner step publishes, and the grace window's EMA."""
        self.H, self.P = setup.inner_steps, setup.num_fragments
        self.tau = setup.policy.overlap_steps
        self.K = setup.policy.min_quorum
        self.policy = setup.policy
        frag_at: list[int | None] = [None] * self.H
        for p in range(self.P):
            frag_at[(p * self.H) // self.P] = p
        self.frag_at = frag_at
        self.ids = [f"L{m}" for m in range(self.M)]
        self.index = {lid: m for m, lid in enumerate(self.ids)}
        self.ema = TimingEma(decay=setup.ema_decay)
        self.ema.update("step_s", setup.step_s)  # the nominal step time is known up front
        self.grace = grace_window_s(self.policy, self.ema.estimates())

    def _init_islands(self, trace: FailureTrace, costs: CostModel, setup: DecoupledSetup) -> None:
        """The islands' elastic schedules, computed up front from their share of the trace."""
        bounds = np.concatenate([[0.0], np.cumsum([i.share for i in setup.islands])])
        bounds[-1] = np.inf
        self.schedules: list[Schedule] = []
        for m in range(self.M):
            tr = trace.in_range(bounds[m], bounds[m + 1])
            self.schedules.append(elastic_schedule(tr.times_s, tr.recovery_s, self.T, self.chips[m], costs))
        self.seg = [-1] * self.M  # index of the island's current (or last) training interval

    def _init_learners(self, M: int) -> None:
        """Each learner: up or not, computing or blocked, its steps, the step in flight, its gates."""
        self.up = [False] * M  # island training (not reconfiguring) on > 0 chips
        self.live: set[str] = set()  # ids of the learners that are up
        self.active = [False] * M  # computing (up, not blocked)
        self.avail = [0.0] * M  # chips in service
        self.k = [0] * M  # steps completed
        self.work = 0.0  # chip-seconds spent computing
        self.since = [0.0] * M  # start of the current computing stretch
        self.running = [False] * M
        self.step_end = [0.0] * M
        self.remaining = [0.0] * M  # paused step: seconds left
        self.token = [0] * M
        self.last_pub_k = [[0] * self.P for _ in range(M)]
        self.gates: list[list[tuple[int, int, int]]] = [[] for _ in range(M)]  # (step, p, serial)
        self.blocked = [False] * M

    def _init_synchronizer(self, M: int) -> None:
        """One stream of rounds per fragment, the releases learners wait on, the accounting, the event heap."""
        self.rounds = [_Round(0) for _ in range(self.P)]
        self.release: dict[tuple[int, int], float] = {}
        self.waiters: dict[tuple[int, int], list[int]] = {}
        # accounting
        self.rounds_closed = 0
        self.merged = 0
        self.blocked_chip_s = 0.0
        self.blocked_since = [0.0] * M
        self.activity: list[tuple[float, float]] = []
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0

    # -- plumbing ------------------------------------------------------------------------
    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, a, b))

    def draw(self, m: int) -> float:
        s = self.setup.step_spread
        if s == 0:
            return self.mean_step[m]
        buf = self.noise[m]
        if not buf:
            buf.extend(np.maximum(0.1, 1.0 + s * self.rng.standard_normal(4096)).tolist())
        return self.mean_step[m] * buf.pop()

    def set_active(self, t: float, m: int, on: bool) -> None:
        if on != self.active[m]:
            if on:
                self.since[m] = t
            else:
                self.work += (t - self.since[m]) * self.avail[m]
            self.activity.append((t, self.avail[m] if on else -self.avail[m]))
            self.active[m] = on

    def block(self, t: float, m: int) -> None:
        if not self.blocked[m]:
            self.blocked[m] = True
            self.blocked_since[m] = t
            self.set_active(t, m, False)

    def unblock(self, t: float, m: int) -> None:
        if self.blocked[m]:
            self.blocked[m] = False
            self.blocked_chip_s += (t - self.blocked_since[m]) * self.avail[m]

    # -- learner -------------------------------------------------------------------------
    def try_start(self, t: float, m: int) -> None:
        """Start (or resume) the next step at t unless a round the learner needs is still open."""
        if not self.up[m] or self.running[m]:
            return
        g = self.gates[m]
        while g and g[0][0] <= self.k[m]:
            _, p, serial = g[0]
            rel = self.release.get((p, serial))
            if rel is None:
                self.waiters.setdefault((p, serial), []).append(m)
                self.block(t, m)
                return
            if rel > t:
                self.push(rel, _START, m)
                self.block(t, m)
                return
            g.pop(0)
        self.unblock(t, m)
        self.set_active(t, m, True)
        if self.remaining[m] > 0:
            d = self.remaining[m]
            self.remaining[m] = 0.0
        else:
            d = self.draw(m)
        self.running[m] = True
        self.step_end[m] = t + d
        self.push(t + d, _STEP, m, self.token[m])

    def step_done(self, t: float, m: int) -> None:
        self.running[m] = False
        step = self.k[m]
        self.k[m] += 1
        p = self.frag_at[step % self.H]
        if p is not None:
            self.publish(t, m, p)
        self.try_start(t, m)
        if not self.running[m]:
            self.set_active(t, m, False)

    def publish(self, t: float, m: int, p: int) -> None:
        rnd = self.rounds[p]
        if not rnd.arrivals:
            rnd.opened_at = t  # a fragment's round opens with its first contribution
        c_steps = self.k[m] - self.last_pub_k[m][p]
        self.last_pub_k[m][p] = self.k[m]
        lid = self.ids[m]
        rnd.arrivals.append((t, lid, f"{p}/{rnd.serial}/{m}", c_steps, c_steps))
        rnd.members.add(lid)
        self.gates[m].append((self.k[m] + self.tau, p, rnd.serial))
        self.evaluate(t, p)

    # -- synchronizer --------------------------------------------------------------------
    def decide(self, t: float, rnd: _Round) -> FastDecision:
        if self.quorum == "fast":
            return decide_fast(t, rnd.opened_at, rnd.arrivals, self.live, self.policy, self.grace,
                               self.ema.get("step_s"))
        d = decide_round(
            now_s=t,
            opened_at_s=rnd.opened_at,
            arrivals=[Arrival(learner_id=a[1], arrived_at_s=a[0], key=a[2], c_steps=a[3], c_tokens=a[4]) for a in rnd.arrivals],
            live_learners=[self.ids[m] for m in range(self.M) if self.up[m]],
            policy=self.policy,
            timings=self.ema.estimates(),
        )
        return FastDecision(
            d.close,
            tuple(as_tuple(a) for a in d.accepted),
            tuple(as_tuple(a) for a, _ in d.rejected),
            d.quorum_at_s,
            d.close_at_s,
            d.recheck_at_s,
            d.paced_at_s,
        )

    def evaluate(self, t: float, p: int, *, deadline: bool = False) -> None:
        """Ask for fragment p's open round's decision when its answer can change."""
        rnd = self.rounds[p]
        if len(rnd.arrivals) < self.K and self.policy.max_wait_s is None:
            return  # below quorum with no deadline: the answer is "wait" until the next arrival
        everyone = self.live <= rnd.members
        # with round pacing, any arrival may bring the work that releases the round
        if not (deadline or everyone or rnd.deadline_at is None or self.policy.pace_steps > 0):
            return
        dec = self.decide(t, rnd)
        if dec.close:
            self.close(t, p, dec)
            return
        nxt = dec.close_at_s if dec.close_at_s is not None else dec.recheck_at_s
        if nxt is not None and (deadline or rnd.deadline_at is None or nxt < rnd.deadline_at):
            # "look again at t" without closing happens when now - opened is a rounding hair under
            # max_wait_s: look again one float later, so simulated time moves on
            rnd.deadline_at = nxt if nxt > t else math.nextafter(t, math.inf)
            self.push(rnd.deadline_at, _RECHECK, p, rnd.serial)

    def close(self, t: float, p: int, dec: FastDecision) -> None:
        rnd = self.rounds[p]
        self.merged += len(dec.accepted)
        if dec.quorum_at_s is not None:
            self.ema.update("quorum_s", max(0.0, dec.quorum_at_s - rnd.opened_at))
        self.ema.update("sync_s", self.setup.sync_s)
        self.grace = grace_window_s(self.policy, self.ema.estimates())
        self.rounds_closed += 1
        key = (p, rnd.serial)
        rel = t + self.setup.sync_s
        self.release[key] = rel
        accepted = {a[1] for a in dec.accepted}
        # contributions the policy did not take stay pending: they open the next round of p
        leftover = [a for a in rnd.arrivals if a[1] not in accepted]
        self.rounds[p] = nxt = _Round(rnd.serial + 1, opened_at=t)
        for m in self.waiters.pop(key, []):
            if rel > t:
                self.push(rel, _START, m)
            else:
                self.try_start(t, m)
        if leftover:
            for a in leftover:
                m = self.index[a[1]]
                nxt.arrivals.append(a)
                nxt.members.add(a[1])
                self.gates[m] = [(s, q, nxt.serial if (q, sr) == key else sr) for s, q, sr in self.gates[m]]
            self.evaluate(t, p)

    # -- islands -------------------------------------------------------------------------
    def pause(self, t: float, m: int) -> None:
        """Island m starts a reconfiguration."""
        sch = self.schedules[m]
        nxt = self.seg[m] + 1
        if nxt < len(sch.run_start):
            self.push(float(sch.run_start[nxt]), _RESUME, m)
        if not self.up[m]:
            return
        self.up[m] = False
        self.live.discard(self.ids[m])
        self.set_active(t, m, False)
        self.unblock(t, m)
        if self.running[m]:
            self.running[m] = False
            self.remaining[m] = max(0.0, self.step_end[m] - t)
            self.token[m] += 1
        for ws in self.waiters.values():
            if m in ws:
                ws.remove(m)
        for p in range(self.P):  # a smaller live set can complete a round early
            if self.rounds[p].arrivals:
                self.evaluate(t, p)

    def resume(self, t: float, m: int) -> None:
        """Island m trains again, on the chips its schedule says."""
        sch = self.schedules[m]
        i = self.seg[m] = self.seg[m] + 1
        end = float(sch.run_end[i])
        if end < self.T:
            self.push(end, _PAUSE, m)
        self.avail[m] = float(sch.run_chips[i])
        if self.avail[m] <= 0:
            return  # no slice in service: wait for the next reconfiguration
        self.up[m] = True
        self.live.add(self.ids[m])
        self.try_start(t, m)

    # -- main loop -----------------------------------------------------------------------
    def run(self) -> SystemResult:
        T, M = self.T, self.M
        for m in range(M):
            sch = self.schedules[m]
            if len(sch.run_start):
                self.push(float(sch.run_start[0]), _RESUME, m)
        heap, pop = self.heap, heapq.heappop
        while heap and heap[0][0] < T:
            t, kind, _, a, b = pop(heap)
            if kind == _STEP:
                if b == self.token[a]:
                    self.step_done(t, a)
            elif kind == _START:
                self.try_start(t, a)
            elif kind == _RECHECK:
                if self.rounds[a].serial == b:
                    self.evaluate(t, a, deadline=True)
            elif kind == _PAUSE:
                self.pause(t, a)
            else:
                self.resume(t, a)
        # clean stop at the horizon: the computing stretch in progress counts up to T
        for m in range(M):
            self.set_active(T, m, False)
            self.unblock(T, m)
        allocated = self.trace.chips * T
        edges = np.linspace(0.0, T, TIMELINE_BINS + 1)
        ev = sorted(self.activity)
        times = np.array([e[0] for e in ev] + [T])
        level = np.cumsum([e[1] for e in ev])
        cum = np.concatenate([[0.0], np.cumsum(level * np.diff(times))])
        active = np.diff(np.interp(edges, times, cum)) / np.diff(edges) / self.trace.chips
        gaps = np.diff(np.concatenate([[0.0], times]))  # level 0 before the first event
        levels = np.concatenate([[0.0], level])
        idle = float(np.sum(gaps[levels <= 1e-9 * self.trace.chips]))
        return SystemResult(
            system=self.setup.name,
            goodput=self.work / allocated,
            uptime=1.0 - idle / T,
            rounds_per_hour=self.rounds_closed / (T / 3600.0),
            timeline_t_s=edges[:-1],
            timeline_active=active,
            details={
                "failures": float(len(self.trace)),
                "rounds": float(self.rounds_closed),
                "merged_per_round": self.merged / max(1, self.rounds_closed),
                "blocked_frac": self.blocked_chip_s / allocated,
                "grace_s": self.grace,
                "reconfigurations": float(sum(s.stalls for s in self.schedules)),
            },
        )


def simulate_decoupled(
    trace: FailureTrace,
    costs: CostModel,
    setup: DecoupledSetup,
    *,
    seed: int = 0,
    quorum: QuorumPath = "fast",
) -> SystemResult:
    """Run Decoupled DiLoCo with ``setup`` on ``trace`` (same trace as the baselines).

    ``quorum="core"`` closes rounds with :func:`atoll.core.quorum.decide_round` itself instead of
    its fast equivalent (same results, several times slower).
    """
    return _Sim(trace, costs, setup, seed, quorum).run()
