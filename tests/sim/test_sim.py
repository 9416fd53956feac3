"""Fleet simulator: mechanics by hand, determinism, limits, monotonicity, shape, calibration, CLI."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atoll.cli import main
from atoll.core.quorum import QuorumPolicy
from atoll.sim.calibrate import PaperTargets, calibrate
from atoll.sim.decoupled import (
    DecoupledSetup,
    equal_islands,
    simulate_decoupled,
    two_speed_islands,
)
from atoll.sim.fleet import (
    SECONDS_PER_YEAR,
    CostModel,
    RecoveryDelay,
    elastic_schedule,
    failure_trace,
    merge_intervals,
    simulate_dp,
    simulate_elastic_dp,
)
from atoll.sim.planner import encoded_bytes, plan
from atoll.sim.presets import PAPER_COSTS, load_scenario, paper_costs, paper_scenario
from atoll.sim.scenarios import dp_renewal, run_fleet, run_heterogeneous

HOUR = 3600.0
DAY = 24 * HOUR


def setup(m: int, *, k: int = 1, gamma: float = 0.5, spread: float = 0.0, step_s: float = 10.0, sync_s: float = 0.0):
    return DecoupledSetup(
        islands=equal_islands(m),
        policy=QuorumPolicy(min_quorum=k, grace_factor=gamma, overlap_steps=2, poll_interval_s=1e9),
        step_s=step_s,
        step_spread=spread,
        sync_s=sync_s,
    )


def all_goodputs(trace, costs, m=4, **kw):
    return [
        simulate_dp(trace, costs).goodput,
        simulate_elastic_dp(trace, costs).goodput,
        simulate_decoupled(trace, costs, setup(m, **kw)).goodput,
    ]


# -- mechanics, by hand ------------------------------------------------------------------------


def sched(times, recs, *, e=10.0, w=20.0, chips=1000.0, slice_chips=100, horizon=1000.0):
    c = CostModel(reconfig_s=e, readmit_window_s=w, slice_chips=slice_chips)
    return elastic_schedule(np.array(times, float), np.array(recs, float), horizon, chips, c)


def test_elastic_schedule_window_readmission_by_hand() -> None:
    # failure at 100: stall [100, 110), 900 chips; back at 150, nobody reconfigures within the
    # 20 s window -> a reconfiguration of its own at 170 -> 1000 chips from 180
    s = sched([100.0], [50.0])
    assert s.run_start.tolist() == [0.0, 110.0, 180.0] and s.run_end.tolist() == [100.0, 170.0, 1000.0]
    assert s.run_chips.tolist() == [1000.0, 900.0, 1000.0]
    assert (s.stalls, s.readmit_stalls) == (2, 1)
    assert s.useful_chip_s == 100 * 1000 + 60 * 900 + 820 * 1000
    # a second failure at 160 starts a reconfiguration that re-admits the first slice for free
    s = sched([100.0, 160.0], [50.0, 500.0])
    assert s.run_start.tolist()[:3] == [0.0, 110.0, 170.0] and s.run_chips.tolist()[:3] == [1000.0, 900.0, 900.0]
    assert s.readmit_stalls == 1  # only the second slice (back at 660) needs its own, at 680
    assert s.run_end.tolist()[2] == 680.0 and s.run_chips.tolist()[3] == 1000.0
    # back within its own reconfiguration: taken in by it, no second stall
    s = sched([100.0], [5.0])
    assert (s.stalls, s.readmit_stalls) == (1, 0) and s.run_chips.tolist() == [1000.0, 1000.0]
    # window 0: re-admitted at once (a stall at 150)
    s = sched([100.0], [50.0], w=0.0)
    assert s.run_start.tolist() == [0.0, 110.0, 160.0] and s.readmit_stalls == 1
    # a failure during a reconfiguration is taken in by it: no extension
    s = sched([100.0, 105.0], [500.0, 500.0])
    assert s.run_start.tolist()[:2] == [0.0, 110.0] and s.run_chips.tolist()[1] == 800.0 and s.stalls <= 3


def test_dp_is_stall_and_restart_by_hand() -> None:
    costs = CostModel(restart_s=10.0, recovery=RecoveryDelay(mean_s=20.0))  # outage 30 s
    times = np.array([100.0, 110.0, 129.9, 130.0, 500.0])
    trace = dataclasses.replace(
        failure_trace(1, 1000.0, CostModel(failures_per_chip_year=0.0)),
        times_s=times, positions=np.zeros(5), recovery_s=np.full(5, 20.0),
    )
    r = simulate_dp(trace, costs)
    # outages [100, 130) (110 and 129.9 taken in, not extending it), [130, 160), [500, 530)
    assert r.details["outages"] == 3 and r.goodput == pytest.approx(1 - 90 / 1000)
    r = simulate_dp(trace, dataclasses.replace(costs, dp_waits_for_repair=False))  # outage 10 s
    # [100, 110), [110, 120), [129.9, 139.9) (130 taken in), [500, 510)
    assert r.details["outages"] == 4 and r.goodput == pytest.approx(1 - 40 / 1000)


def test_deterministic_for_a_seed() -> None:
    costs = paper_costs()
    a = run_fleet(paper_scenario(horizon_s=2 * HOUR, step_spread=0.1, learners=(2, 4)), 1_200_000)
    b = run_fleet(paper_scenario(horizon_s=2 * HOUR, step_spread=0.1, learners=(2, 4)), 1_200_000)
    assert [r.goodput for r in a] == [r.goodput for r in b]
    assert [r.details for r in a[2:]] == [r.details for r in b[2:]]
    t1 = failure_trace(100_000, HOUR, costs, seed=3)
    t2 = failure_trace(100_000, HOUR, costs, seed=4)
    assert not np.array_equal(t1.times_s, t2.times_s)


@pytest.mark.parametrize("spread", [0.0, 0.1])
def test_no_failures_goodput_is_one(spread: float) -> None:
    costs = dataclasses.replace(paper_costs(), failures_per_chip_year=0.0)
    trace = failure_trace(2_400_000, 6 * HOUR, costs, seed=0)
    assert len(trace) == 0
    for g in all_goodputs(trace, costs, m=8, spread=spread):
        assert g == pytest.approx(1.0, abs=1e-9)
    r = simulate_decoupled(trace, costs, setup(8, k=8, gamma=0.0))  # lock-step, identical speeds
    assert r.goodput == pytest.approx(1.0, abs=1e-9)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    frac=st.floats(0.0, 0.9),
    kind=st.sampled_from(["fixed", "exponential", "exponentiated_weibull"]),
)
def test_more_failures_never_raise_goodput(seed: int, frac: float, kind: str) -> None:
    costs = dataclasses.replace(
        paper_costs(), recovery=RecoveryDelay(kind=kind, mean_s=600.0, shape=0.7, exponent=2.0)
    )
    full = failure_trace(600_000, 2 * HOUR, costs, seed=seed)
    keep = np.random.default_rng(seed + 1).uniform(size=len(full)) >= frac
    fewer = full.subset(keep)
    # DP with an outage of fixed length: exactly monotone (greedy renewal starts only move later).
    # With random outages it is not (dropping a short outage can let a long one start).
    fixed = dataclasses.replace(costs, dp_waits_for_repair=False)
    assert simulate_dp(fewer, fixed).goodput >= simulate_dp(full, fixed).goodput - 1e-12
    assert simulate_elastic_dp(fewer, costs).goodput >= simulate_elastic_dp(full, costs).goodput - 2e-3
    d_full = simulate_decoupled(full, costs, setup(4)).goodput
    assert simulate_decoupled(fewer, costs, setup(4)).goodput >= d_full - 2e-3


def test_decoupled_m1_is_elastic_dp() -> None:
    costs = paper_costs()
    for n in (300_000, 1_200_000):
        trace = failure_trace(n, 6 * HOUR, costs, seed=5)
        e = simulate_elastic_dp(trace, costs)
        d = simulate_decoupled(trace, costs, setup(1, sync_s=1.0))
        assert d.goodput == pytest.approx(e.goodput, abs=1e-9)  # same schedule, computing all of it
        assert d.details["reconfigurations"] == e.details["reconfigurations"]


# -- the shape of the grid -------------------------------------------------------------------------


def test_dp_follows_the_renewal_shape() -> None:
    costs = paper_costs()
    for n in (150_000, 600_000, 2_400_000):
        g = simulate_dp(failure_trace(n, 4 * DAY, costs, seed=7), costs).goodput
        lam_r = n / SECONDS_PER_YEAR * costs.dp_outage_s
        assert g == pytest.approx(1 / (1 + lam_r), abs=0.012)
        assert dp_renewal(costs, n) == pytest.approx(1 / (1 + lam_r))
    assert 1 / (1 + lam_r) > 0.15 and math.exp(-lam_r) < 0.005  # at 2.4 M: renewal 15.6%, not exp(-λR) = 0.45%


def test_decoupled_approaches_full_goodput_as_the_fleet_shrinks() -> None:
    costs = paper_costs()
    g = {
        n: simulate_decoupled(failure_trace(n, 12 * HOUR, costs, seed=2), costs, setup(8, sync_s=1.0)).goodput
        for n in (2_400_000, 600_000, 150_000, 37_500)
    }
    assert g[2_400_000] < g[600_000] < g[150_000] < g[37_500]
    assert g[150_000] > 0.975 and g[37_500] > 0.99  # no plateau below 100%: losses scale with N


GRID_N = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)


# derandomize: the same 10 draws every run. The rule holds to ~1.5 points on independent traces
# (n = 600,000, M = 2, seed 28 differs by 1.52), so a fresh random draw each run would fail now and then.
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(n=st.sampled_from(GRID_N), m=st.sampled_from((2, 4, 8, 16)), seed=st.integers(0, 50))
def test_rule_of_thumb_m_learners_on_n_chips_is_elastic_dp_on_n_over_m(n: int, m: int, seed: int) -> None:
    """The paper's rule of thumb, across the grid: decoupled(N, M) ≈ elastic DP(N / M)."""
    costs = paper_costs()
    dec = simulate_decoupled(failure_trace(n, 12 * HOUR, costs, seed=seed), costs, setup(m, sync_s=1.0)).goodput
    el = simulate_elastic_dp(failure_trace(round(n / m), 4 * DAY, costs, seed=seed + 1), costs).goodput
    assert dec == pytest.approx(el, abs=0.02)  # independent traces: up to ~1.5 points apart


