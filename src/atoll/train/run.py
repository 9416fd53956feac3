"""A run as the training code sees it: create one (the only place a run is created), read its
recipe back, evaluate it.

Everything here is Prefect-free and rebuilds from the run URL alone (the recipe, config and
initial weights live in ``run.json`` and the bucket), so a learner process, the synchronizer, a
notebook or a test can all call it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from atoll.core.config import DilocoConfig
from atoll.core.fragments import FragmentPlan, plan_fragments
from atoll.storage.creation import RunCreator
from atoll.storage.handle import RunHandle
from atoll.storage.reader import RunReader
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.train import data as data_mod
from atoll.train.device import autocast
from atoll.train.recipe import Recipe

__all__ = ["EVAL_BATCH_SIZE", "RecipeEvaluator", "RoundSchedule", "create_run", "load_recipe", "make_evaluator", "recipe_context_tokens",
           "TokenBounds"]

Evaluate = Callable[[Mapping[str, torch.Tensor]], float]


def load_recipe(store: RunReader) -> Recipe:
    """The recipe stored in the run's manifest (``run.json`` ``extra.recipe``)."""
    extra = store.checked_manifest().extra  # checked against the chain or keyring before it is acted on
    if "recipe" not in extra:
        raise ValueError(f"run {store.url} has no recipe (run.json extra.recipe); it was not created by atoll.train")
    return Recipe.from_dict(extra["recipe"])


def recipe_context_tokens(recipe: Recipe) -> int:
    """The training-window length every learner of ``recipe`` uses (what ``Learner`` passes to its
    batch stream): the recipe's own, else the GPT config's, without building the model when the
    model is a preset or a config (only a custom model is built, once)."""
    if recipe.context_tokens:
        return int(recipe.context_tokens)
    from atoll.train.model import MODEL_PRESETS, GPTConfig

    spec = recipe.model
    if isinstance(spec, str) and spec in MODEL_PRESETS:
        return int(MODEL_PRESETS[spec]().context_tokens)
    if isinstance(spec, Mapping):
        return int(GPTConfig.from_dict(dict(spec)).context_tokens)
    return recipe.context_for(recipe.model_factory()())


@dataclass(frozen=True)
class TokenBounds:
    """Tokens one inner step can consume, per learner: batch x ranks x context from the recipe (an
    island trains on exactly ``ranks * batch_size`` windows of ``context`` tokens per step)."""

    per_learner: Mapping[str, int]
    largest: int
    """For a learner id the recipe does not list: the largest batch in the recipe x context."""

    def of(self, learner_id: str) -> int:
        return self.per_learner.get(learner_id, self.largest)

    @classmethod
    def of_recipe(cls, recipe: Recipe) -> TokenBounds | None:
        """None if the recipe lists no learners (no batch to bound by)."""
        if not recipe.learners:
            return None
        context = recipe_context_tokens(recipe)
        per = {s.learner_id: int(s.island_batch) * context for s in recipe.learners}
        return cls(per_learner=per, largest=max(per.values()))


def create_run(run: str | RunHandle, config: DilocoConfig, recipe: Recipe, *,
               model: torch.nn.Module | None = None, fork_from: RunReader | None = None, fork_round: int = 0,
               storage_options: Mapping[str, Any] | None = None) -> SynchronizerStore:
    """The one way to create a run: its frozen config, fragment plan, version-0 weights and recipe
    go to the bucket at ``run`` (a URL, or a run handle already opened), create-once
    (:class:`~atoll.storage.validation.RunExistsError` if a run is there), through a
    :class:`~atoll.storage.creation.RunCreator`. Returns the new run's synchronizer handle (the
    creator holds the synchronizer's grant), beside ``run`` when that is a handle.

    Where the fragment plan and the version-0 weights come from:

    * by default, the model the recipe builds (a preset, a config file);
    * ``model``: a user's own model instance (a DDP wrapper is unwrapped), for a model atoll cannot
      build (``atoll.join``): the recipe's ``model`` is then informational, the synchronizer never
      builds it unless the recipe asks for evaluation;
    * ``fork_from``: the committed global state of round ``fork_round`` (0: the latest) of another
      run, and that run's plan; ``run.json`` records where it came from. The source is only read.

    ``recipe.learners`` must list every learner (ids, batch sizes and ``context_tokens`` bound the
    tokens a step may claim). The synchronizer evaluates the global model with the recipe's model
    factory and data (next-token loss: the model maps token ids [B, T] to logits [B, T, V]); if
    atoll cannot build or run a user's model, set ``recipe.eval_batches = 0``.
    """
    recipe.check(config)
    if model is not None and fork_from is not None:
        raise ValueError("a run starts from a model or from a fork, not both")
    if fork_round and fork_from is None:
        raise ValueError("fork_round without fork_from: give the run to fork")
    extra: dict[str, Any] = {"recipe": recipe.to_dict()}
    if fork_from is not None:
        plan, params, extra["forked_from"] = _fork_point(fork_from, fork_round)
    else:
        plan, params = _initial_state(_unwrapped(model) if model is not None else recipe.model_factory()(), config)
    creator = RunCreator.beside(run) if isinstance(run, RunHandle) else RunCreator.open(run, storage_options)
    creator.init_run(config, plan, params, extra=extra)
    if model is None:  # atoll's learners read the recipe's corpus (a user's loop brings its own data):
        recipe.data.corpus()  # materialize the token cache once, before learners race to build it
    return SynchronizerStore.beside(creator)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a user's DDP wrapper (its parameter names are those the learners see)."""
    module = getattr(model, "module", None)
    return module if isinstance(module, torch.nn.Module) else model


