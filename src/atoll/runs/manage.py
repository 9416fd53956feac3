"""Which run a training run trains: a new one, the one it continues, or a fork (no Prefect import:
the CLI uses it too). This module picks; :func:`atoll.train.run.create_run` creates.

* **new**: a preset (``demo``, ``smoke``) or a config file becomes a run at ``run_url``.
* **continue** (resume): a run that exists at ``run_url`` simply carries on from its last
  committed round; everything needed is in the bucket, so it does not matter whether the Prefect
  database that ran it still exists.
* **fork**: a new run at ``run_url`` starts from the global weights of round ``fork_round`` of the
  run at ``resume_from`` (same config and recipe unless overridden; fresh outer-optimizer momentum
  and fresh learner inner state; round numbers restart at 1). ``run.json`` records where it came from.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from atoll.core.config import DilocoConfig
from atoll.storage.integrity import Keyring
from atoll.storage.paths import join_url, to_url
from atoll.storage.reader import RunReader
from atoll.train.recipe import RECIPE_PRESETS, Recipe
from atoll.train.run import create_run, load_recipe

__all__ = ["RunInfo", "load_config_file", "new_run_url", "prepare_run"]


@dataclass
class RunInfo:
    """What the training run needs to know about its run (small, JSON-able)."""

    run_url: str
    run_id: str
    latest_round: int
    max_rounds: int
    learners: list[dict[str, str]] = field(default_factory=list)
    """[{"learner_id", "pool"}] in recipe order."""
    action: str = "continued"
    """'created', 'continued' or 'forked'."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def finished(self) -> bool:
        return self.latest_round >= self.max_rounds


def new_run_url(bucket: str, name: str | None = None) -> str:
    """``<bucket>/<name>`` (default name: ``run-<8 hex>``)."""
    return join_url(to_url(bucket).rstrip("/"), name or f"run-{uuid.uuid4().hex[:8]}")


def load_config_file(path: str | Path) -> tuple[DilocoConfig, Recipe]:
    """A YAML or JSON file ``{config: {...DilocoConfig...}, recipe: {...Recipe...}}``; a ``preset`` key
    starts from that preset and the other keys override it."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        body = yaml.safe_load(text)
    else:
        body = json.loads(text)
    if not isinstance(body, Mapping):
        raise ValueError(f"{path}: expected a mapping with 'config' and 'recipe'")
    base_config, base_recipe = RECIPE_PRESETS[body.get("preset", "demo")]()
    config = DilocoConfig.from_dict({**base_config.to_dict(), **dict(body.get("config", {}))})
    recipe = Recipe.from_dict({**base_recipe.to_dict(), **dict(body.get("recipe", {}))})
    return config, recipe


def _preset(preset: str, learners: int, rounds: int) -> tuple[DilocoConfig, Recipe]:
    if preset not in RECIPE_PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {sorted(RECIPE_PRESETS)})")
    config, recipe = RECIPE_PRESETS[preset](learners) if learners else RECIPE_PRESETS[preset]()
    if rounds:
        recipe = recipe.replace(max_rounds=rounds)
    return config, recipe


def _info(store: RunReader, action: str) -> RunInfo:
    recipe = load_recipe(store)
    return RunInfo(run_url=store.url, run_id=store.manifest.run_id, latest_round=store.latest_round(),
                   max_rounds=recipe.max_rounds, action=action,
                   learners=[{"learner_id": s.learner_id, "pool": s.pool} for s in recipe.learners])


def prepare_run(
    run_url: str | None = None,
    *,
    preset: str = "demo",
    learners: int = 0,
    rounds: int = 0,
    config_path: str | None = None,
    resume_from: str | None = None,
    fork_round: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> RunInfo:
    """Create, continue or fork a run; returns its :class:`RunInfo`. Idempotent: calling it again
    (a restarted training run) continues what the first call created. Picks what the run starts
    from; :func:`~atoll.train.run.create_run` creates it."""
    opts = dict(storage_options or {}) or None
    if resume_from and fork_round is None:
        if run_url and to_url(run_url) != to_url(resume_from):
            raise ValueError("resume_from without fork_round continues that run; give no other run_url "
                             "(or give fork_round to fork it into run_url)")
        store = RunReader.open(resume_from, opts, read_only=True)  # the synchronizer opens it for writing
        if not store.exists():
            raise FileNotFoundError(f"no run at {resume_from} to resume")
        return _info(store, "continued")
    if not run_url:
        raise ValueError("run_url is required (or resume_from to continue an existing run)")
    store = RunReader.open(run_url, opts)  # not read-only: probed, and created through it if absent
    if store.exists():
        return _info(store, "continued")
    if resume_from:
        # A fork never writes to its source, and reads it against the key the source pins: the new
        # run may be created with a new synchronizer key (rotation, a lost key; docs/protocol.md §8).
        source = RunReader.open(resume_from, opts, read_only=True, keyring=Keyring.from_env().unanchored())
        if not source.exists():
            raise FileNotFoundError(f"no run at {resume_from} to fork")
        recipe = load_recipe(source)
        recipe = recipe.replace(max_rounds=rounds) if rounds else recipe
        store = create_run(store, source.config, recipe, fork_from=source, fork_round=int(fork_round or 0))
        return _info(store, "forked")
    config, recipe = load_config_file(config_path) if config_path else _preset(preset, learners, rounds)
    if config_path and rounds:
        recipe = recipe.replace(max_rounds=rounds)
    store = create_run(store, config, recipe)
    return _info(store, "created")