def test_reconfigurations_stall_one_island_so_decoupled_keeps_the_fleet_up() -> None:
    costs = paper_costs()
    trace = failure_trace(1_200_000, 6 * HOUR, costs, seed=4)
    e = simulate_elastic_dp(trace, costs)
    d8 = simulate_decoupled(trace, costs, setup(8, sync_s=1.0))
    assert e.uptime < 0.7 and d8.uptime == 1.0  # never all eight islands reconfiguring at once
    assert d8.goodput > e.goodput + 0.25


# -- calibration ---------------------------------------------------------------------------------


# Seconds of numpy alone; a 2-core machine running the rest of the suite beside it has stretched
# that past two minutes.
@pytest.mark.timeout(600)
def test_calibrate_gives_the_preset_constants() -> None:
    c = calibrate(PaperTargets())
    p = PAPER_COSTS
    assert c.reconfig_s == c.restart_s == pytest.approx(p.reconfig_s, rel=0.01) and p.restart_s == p.reconfig_s
    assert c.readmit_window_s == pytest.approx(p.readmit_window_s, rel=0.02)
    assert c.recovery.mean_s == pytest.approx(p.recovery.mean_s, rel=0.01)
    assert c.dp_waits_for_repair and (c.recovery.kind, c.recovery.shape, c.recovery.exponent) == (
        p.recovery.kind, p.recovery.shape, p.recovery.exponent,
    )
    # DP's equation is exact: 1 / (1 + λR) = 27% with R = E[recovery] + restart
    assert dp_renewal(c, 1_200_000) == pytest.approx(0.27, abs=1e-9)


