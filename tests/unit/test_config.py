"""Config: paper defaults, presets, and errors that name the knob."""

from __future__ import annotations

import dataclasses

import pytest

from atoll.core import ConfigError, DilocoConfig, data_parallel, paper, synchronous_diloco


def test_paper_defaults() -> None:
    c = DilocoConfig()
    assert (c.num_fragments, c.inner_steps, c.overlap_steps, c.min_quorum) == (24, 24, 2, 1)
    assert (c.grace_factor, c.outer_lr, c.outer_momentum) == (0.5, 0.7, 0.9)
    assert c.merge == "rda" and c.weighting == "tokens" and not c.rda_embeddings
    assert paper(8).num_learners == 8


def test_frozen_and_keyword_only() -> None:
    c = DilocoConfig()
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'num_learners'"):
        c.num_learners = 3  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        DilocoConfig(4)  # type: ignore[misc]


def test_every_field_has_a_docstring() -> None:
    import ast
    import inspect

    from atoll.core import config as mod

    src = inspect.getsource(mod.DilocoConfig)
    body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
    documented = {
        stmt.target.id
        for stmt, nxt in zip(body, body[1:], strict=False)
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(nxt, ast.Expr)
        and isinstance(nxt.value, ast.Constant)
        and isinstance(nxt.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(DilocoConfig)}


@pytest.mark.parametrize(
    ("changes", "knob"),
    [
        ({"num_learners": 0}, "num_learners"),
        ({"num_fragments": 0}, "num_fragments"),
        ({"inner_steps": 10, "num_fragments": 12}, "inner_steps"),
        ({"overlap_steps": -1}, "overlap_steps"),
        ({"overlap_steps": 24}, "overlap_steps"),
        ({"min_quorum": 0}, "min_quorum"),
        ({"min_quorum": 5, "num_learners": 4}, "min_quorum"),
        ({"grace_factor": 1.0}, "grace_factor"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_lr": float("nan")}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"merge": "median"}, "merge"),
        ({"weighting": "loss"}, "weighting"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"compression": "int2"}, "compression"),
        ({"compression_block_size": 31}, "compression_block_size"),
        ({"num_learners": True}, "num_learners"),
    ],
)
def test_validation_names_the_knob(changes: dict, knob: str) -> None:
    with pytest.raises(ConfigError, match=knob):
        DilocoConfig(**changes)


def test_presets_are_the_special_cases() -> None:
    s = synchronous_diloco(3, inner_steps=5)
    assert (s.min_quorum, s.num_fragments, s.overlap_steps, s.merge, s.weighting) == (3, 1, 0, "mean", "uniform")
    d = data_parallel(3)
    assert (d.inner_steps, d.outer_lr, d.outer_momentum) == (1, 1.0, 0.0)


def test_dict_round_trip_and_unknown_fields() -> None:
    c = DilocoConfig(num_learners=3, compression="int4")
    assert DilocoConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="unknown config field"):
        DilocoConfig.from_dict({**c.to_dict(), "warp_speed": 9})


def test_quorum_policy_from_config() -> None:
    c = DilocoConfig(num_fragments=4, inner_steps=12, overlap_steps=3, min_quorum=2)
    pol = c.quorum_policy(poll_interval_s=0.5)
    assert (pol.min_quorum, pol.overlap_steps, pol.steps_between_rounds, pol.poll_interval_s) == (2, 3, 3.0, 0.5)
