"""Decoupled DiLoCo on a simulated fleet: islands, learners, and the real quorum/grace policy.

**Islands.** The fleet is split into M islands, one learner each. Inside its island a learner is
elastic data-parallel: when one of its chips fails, the island pauses for ``reconfig_s`` to re-form
its mesh on the remaining slices, trains on ``chips - slice_chips x (slices out)`` until the failed
slice is back (the trace's recovery delay), and pauses ``reconfig_s`` again to take it back. An
island with no slice left waits for one. A pause stops only that island; the step in flight
resumes after it. So M = 1 has exactly elastic DP's failure mechanics, and a fleet split into M
islands pays each reconfiguration on 1/M of the chips.

**Learners.** Inner steps take ``step_s * speed * max(0.1, 1 + spread * z)`` seconds (z ~ N(0,1)).
After its step t a learner publishes fragment p when ``t mod H = t_p`` (t_p = floor(p H / P)). It
adopts the merged fragment τ steps later: before starting step ``t + τ + 1`` it needs the round its
contribution went into to have closed, plus ``sync_s`` for the result to reach it (streaming
overlap). With K < M and the paper's grace window that wait is rare; with K = M it is the lock-step
barrier, and that wait is lost chip-time.

**Synchronizer.** One stream of rounds per fragment. A contribution joins the open round of its
fragment, or opens one (contributions with an older base are re-anchored by the real protocol,
never dropped, so none is lost; a learner that missed a round simply lands in the next one). A round
closes exactly when :func:`atoll.core.quorum.decide_round` says so -- the function the real
synchronizer calls. The simulator asks it whenever its answer can change: at quorum, when every
live learner is in, when a learner pauses, and at the grace deadline it returned. The grace window
comes from :class:`atoll.core.quorum.TimingEma` fed with simulated step, quorum and sync times, as
the real synchronizer feeds it with measured ones.

**Outputs.** Goodput = chip-time spent in completed inner steps / (N x horizon) (the step in flight
at the horizon counts for its elapsed part, so a fleet with no failures has goodput 1); uptime = the
fraction of time at least one island computes; rounds per hour; merged contributions per round.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from atoll.core.quorum import Arrival, QuorumDecision, QuorumPolicy, TimingEma, decide_round, grace_window_s
from atoll.sim.fleet import TIMELINE_BINS, CostModel, FailureTrace, SystemResult

__all__ = ["Island", "DecoupledSetup", "equal_islands", "two_speed_islands", "simulate_decoupled"]


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


# Event kinds. At equal times slice changes come first, so a step that would end at the very
# instant its island pauses is paused instead.
_SLICE, _STALL_END, _STEP, _RECHECK, _START = 0, 1, 2, 3, 4


@dataclass
class _Round:
    serial: int
    opened_at: float = 0.0
    arrivals: list[Arrival] = field(default_factory=list)
    members: set[int] = field(default_factory=set)
    deadline_at: float | None = None


class _Sim:
    def __init__(self, trace: FailureTrace, costs: CostModel, setup: DecoupledSetup, seed: int) -> None:
        self.trace, self.costs, self.setup = trace, costs, setup
        self.T = trace.horizon_s
        M = self.M = len(setup.islands)
        self.chips = [i.share * trace.chips for i in setup.islands]
        self.mean_step = [setup.step_s * i.speed for i in setup.islands]
        self.rng = np.random.default_rng(seed)
        self.noise: list[list[float]] = [[] for _ in range(M)]
        self.H, self.P = setup.inner_steps, setup.num_fragments
        self.tau = setup.policy.overlap_steps
        self.K = setup.policy.min_quorum
        self.frag_at = {(p * self.H) // self.P: p for p in range(self.P)}
        self.ids = [f"L{m}" for m in range(M)]
        self.ema = TimingEma(decay=setup.ema_decay)
        self.ema.update("step_s", setup.step_s)  # the nominal step time is known up front

        # learners
        self.up = [True] * M  # not pausing and has chips
        self.active = [False] * M  # computing (up, not blocked)
        self.avail = list(self.chips)  # chips in service
        self.slice = [min(float(costs.slice_chips), c) for c in self.chips]
        self.n_out = [0] * M  # slices out of service
        self.stalls_open = [0] * M
        self.k = [0] * M  # steps completed
        self.work = 0.0  # chip-seconds of completed steps
        self.running = [False] * M
        self.step_end = [0.0] * M
        self.step_len = [0.0] * M
        self.remaining = [0.0] * M  # paused step: seconds left
        self.token = [0] * M
        self.last_pub_k = [[0] * self.P for _ in range(M)]
        self.gates: list[list[tuple[int, int, int]]] = [[] for _ in range(M)]  # (step, p, serial)
        self.blocked = [False] * M
        # synchronizer
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
            self.activity.append((t, self.avail[m] if on else -self.avail[m]))
            self.active[m] = on

    def set_avail(self, t: float, m: int, chips: float) -> None:
        if self.active[m]:
            self.activity.append((t, chips - self.avail[m]))
        if self.blocked[m]:
            self.blocked_chip_s += (t - self.blocked_since[m]) * self.avail[m]
            self.blocked_since[m] = t
        self.avail[m] = chips

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
            self.step_len[m] = d
        self.running[m] = True
        self.step_end[m] = t + d
        self.push(t + d, _STEP, m, self.token[m])

    def step_done(self, t: float, m: int) -> None:
        self.running[m] = False
        self.work += self.step_len[m] * self.avail[m]
        step = self.k[m]
        self.k[m] += 1
        p = self.frag_at.get(step % self.H)
        if p is not None:
            self.publish(t, m, p)
        self.try_start(t, m)

    def publish(self, t: float, m: int, p: int) -> None:
        rnd = self.rounds[p]
        if not rnd.arrivals:
            rnd.opened_at = t  # a fragment's round opens with its first contribution
        c_steps = self.k[m] - self.last_pub_k[m][p]
        self.last_pub_k[m][p] = self.k[m]
        rnd.arrivals.append(
            Arrival(learner_id=self.ids[m], arrived_at_s=t, c_steps=c_steps, c_tokens=c_steps, key=f"{p}/{rnd.serial}/{m}")
        )
        rnd.members.add(m)
        self.gates[m].append((self.k[m] + self.tau, p, rnd.serial))
        self.evaluate(t, p)

    # -- synchronizer --------------------------------------------------------------------
    def evaluate(self, t: float, p: int, *, deadline: bool = False) -> None:
        """Ask decide_round about fragment p's open round when its answer can change."""
        rnd = self.rounds[p]
        n = len(rnd.arrivals)
        if n < self.K and self.setup.policy.max_wait_s is None:
            return  # below quorum with no deadline: the answer is "wait" until the next arrival
        everyone = all(m in rnd.members for m in range(self.M) if self.up[m])
        if not (deadline or everyone or rnd.deadline_at is None):
            return
        dec = decide_round(
            now_s=t,
            opened_at_s=rnd.opened_at,
            arrivals=rnd.arrivals,
            live_learners=[self.ids[m] for m in range(self.M) if self.up[m]],
            policy=self.setup.policy,
            timings=self.ema.estimates(),
        )
        if dec.close:
            self.close(t, p, dec)
            return
        nxt = dec.close_at_s if dec.close_at_s is not None else dec.recheck_at_s
        if nxt is not None and (deadline or rnd.deadline_at is None or nxt < rnd.deadline_at):
            rnd.deadline_at = max(nxt, t)
            self.push(rnd.deadline_at, _RECHECK, p, rnd.serial)

    def close(self, t: float, p: int, dec: QuorumDecision) -> None:
        rnd = self.rounds[p]
        self.merged += len(dec.accepted)
        if dec.quorum_at_s is not None:
            self.ema.update("quorum_s", max(0.0, dec.quorum_at_s - rnd.opened_at))
        self.ema.update("sync_s", self.setup.sync_s)
        self.rounds_closed += 1
        key = (p, rnd.serial)
        rel = t + self.setup.sync_s
        self.release[key] = rel
        accepted = {a.learner_id for a in dec.accepted}
        # contributions the policy did not take stay pending: they open the next round of p
        leftover = [a for a in rnd.arrivals if a.learner_id not in accepted]
        self.rounds[p] = nxt = _Round(rnd.serial + 1, opened_at=t)
        for m in self.waiters.pop(key, []):
            if rel > t:
                self.push(rel, _START, m)
            else:
                self.try_start(t, m)
        if leftover:
            for a in leftover:
                m = int(a.learner_id[1:])
                nxt.arrivals.append(a)
                nxt.members.add(m)
                self.gates[m] = [(s, q, nxt.serial if (q, sr) == key else sr) for s, q, sr in self.gates[m]]
            self.evaluate(t, p)

    # -- islands -------------------------------------------------------------------------
    def pause(self, t: float, m: int) -> None:
        if not self.up[m]:
            return
        self.up[m] = False
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
        if self.up[m] or self.avail[m] <= 0 or self.stalls_open[m] > 0:
            return
        self.up[m] = True
        self.try_start(t, m)

    def slice_change(self, t: float, m: int, delta: int) -> None:
        """A slice leaves (delta < 0) or comes back: the island pauses to re-form its mesh."""
        self.n_out[m] -= delta
        self.set_avail(t, m, max(0.0, self.chips[m] - self.n_out[m] * self.slice[m]))
        self.stalls_open[m] += 1
        self.push(t + self.costs.reconfig_s, _STALL_END, m)
        self.pause(t, m)

    # -- main loop -----------------------------------------------------------------------
    def run(self) -> SystemResult:
        T, M = self.T, self.M
        bounds = np.concatenate([[0.0], np.cumsum([i.share for i in self.setup.islands])])
        bounds[-1] = np.inf
        for m in range(M):
            tr = self.trace.in_range(bounds[m], bounds[m + 1])
            for f, r in zip(tr.times_s.tolist(), tr.recovery_s.tolist()):
                self.push(f, _SLICE, m, -1)
                if f + r < T:
                    self.push(f + r, _SLICE, m, 1)
        for m in range(M):
            self.try_start(0.0, m)
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
            elif kind == _SLICE:
                self.slice_change(t, a, b)
            else:
                self.stalls_open[a] -= 1
                self.resume(t, a)
        # clean stop at the horizon: the elapsed part of the step in flight counts
        work = self.work
        for m in range(M):
            if self.running[m]:
                work += (self.step_len[m] - (self.step_end[m] - T)) * self.avail[m]
            elif self.remaining[m] > 0:
                work += (self.step_len[m] - self.remaining[m]) * self.avail[m]
            self.unblock(T, m)
        allocated = self.trace.chips * T
        edges = np.linspace(0.0, T, TIMELINE_BINS + 1)
        ev = sorted(self.activity)
        times = np.array([e[0] for e in ev] + [T])
        level = np.cumsum([e[1] for e in ev])
        cum = np.concatenate([[0.0], np.cumsum(level * np.diff(times))])
        active = np.diff(np.interp(edges, times, cum)) / np.diff(edges) / self.trace.chips
        idle = float(np.sum(np.diff(times)[level <= 1e-9 * self.trace.chips]))
        return SystemResult(
            system=self.setup.name,
            goodput=work / allocated,
            uptime=1.0 - idle / T,
            rounds_per_hour=self.rounds_closed / (T / 3600.0),
            timeline_t_s=edges[:-1],
            timeline_active=active,
            details={
                "failures": float(len(self.trace)),
                "rounds": float(self.rounds_closed),
                "merged_per_round": self.merged / max(1, self.rounds_closed),
                "blocked_frac": self.blocked_chip_s / allocated,
                "grace_s": grace_window_s(self.setup.policy, self.ema.estimates()),
            },
        )


def simulate_decoupled(trace: FailureTrace, costs: CostModel, setup: DecoupledSetup, *, seed: int = 0) -> SystemResult:
    """Run Decoupled DiLoCo with ``setup`` on ``trace`` (same trace as the baselines)."""
    return _Sim(trace, costs, setup, seed).run()
