"""The special cases that keep the math honest (docs/training.md; paper arXiv 2604.21428), end to end through atoll.core.

(a) K = M, P = 1, tau = 0, uniform weights, plain mean  =>  synchronous DiLoCo.
(b) ... and H = 1, eta = 1, mu = 0, plain SGD inside  =>  data-parallel SGD on the union of batches.

Each test drives the learners with core's pieces (fragment plan + schedule, learner_delta,
decide_round, synchronize_fragment, align_fragment) and compares with a reference written by hand
in the test from the textbook definition.
"""

from __future__ import annotations

import copy

import torch

from atoll.core import (
    Arrival,
    Counters,
    FragmentContribution,
    LearnerCounters,
    MergePolicy,
    NesterovOuterOptimizer,
    TimingEstimates,
    align_fragment,
    data_parallel,
    decide_round,
    learner_delta,
    plan_fragments,
    synchronize_fragment,
    synchronous_diloco,
)

M, BATCH, DIM = 3, 8, 6


class Net(torch.nn.Module):
    """Small real module with an embedding, so both merge paths exist."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, DIM)
        self.fc1 = torch.nn.Linear(DIM, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(idx).mean(dim=1)))).squeeze(-1)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def make_batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 10, (BATCH, 4), generator=g), torch.randn(BATCH, generator=g)) for _ in range(n)]


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_core_rounds(config, inner_opt_factory, data, rounds: int) -> dict[str, torch.Tensor]:
    """M learners + one synchronizer, all decisions made by atoll.core."""
    torch.manual_seed(0)
    global_model = Net()
    plan = plan_fragments(global_model, num_fragments=config.num_fragments, inner_steps=config.inner_steps)
    glob = params_of(global_model)
    versions = {0: plan.select(glob, 0)}
    outer = NesterovOuterOptimizer(lr=config.outer_lr, momentum=config.outer_momentum)
    learners = [copy.deepcopy(global_model) for _ in range(M)]
    opts = [inner_opt_factory(m.parameters()) for m in learners]
    counters = [LearnerCounters.fresh(1) for _ in range(M)]
    bases = [plan.select(glob, 0) for _ in range(M)]
    step = 0
    for r in range(rounds):
        published: list[FragmentContribution] = []
        while not published or len(published) < M:
            step += 1
            for m in range(M):
                opts[m].zero_grad()
                loss_fn(learners[m], data[m][step - 1]).backward()
                opts[m].step()
                counters[m].record_step(BATCH)
            p = plan.fragment_at(step)
            if p is None:
                continue
            for m in range(M):
                local = plan.select(dict(learners[m].named_parameters()), p)
                published.append(
                    FragmentContribution(
                        key=f"r{r}-l{m}",
                        learner_id=f"l{m}",
                        base_version=counters[m].fragments[p].base_version,
                        counters=counters[m].fragments[p].frozen(),
                        delta=learner_delta(bases[m], local),
                    )
                )
        arrivals = [Arrival(learner_id=c.learner_id, arrived_at_s=1.0, c_steps=c.counters.c_steps, c_tokens=c.counters.c_tokens) for c in published]
        decision = decide_round(
            now_s=1.0, opened_at_s=0.0, arrivals=arrivals, live_learners={f"l{m}" for m in range(M)},
            policy=config.quorum_policy(), timings=TimingEstimates(),
        )
        assert decision.close and len(decision.accepted) == M
        result = synchronize_fragment(
            current=versions[r], bases=versions, contributions=published, optimizer=outer,
            policy=MergePolicy(merge=config.merge, weighting=config.weighting, embedding_names=plan.embedding_names),
        )
        assert result is not None and result.weights == {c.key: 1 / M for c in published}
        versions[r + 1] = result.new_params
        for m in range(M):
            bases[m] = align_fragment(dict(learners[m].named_parameters()), result.new_params,
                                      counters=counters[m], fragment=0, version=r + 1)
    return versions[rounds]


def test_synchronous_diloco_exactly() -> None:
    H, ROUNDS = 3, 2
    config = synchronous_diloco(M, inner_steps=H)
    data = [make_batches(100 + m, H * ROUNDS) for m in range(M)]
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    got = run_core_rounds(config, adamw, data, ROUNDS)

    # Hand-written reference: every learner starts each round from the global model, keeps its
    # own AdamW state across rounds, runs H steps; the outer gradient is theta - mean(theta_m);
    # Nesterov with eta, mu.
    torch.manual_seed(0)
    theta = params_of(Net())
    learners = [Net() for _ in range(M)]
    opts = [adamw(m.parameters()) for m in learners]
    for m in learners:
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(theta[n])
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}
    for r in range(ROUNDS):
        for m in range(M):
            for s in range(H):
                opts[m].zero_grad()
                loss_fn(learners[m], data[m][r * H + s]).backward()
                opts[m].step()
        for n in theta:
            g = theta[n] - sum(dict(l.named_parameters())[n].detach() for l in learners) / M
            momentum[n] = config.outer_momentum * momentum[n] + g
            theta[n] = theta[n] - config.outer_lr * (g + config.outer_momentum * momentum[n])
        for m in learners:
            with torch.no_grad():
                for n, p in m.named_parameters():
                    p.copy_(theta[n])
    for n in theta:
        torch.testing.assert_close(got[n], theta[n], rtol=1e-5, atol=1e-6)


def test_data_parallel_sgd_exactly() -> None:
    lr = 0.1
    config = data_parallel(M)
    data = [make_batches(200 + m, 1) for m in range(M)]
    got = run_core_rounds(config, lambda ps: torch.optim.SGD(ps, lr=lr), data, 1)

    # Reference: ONE SGD step of one model on the union of the M equal batches.
    torch.manual_seed(0)
    model = Net()
    x = torch.cat([data[m][0][0] for m in range(M)])
    y = torch.cat([data[m][0][1] for m in range(M)])
    torch.optim.SGD(model.parameters(), lr=lr).zero_grad()
    loss_fn(model, (x, y)).backward()
    with torch.no_grad():
        expected = {n: p - lr * p.grad for n, p in model.named_parameters()}
    for n, t in expected.items():
        torch.testing.assert_close(got[n], t, rtol=1e-5, atol=1e-7)


def test_stale_contribution_is_reanchored_not_applied_as_fresh() -> None:
    g = torch.Generator().manual_seed(3)
    v0 = {"w": torch.randn(5, generator=g)}
    v1 = {"w": torch.randn(5, generator=g)}
    local = {"w": torch.randn(5, generator=g)}  # learner still based on v0
    c = FragmentContribution(key="k", learner_id="l", base_version=0, counters=Counters(c_steps=2, c_tokens=8),
                             delta=learner_delta(v0, local))
    res = synchronize_fragment(current=v1, bases={0: v0, 1: v1}, contributions=[c],
                               optimizer=NesterovOuterOptimizer(lr=1.0, momentum=0.0))
    assert res is not None
    # With eta = 1, mu = 0 and one learner the new global value is exactly the learner's weights.
    torch.testing.assert_close(res.new_params["w"], local["w"])
