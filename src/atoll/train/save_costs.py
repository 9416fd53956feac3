"""What learners' inner-state saves cost on the uplink, per token trained, at atoll's presets and at
86 M and 1 B parameters: the planner's byte formulas (:func:`atoll.sim.planner.plan_wire`) on the
presets' configs and models (built on the meta device: nothing allocated). ``atoll plan --saves``
and ``benchmarks/save_cost.py`` print it; docs/benchmarks.md, "Saves", holds the table.

Each row: a learner's contributions (payloads and records) per token, one save (AdamW's two
moments and its record), and at the recipe's default cadence (``save_uplink_share`` 0.1, no
``save_every_steps``) how many steps pass between saves, what they add per token and their share
of the contributions' bytes; beside it, the fixed cadence the presets had before (every 50 steps,
the gpu preset every 2000).
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.core.config import DilocoConfig, paper
from atoll.sim.planner import WirePlan, plan_wire
from atoll.train.model import GPTConfig, build_model
from atoll.train.recipe import Recipe, demo_recipe, gpu_recipe

__all__ = ["SaveCost", "preset_save_costs", "save_cost_lines"]

FIXED_CADENCE = {"demo": 50, "paper": 50, "gpu 86M": 2000, "gpu 1B": 2000}
"""The fixed cadences (``save_every_steps``) the presets had before saves were paced by a budget."""

ONE_B = GPTConfig(vocab_size=50257, context_tokens=2048, num_layers=18, num_heads=16, embed_dim=2048,
                  tie_embeddings=True)
"""A 1.0 B-parameter GPT (18 x 2048, context 2048, GPT-2's BPE vocabulary, tied head)."""


@dataclass(frozen=True)
class SaveCost:
    """One preset's saves against its contributions (bytes a learner sends up per token it trains)."""

    name: str
    moments: str
    """The saved moments' dtype ('fp32', 'bf16')."""
    params: int
    tokens_per_step: int
    up_bytes_per_token: float
    """Contributions: payloads and records."""
    save_bytes: int
    """One save: two moments per parameter and the state record."""
    steps_per_save: float | None
    """At the default cadence (the byte budget)."""
    save_bytes_per_token: float
    """At the default cadence."""
    old_save_bytes_per_token: float
    """At the preset's former fixed cadence (:data:`FIXED_CADENCE`)."""

    @property
    def share(self) -> float:
        """Saves' bytes over the contributions' at the default cadence."""
        return self.save_bytes_per_token / self.up_bytes_per_token

    @property
    def old_share(self) -> float:
        return self.old_save_bytes_per_token / self.up_bytes_per_token


def _plan(config: DilocoConfig, shapes: list[int], tokens_per_step: int, recipe: Recipe, moments: str,
          every: int | None) -> WirePlan:
    return plan_wire(config, params=sum(shapes), tokens_per_step=tokens_per_step, tensors=len(shapes),
                     save_every_steps=every, save_uplink_share=recipe.save_uplink_share, save_moments=moments)


def _cases() -> list[tuple[str, DilocoConfig, GPTConfig, int, Recipe]]:
    demo_config, demo = demo_recipe()
    gpu_config, gpu = gpu_recipe()
    tiny = build_model_config(demo)
    gpu_model = GPTConfig.from_dict(dict(gpu.model))  # type: ignore[arg-type]
    demo_tokens = demo.learners[0].island_batch * tiny.context_tokens
    gpu_batch = gpu.learners[0].island_batch
    return [
        ("demo", demo_config, tiny, demo_tokens, demo),
        ("paper", paper(demo_config.num_learners), tiny, demo_tokens, demo),
        ("gpu 86M", gpu_config, gpu_model, gpu_batch * gpu_model.context_tokens, gpu),
        ("gpu 1B", gpu_config, ONE_B, gpu_batch * ONE_B.context_tokens, gpu),
    ]


def build_model_config(recipe: Recipe) -> GPTConfig:
    """The GPTConfig of a recipe whose model is a preset name or a dict."""
    from atoll.train.model import MODEL_PRESETS

    spec = recipe.model
    return MODEL_PRESETS[spec]() if isinstance(spec, str) else GPTConfig.from_dict(dict(spec))


def preset_save_costs(moments: tuple[str, ...] = ("fp32", "bf16")) -> list[SaveCost]:
    """The demo and paper presets (the demo's tiny GPT and learners; the paper's H = P = 24, fp32
    deltas) and the gpu preset at 86 M and at 1 B, each with its moments in each of ``moments``."""
    out = []
    for name, config, model, tokens, recipe in _cases():
        shapes = [p.numel() for _, p in build_model(model, device="meta").named_parameters()]
        for dtype in moments:
            budget = _plan(config, shapes, tokens, recipe, dtype, None)
            old = _plan(config, shapes, tokens, recipe, dtype, FIXED_CADENCE[name])
            out.append(SaveCost(name=name, moments=dtype, params=sum(shapes),
                                tokens_per_step=tokens, up_bytes_per_token=budget.up_bytes_per_token,
                                save_bytes=budget.save_bytes, steps_per_save=budget.steps_per_save,
                                save_bytes_per_token=budget.save_bytes_per_token,
                                old_save_bytes_per_token=old.save_bytes_per_token))
    return out


def save_cost_lines(costs: list[SaveCost] | None = None) -> list[str]:
    """The table, as plain text."""
    costs = preset_save_costs() if costs is None else costs
    lines = [f"{'preset':<9} {'moments':>7} {'params':>8} {'tok/step':>8} {'contrib B/tok':>13} {'one save':>10} "
             f"{'steps/save':>10} {'saves B/tok':>11} {'share':>6} {'fixed':>6} {'B/tok':>9} {'share':>6}"]
    for c in costs:
        steps = f"{c.steps_per_save:,.0f}" if c.steps_per_save else "-"
        lines.append(f"{c.name:<9} {c.moments:>7} {_count(c.params):>8} {c.tokens_per_step:>8,} "
                     f"{c.up_bytes_per_token:>13,.2f} {_mib(c.save_bytes):>10} {steps:>10} "
                     f"{c.save_bytes_per_token:>11,.3f} {c.share:>6.1%} {FIXED_CADENCE.get(c.name, 0):>6,} "
                     f"{c.old_save_bytes_per_token:>9,.2f} "
                     f"{c.old_share:>6.0%}")
    return lines


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