def test_calibration_reproduces_the_paper_within_one_point() -> None:
    s = paper_scenario(learners=(8,))  # the preset: one simulated day, seed 0
    dp, elastic, m8 = run_fleet(s, 1_200_000)
    assert abs(dp.goodput - 0.27) <= 0.01
    assert abs(elastic.goodput - 0.58) <= 0.01
    assert abs(m8.goodput - 0.88) <= 0.01
    # and the model itself (long traces, so little sampling noise), not only this seed
    costs = paper_costs()
    long = failure_trace(1_200_000, 5 * DAY, costs, seed=99)
    assert simulate_dp(long, costs).goodput == pytest.approx(0.27, abs=0.006)
    assert simulate_elastic_dp(long, costs).goodput == pytest.approx(0.58, abs=0.006)
    small = failure_trace(150_000, 20 * DAY, costs, seed=99)  # = one of the 8 islands, for longer
    assert simulate_elastic_dp(small, costs).goodput == pytest.approx(0.88, abs=0.006)


def test_calibrate_rejects_impossible_targets() -> None:
    with pytest.raises(ValueError, match="0 < elastic < decoupled < 1"):
        calibrate(PaperTargets(goodput_elastic=0.9, goodput_decoupled=0.8))


def test_heterogeneous_lockstep_waits_for_the_slow_half() -> None:
    s = paper_scenario(horizon_s=2 * HOUR, hetero_chips=100_000, hetero_m=4)
    lock, k1, grace = run_heterogeneous(s)
    assert lock.details["merged_per_round"] == pytest.approx(4.0)
    assert lock.details["blocked_frac"] > 0.03  # the fast half waits ~15% of its time
    assert lock.goodput < k1.goodput and lock.goodput < grace.goodput
    assert grace.details["merged_per_round"] > k1.details["merged_per_round"] == pytest.approx(1.0)
    assert two_speed_islands(4)[3].speed == 1.18