def _initial_state(model: torch.nn.Module, config: DilocoConfig) -> tuple[FragmentPlan, dict[str, torch.Tensor]]:
    """The fragment plan and version-0 weights of ``model``."""
    plan = plan_fragments(model, num_fragments=config.num_fragments, inner_steps=config.inner_steps)
    return plan, {n: p.detach().cpu() for n, p in model.named_parameters()}


def _fork_point(source: RunReader, fork_round: int) -> tuple[FragmentPlan, Mapping[str, torch.Tensor], dict[str, Any]]:
    """The plan, the global weights of round ``fork_round`` (0: the latest) of ``source``, and the
    provenance that ``run.json`` records."""
    if not source.exists():
        raise FileNotFoundError(f"no run at {source.url} to fork")
    latest = source.latest_round()
    at = latest if fork_round <= 0 else fork_round
    if at > latest:
        raise ValueError(f"cannot fork {source.url} at round {at}: only {latest} rounds are committed")
    state = source.read_global_state(at)
    return source.plan, state.params, {"url": source.url, "run_id": source.manifest.run_id, "round": at}


EVAL_BATCH_SIZE = 16
"""Sequences per validation batch (``Recipe.eval_batches`` counts these batches)."""


class RecipeEvaluator:
    """Validation loss of a full parameter set, on the recipe's validation split (deterministic):
    the recipe's model built once on ``device`` (default the host), its forward pass under
    ``autocast`` ('' or 'bf16'). Call it with the parameters to measure."""

    def __init__(self, store: RunReader, *, device: torch.device | None = None, autocast: str = "") -> None:
        recipe = load_recipe(store)
        self.model = recipe.model_factory()().to(device or torch.device("cpu"))
        self.device = next(self.model.parameters()).device
        self.autocast = autocast
        self.batches = recipe.eval_batches
        self.val = recipe.data.corpus().val
        self.context = recipe.context_for(self.model)
        windows = min(self.batches * EVAL_BATCH_SIZE, max(0, (len(self.val) - 1) // self.context))
        self.tokens = windows * self.context
        """Tokens one evaluation predicts (windows x context): its cost, the same every time."""

    def __call__(self, params: Mapping[str, torch.Tensor]) -> float:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])
        with autocast(self.device, self.autocast):
            return data_mod.evaluate(self.model, self.val, batches=self.batches, batch_size=EVAL_BATCH_SIZE,
                                     context_tokens=self.context)


def make_evaluator(store: RunReader, *, device: torch.device | None = None, autocast: str = "") -> RecipeEvaluator:
    """The run's :class:`RecipeEvaluator` (on the host by default)."""
    return RecipeEvaluator(store, device=device, autocast=autocast)


@dataclass(frozen=True, kw_only=True)
class RoundSchedule:
    """When the synchronizer stops, evaluates and checkpoints. Owned by the recipe in run.json
    (a run without a recipe, e.g. one built by hand in a test, runs forever and never evaluates)."""

    max_rounds: int | None = None
    """Stop after committing this round; None: never."""

    eval_every_rounds: int = 0
    """Validation loss every this many rounds (0: never); the last round is always evaluated."""

    checkpoint_every_rounds: int = 0
    """Consolidated checkpoint every this many rounds (0: only at the last round)."""

    evaluate: bool = True
    """False: never evaluate, not even the last round (``Recipe.eval_batches = 0``: a user's model
    that atoll's evaluator cannot run)."""

    def is_last(self, round_: int) -> bool:
        return self.max_rounds is not None and round_ >= self.max_rounds

    def evaluates(self, round_: int) -> bool:
        """The one place that decides whether round ``round_`` is evaluated."""
        every = self.eval_every_rounds
        return self.evaluate and (bool(every and round_ % every == 0) or self.is_last(round_))

    def newest_evaluated(self, after: int, through: int) -> tuple[int | None, int]:
        """The newest round in (``after``, ``through``] that :meth:`evaluates`, or None; and how
        many other rounds in that range it evaluates (an evaluator that fell behind skips them)."""
        if not self.evaluate or through <= after:
            return None, 0
        found: list[int] = []
        every = self.eval_every_rounds
        if every:
            last = through - through % every
            found += [last] if last > after else []
        if self.max_rounds is not None and after < self.max_rounds <= through:
            found.append(self.max_rounds)
        if not found:
            return None, 0
        newest = max(found)
        scheduled = (through // every - after // every) if every else 0
        scheduled += 1 if self.max_rounds is not None and after < self.max_rounds <= through and (
            not every or self.max_rounds % every) else 0
        return newest, max(0, scheduled - 1)

    def checkpoints(self, round_: int) -> bool:
        """The one place that decides whether round ``round_`` writes a consolidated checkpoint."""
        every = self.checkpoint_every_rounds
        return bool(every and round_ % every == 0) or self.is_last(round_)

    @classmethod
    def of(cls, store: RunReader) -> RoundSchedule:
        """The schedule of the run in ``store``: from its recipe, or the defaults if it has none."""
        if "recipe" not in store.manifest.extra:
            return cls()
        recipe = load_recipe(store)
        return cls(max_rounds=recipe.max_rounds, eval_every_rounds=recipe.eval_every_rounds,
                   checkpoint_every_rounds=recipe.checkpoint_every_rounds, evaluate=recipe.eval_batches > 0)
