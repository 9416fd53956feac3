"""Fleet simulator and planner: determinism, limits, monotonicity, calibration, CLI."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atoll.core.quorum as core_quorum
import atoll.sim.decoupled as decoupled_mod
from atoll.cli import main
from atoll.core.quorum import QuorumPolicy
from atoll.sim.calibrate import PaperTargets, calibrate
from atoll.sim.decoupled import DecoupledSetup, equal_islands, simulate_decoupled, two_speed_islands
from atoll.sim.fleet import (
    CostModel,
    RecoveryDelay,
    failure_trace,
    merge_intervals,
    simulate_dp,
    simulate_elastic_dp,
)
from atoll.sim.planner import encoded_bytes, plan
from atoll.sim.presets import paper_costs, paper_scenario, load_scenario
from atoll.sim.report import run_fleet, run_heterogeneous

HOUR = 3600.0


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


def test_decoupled_uses_the_core_decision_function() -> None:
    assert decoupled_mod.decide_round is core_quorum.decide_round
    assert decoupled_mod.TimingEma is core_quorum.TimingEma


def test_decide_round_is_what_closes_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(**kw):
        d = core_quorum.decide_round(**kw)
        calls.append(d)
        return d

    monkeypatch.setattr(decoupled_mod, "decide_round", spy)
    costs = paper_costs()
    r = simulate_decoupled(failure_trace(10_000, HOUR, costs, seed=1), costs, setup(4))
    assert r.details["rounds"] == sum(d.close for d in calls) > 0


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


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), frac=st.floats(0.0, 0.9), kind=st.sampled_from(["fixed", "exponential", "weibull"]))
def test_more_failures_never_raise_goodput(seed: int, frac: float, kind: str) -> None:
    costs = dataclasses.replace(paper_costs(), recovery=RecoveryDelay(kind=kind, mean_s=600.0, shape=0.7))
    full = failure_trace(600_000, 2 * HOUR, costs, seed=seed)
    keep = np.random.default_rng(seed + 1).uniform(size=len(full)) >= frac
    fewer = full.subset(keep)
    g_full = all_goodputs(full, costs)
    g_fewer = all_goodputs(fewer, costs)
    assert g_fewer[0] >= g_full[0] - 1e-12  # DP: exact interval unions
    assert g_fewer[1] >= g_full[1] - 1e-12  # elastic DP
    assert g_fewer[2] >= g_full[2] - 2e-3  # decoupled: steps are credited at the island size they end with


def test_decoupled_m1_behaves_like_elastic_dp() -> None:
    costs = paper_costs()
    for n in (300_000, 1_200_000):
        trace = failure_trace(n, 12 * HOUR, costs, seed=5)
        e = simulate_elastic_dp(trace, costs).goodput
        d = simulate_decoupled(trace, costs, setup(1)).goodput
        assert d == pytest.approx(e, abs=0.01)


def test_calibration_reproduces_the_paper_within_two_points() -> None:
    costs = calibrate(PaperTargets())
    s = paper_scenario(costs=costs, learners=(8,))
    dp, elastic, m8 = run_fleet(s, 1_200_000)
    assert abs(dp.goodput - 0.27) <= 0.02
    assert abs(elastic.goodput - 0.58) <= 0.02
    assert abs(m8.goodput - 0.88) <= 0.02


def test_calibration_first_order_equations() -> None:
    c = calibrate()
    lam = 1.2e6 / (365 * 24 * 3600)
    assert np.exp(-lam * c.restart_s) == pytest.approx(0.27)
    y = c.recovery.mean_s * c.slice_chips / (365 * 24 * 3600)
    assert np.exp(-2 * lam * c.reconfig_s) * (1 - y) == pytest.approx(0.58)
    assert np.exp(-2 * lam * c.reconfig_s / 8) * (1 - y) == pytest.approx(0.88)


def test_heterogeneous_lockstep_waits_for_the_slow_half() -> None:
    s = paper_scenario(horizon_s=2 * HOUR, hetero_chips=100_000, hetero_m=4)
    lock, k1, grace = run_heterogeneous(s)
    assert lock.details["merged_per_round"] == pytest.approx(4.0)
    assert lock.details["blocked_frac"] > 0.03  # the fast half waits ~15% of its time
    assert lock.goodput < k1.goodput and lock.goodput < grace.goodput
    assert grace.details["merged_per_round"] > k1.details["merged_per_round"] == pytest.approx(1.0)
    assert two_speed_islands(4)[3].speed == 1.18


def test_dp_matches_poisson_formula_and_elastic_pays_changes() -> None:
    costs = CostModel(restart_s=20.0, reconfig_s=5.0, recovery=RecoveryDelay(mean_s=30.0), slice_chips=1)
    trace = failure_trace(1_000_000, 24 * HOUR, costs, seed=2)
    lam = 1e6 / (365 * 24 * 3600)
    assert simulate_dp(trace, costs).goodput == pytest.approx(np.exp(-lam * 20.0), abs=0.01)
    assert simulate_elastic_dp(trace, costs).goodput == pytest.approx(np.exp(-2 * lam * 5.0), abs=0.01)


def test_merge_intervals() -> None:
    s, e = merge_intervals(np.array([5.0, 0.0, 1.0, 8.0]), np.array([6.0, 2.0, 3.0, 20.0]), 10.0)
    assert s.tolist() == [0.0, 5.0, 8.0] and e.tolist() == [3.0, 6.0, 10.0]


def test_recovery_distributions_have_the_mean() -> None:
    rng = np.random.default_rng(0)
    for kind in ("fixed", "exponential", "weibull"):
        x = RecoveryDelay(kind=kind, mean_s=100.0, shape=0.6).sample(rng, 200_000)
        assert x.mean() == pytest.approx(100.0, rel=0.03)
    with pytest.raises(ValueError, match="recovery kind must be .*got 'lognormal'"):
        RecoveryDelay(kind="lognormal")


# -- planner: hand-computed cases ------------------------------------------------------------


def test_encoded_bytes_matches_core_codecs() -> None:
    import torch

    from atoll.core.compress import encode, encoded_nbytes

    for n in (1, 31, 32, 33, 1000):
        for codec in ("fp32", "bf16", "int4"):
            assert encoded_bytes(n, codec) == encoded_nbytes(encode(torch.randn(n), codec))


def test_plan_hand_computed_bf16() -> None:
    # 24 M params, P = H = 24 -> 1 M params per fragment, one round per step of 1 s
    p = plan(params=24_000_000, precision="bf16", step_s=1.0, wan_gbps=1.0, learners=2)
    assert p.fragment_params == 1_000_000
    assert p.upload_bytes_per_round == p.download_bytes_per_round == 2_000_000
    assert p.rounds_per_second == 1.0
    assert p.bytes_per_second == 4_000_000
    assert p.dp_bytes_per_second == 2 * (1 / 2) * 48_000_000  # ring all-reduce of bf16 grads, M = 2
    assert p.ratio == pytest.approx(12.0)
    assert p.transfer_s == pytest.approx(4_000_000 / 125_000_000)  # 1 Gbit/s = 125 MB/s
    assert p.hidden_s == 2.0 and p.hides
    assert p.grace_s == pytest.approx(0.5 * (2 * 1.0 - 2_000_000 / 125_000_000))


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
    f.write_text("chips: [10000, 20000]\nlearners: 2\nhours: 1\nrestart_s: 50\nrecovery: {kind: exponential, mean_s: 120}\n")
    s = load_scenario(f)
    assert s.sizes == (10_000, 20_000) and s.learners == (2,) and s.horizon_s == HOUR
    assert s.costs.restart_s == 50 and s.costs.recovery.kind == "exponential"
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
    assert {p.name for p in out.iterdir()} == {"goodput.png", "timeline.png", "heterogeneous.png"}
    assert (out / "goodput.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_plan_smoke(capsys) -> None:
    rc = main(["plan", "--params", "24e6", "--step-s", "1", "--wan-gbps", "1", "-M", "2"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "ratio DP / decoupled:          12.0x" in text and "communication hidden:          yes" in text