def test_merge_intervals() -> None:
    s, e = merge_intervals(np.array([5.0, 0.0, 1.0, 8.0]), np.array([6.0, 2.0, 3.0, 20.0]), 10.0)
    assert s.tolist() == [0.0, 5.0, 8.0] and e.tolist() == [3.0, 6.0, 10.0]


def test_recovery_distributions_have_the_mean() -> None:
    rng = np.random.default_rng(0)
    for kind in ("fixed", "exponential", "weibull", "exponentiated_weibull"):
        x = RecoveryDelay(kind=kind, mean_s=100.0, shape=0.6, exponent=2.5).sample(rng, 200_000)
        assert x.mean() == pytest.approx(100.0, rel=0.03)
    with pytest.raises(ValueError, match="recovery kind must be .*got 'lognormal'"):
        RecoveryDelay(kind="lognormal")  # type: ignore[arg-type]


def test_exponentiated_weibull_has_its_cdf() -> None:
    r = RecoveryDelay(kind="exponentiated_weibull", mean_s=55.0, shape=2.0, exponent=2.0)
    x = r.sample(np.random.default_rng(1), 200_000)
    for q in (10.0, 30.0, 55.0, 90.0):
        cdf = (1 - math.exp(-((q / r.scale_s) ** 2))) ** 2
        assert np.mean(x <= q) == pytest.approx(cdf, abs=0.005)
    # a = 1 is the Weibull, k = a = 1 the exponential
    assert RecoveryDelay(kind="exponentiated_weibull", mean_s=10.0, shape=1.5).scale_s == pytest.approx(
        RecoveryDelay(kind="weibull", mean_s=10.0, shape=1.5).scale_s, rel=1e-6
    )
    assert RecoveryDelay(kind="exponentiated_weibull", mean_s=10.0).scale_s == pytest.approx(10.0, rel=1e-6)


# -- planner: hand-computed cases ------------------------------------------------------------


def test_encoded_bytes_matches_core_codecs() -> None:
    import torch

    from atoll.core.compress import encode, encoded_nbytes

    for n in (1, 31, 32, 33, 1000):
        for codec in ("fp32", "bf16", "int4"):
            assert encoded_bytes(n, codec) == encoded_nbytes(encode(torch.randn(n), codec))


