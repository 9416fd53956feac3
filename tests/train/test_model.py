"""atoll.train.model: presets, shapes, the user-model contract, and that it actually learns."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from atoll.core.config import ConfigError
from atoll.core.fragments import embedding_parameter_names
from atoll.train.data import BatchStream, evaluate, stdlib_corpus
from atoll.train.model import (
    GPT,
    MODEL_PRESETS,
    GPTConfig,
    ModelFactory,
    build_model,
    check_model,
    count_parameters,
    loss_fn,
    micro,
    model_factory,
    small,
    tiny,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    return stdlib_corpus(max_corpus_mb=1.0, val_fraction=0.1, cache_dir=tmp_path_factory.mktemp("cache"))


# -- presets -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("micro", 0.1e6, 0.5e6), ("tiny", 0.8e6, 5e6), ("mini", 5e6, 30e6), ("small", 120e6, 130e6)],
)
def test_preset_parameter_counts(name: str, low: float, high: float) -> None:
    # The meta device builds shapes without memory: GPT-2 small costs nothing here.
    model = build_model(MODEL_PRESETS[name](), device="meta")
    assert low <= count_parameters(model) <= high


def test_small_is_gpt2_small_and_ties_its_head() -> None:
    model = build_model(small(), device="meta")
    assert count_parameters(model) == 124_439_808  # GPT-2 small's well-known count
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # tied tensor listed once
    assert embedding_parameter_names(model) == {"tok_emb.weight", "pos_emb.weight"}


def test_byte_presets_split_embeddings_for_core() -> None:
    model = build_model(tiny(), device="meta")
    assert embedding_parameter_names(model) == {"tok_emb.weight", "pos_emb.weight"}
    assert "lm_head.weight" in dict(model.named_parameters())


def test_preset_overrides_win() -> None:
    assert tiny(context_tokens=64).context_tokens == 64
    assert tiny(embed_dim=192, num_heads=6).embed_dim == 192


def test_config_errors_name_the_knob() -> None:
    with pytest.raises(ConfigError, match="embed_dim"):
        GPTConfig(embed_dim=130, num_heads=4)
    with pytest.raises(ConfigError, match="num_layers"):
        micro(num_layers=0)
    with pytest.raises(ConfigError, match="unknown"):
        GPTConfig.from_dict({"layers": 3})
    assert GPTConfig.from_dict(micro().to_dict()) == micro()


# -- forward --------------------------------------------------------------------------------


def test_forward_shapes_and_context_limit() -> None:
    model = build_model(micro(), seed=0)
    x = torch.randint(0, 256, (3, 17))
    assert model(x).shape == (3, 17, 256)
    assert model(torch.randint(0, 256, (2, 64))).shape == (2, 64, 256)
    with pytest.raises(ValueError, match="context_tokens"):
        model(torch.randint(0, 256, (1, 65)))


def test_causal_future_tokens_do_not_change_the_past() -> None:
    model = build_model(micro(), seed=0).eval()
    x = torch.randint(0, 256, (1, 20))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0, :10], model(x2)[0, :10])


def test_seeded_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(micro(), seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_model(micro(), seed=7)
    c = build_model(micro(), seed=8)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_loss_decreases_on_stdlib_text(corpus) -> None:
    torch.manual_seed(0)
    model = build_model(micro(), seed=0)
    stream = BatchStream(corpus.train, context_tokens=64, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = evaluate(model, corpus.val, batches=2, batch_size=16)
    losses = []
    for _ in range(40):
        x, y = stream.next_batch(16)
        loss = loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = evaluate(model, corpus.val, batches=2, batch_size=16)
    assert before > 5.0  # ~ln(256) = 5.55 at init: uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert after < before - 1.0


# -- user models --------------------------------------------------------------------------


class Bigram(nn.Module):
    """The smallest model meeting the contract: next-token logits from the current token."""

    def __init__(self, vocab_size: int = 256) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table(idx)


class TupleOut(Bigram):
    def forward(self, idx: torch.Tensor):  # nanoGPT style: (logits, loss)
        return self.table(idx), None


def make_bigram() -> nn.Module:
    return Bigram()


def test_user_factory_works_with_the_helpers(corpus) -> None:
    factory = model_factory(make_bigram, seed=3)
    model = factory()
    assert isinstance(model, Bigram)
    assert torch.equal(model.table.weight, factory().table.weight)  # seeded: same init everywhere
    check_model(model, vocab_size=256, context_tokens=32)
    stream = BatchStream(corpus.train, context_tokens=32)
    x, y = stream.next_batch(4)
    loss = loss_fn(model, x, y)
    loss.backward()
    assert model.table.weight.grad is not None
    ev = evaluate(model, corpus.val, batches=1, batch_size=4, context_tokens=32)
    assert ev == evaluate(model, corpus.val, batches=1, batch_size=4, context_tokens=32)
    with pytest.raises(ValueError, match="context_tokens"):
        evaluate(model, corpus.val)  # a user model has no config to read it from
    assert loss_fn(TupleOut(), x, y).ndim == 0


def test_factory_specs_and_pickling() -> None:
    for spec in ("micro", micro(), micro, "atoll.train.model:micro"):
        f = model_factory(spec, seed=0)
        g = pickle.loads(pickle.dumps(f))  # must travel to learner processes
        assert isinstance(g, ModelFactory)
        m1, m2 = f(), g()
        assert isinstance(m1, GPT) and m1.config == micro()
        assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert isinstance(pickle.loads(pickle.dumps(model_factory(make_bigram)))(), Bigram)


def test_factory_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="not a preset"):
        model_factory("huge")
    with pytest.raises(ValueError, match="cannot import"):
        model_factory("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no attribute"):
        model_factory("atoll.train.model:nope")
    with pytest.raises(TypeError, match="model="):
        model_factory(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return a torch.nn.Module"):
        model_factory(lambda: "not a model")()


def test_check_model_catches_contract_violations() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        check_model(Bigram(300), vocab_size=256, context_tokens=8)

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(1, 1)

        def forward(self, idx):
            return idx.float().sum()

    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        loss_fn(Flat(), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