def test_plan_hand_computed_bf16() -> None:
    # 24 M params, P = H = 24 -> 1 M params per fragment, one round per step of 1 s; a bf16 delta
    # up, the fp32 fragment (what learners fetch) down unless told otherwise
    p = plan(params=24_000_000, precision="bf16", step_s=1.0, wan_gbps=1.0, learners=2)
    assert p.fragment_params == 1_000_000
    assert p.upload_bytes_per_round == 2_000_000 and p.download_bytes_per_round == 4_000_000
    assert p.rounds_per_second == 1.0
    assert p.bytes_per_second == 6_000_000
    assert p.dp_bytes_per_second == 2 * (1 / 2) * 48_000_000  # ring all-reduce of bf16 grads, M = 2
    assert p.ratio == pytest.approx(8.0)
    assert p.transfer_s == pytest.approx(6_000_000 / 125_000_000)  # 1 Gbit/s = 125 MB/s
    assert p.hidden_s == 2.0 and p.hides
    assert p.grace_s == pytest.approx(0.5 * (2 * 1.0 - 4_000_000 / 125_000_000))
    both = plan(params=24_000_000, precision="bf16", download_precision="bf16", step_s=1.0, wan_gbps=1.0, learners=2)
    assert both.download_bytes_per_round == 2_000_000 and both.ratio == pytest.approx(12.0)


def test_plan_hand_computed_int4_and_h_gt_p() -> None:
    # 1 M params per fragment in int4: 31250 blocks of 32 -> 500000 B codes + 125000 B scales
    p = plan(params=4_000_000, num_fragments=4, inner_steps=8, overlap_steps=1, precision="int4",
             download_precision="fp32", step_s=0.5, wan_gbps=0.01, learners=8)
    assert p.upload_bytes_per_round == 625_000
    assert p.download_bytes_per_round == 4_000_000
    assert p.rounds_per_second == pytest.approx(1.0)  # a round every H/P = 2 steps of 0.5 s
    assert p.bytes_per_second == pytest.approx(4_625_000)
    assert p.dp_bytes_per_second == pytest.approx(2 * 7 / 8 * 8_000_000 / 0.5)
    assert p.transfer_s == pytest.approx(4_625_000 / 1_250_000)
    assert not p.hides  # 3.7 s of transfer vs 0.5 s of overlap on a 10 Mbit/s link
    assert p.grace_s == 0.0  # no slack left


# -- YAML and CLI ----------------------------------------------------------------------------------


def test_yaml_fleet(tmp_path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text(
        "chips: [10000, 20000]\nlearners: 2\nhours: 1\nrestart_s: 50\nreadmit_window_s: 5\n"
        "recovery: {kind: exponentiated_weibull, mean_s: 120, exponent: 3}\n"
    )
    s = load_scenario(f)
    assert s.sizes == (10_000, 20_000) and s.learners == (2,) and s.horizon_s == HOUR
    assert s.costs.restart_s == 50 and s.costs.readmit_window_s == 5
    assert (s.costs.recovery.kind, s.costs.recovery.mean_s, s.costs.recovery.exponent) == ("exponentiated_weibull", 120, 3)
    assert s.costs.recovery.shape == paper_costs().recovery.shape  # unspecified: kept from the preset
    assert s.costs.reconfig_s == paper_costs().reconfig_s
    f.write_text("chip: 3\n")
    with pytest.raises(ValueError, match="unknown fleet key"):
        load_scenario(f)


def test_cli_simulate_smoke(tmp_path, capsys) -> None:
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text("chips: 50000\nhours: 1\n")
    out = tmp_path / "plots"
    rc = main(["simulate", "--config", str(cfg), "--learners", "2", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "decoupled M=4" in text and "K=1 + grace" in text and "goodput" in text
    assert "rule of thumb" in text and "1/(1+λR)" in text
    assert {p.name for p in out.iterdir()} == {"goodput.png", "timeline.png", "heterogeneous.png"}
    assert (out / "goodput.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_plan_smoke(capsys) -> None:
    rc = main(["plan", "--params", "24e6", "--step-s", "1", "--wan-gbps", "1", "-M", "2"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "ratio DP / decoupled:          8.0x" in text and "communication hidden:          yes" in text
