"""The training run's options: one typed model, which the Prefect UI renders as a form.

Only two kinds of thing live here:

* **which run**: create one from a preset or a config file, continue one, or fork one; what these
  create is then frozen in the run's ``run.json`` (the DiLoCo config and the recipe: model, data,
  learners and their pools, inner optimizer, max rounds, eval and checkpoint cadence);
* **how this training-run process orchestrates it**: learner deployments and their process
  knobs, polling, how often learners are watched, when a learner counts as dead.

Nothing here changes what is trained: to change the training, fork the run with a new config.
No Prefect import (pydantic only), so the CLI and notebooks build options without a server.
:func:`default_of` and :func:`option_parameters` read any options model's fields, for the CLI's
flags and the flows' parameters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from atoll.runs.healing import HealingPolicy

__all__ = ["FleetOptions", "TrainingRunOptions", "DEFAULT_SEGMENT_ROUNDS", "WATCH_EVERY_ROUNDS", "default_of",
           "option_parameters"]

WATCH_EVERY_ROUNDS = 5
"""Between rounds, the training run looks after its learners every this many rounds."""


class FleetOptions(BaseModel):
    """How the training run keeps its learner flow runs alive (one per learner, on its pool).

    The healing knobs default to :class:`~atoll.runs.healing.HealingPolicy`'s; ``threads``,
    ``poll_interval_s`` and ``orphan_timeout_s`` are the learner flow's parameter defaults too."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    manage: bool = Field(
        default=True,
        description="Launch, adopt and relaunch the run's learner flow runs. Off: start no learners "
        "(they are started by hand, e.g. `atoll learner`).")
    deployments: dict[str, str] = Field(
        default_factory=dict,
        description="Learner deployment per work pool, as `flow/deployment` (default: `atoll-learner/<pool>`).")
    threads: int = Field(default=1, ge=1, description="Torch threads of each learner process.")
    poll_interval_s: float = Field(
        default=0.2, gt=0, description="How often a learner looks for new global versions (s).")
    watch_every_s: float = Field(
        default=10.0, gt=0,
        description=f"While a round waits, look after the learners this often (s); also after every "
        f"{WATCH_EVERY_ROUNDS} rounds.")
    heartbeat_timeout_s: float = Field(
        default=HealingPolicy.heartbeat_timeout_s, gt=0,
        description="A learner whose newest heartbeat in the bucket is older than this (s) is not alive: a Running "
        "flow run of it is a zombie, cancelled and launched again.")
    startup_grace_s: float = Field(
        default=HealingPolicy.startup_grace_s, gt=0,
        description="A Running learner flow run that has taken no lease after this long (s) is a zombie.")
    orphan_timeout_s: float = Field(
        default=900.0, gt=0,
        description="A learner exits by itself (saving its state) when no round has been committed for this long (s).")
    relaunch_backoff_s: float = Field(
        default=HealingPolicy.relaunch_backoff_s, ge=0, description="Least time between two launches of one learner (s).")
    max_launches: int = Field(
        default=HealingPolicy.max_launches, ge=1, description="Most flow runs launched per learner by one training run.")

    def policy(self) -> HealingPolicy:
        return HealingPolicy(heartbeat_timeout_s=self.heartbeat_timeout_s, startup_grace_s=self.startup_grace_s,
                             relaunch_backoff_s=self.relaunch_backoff_s, max_launches=self.max_launches)

    def learner_parameters(self) -> dict[str, Any]:
        """Learner-flow parameters set by these options (besides the run URL and learner id)."""
        return {"threads": self.threads, "poll_interval_s": self.poll_interval_s,
                "orphan_timeout_s": self.orphan_timeout_s}


def default_of(model: type[BaseModel], name: str) -> Any:
    """The default of ``model``'s field ``name``: what the CLI's flags and the flows' parameters that
    set it default to, so each default is written once, on its field."""
    return model.model_fields[name].get_default(call_default_factory=True)


F = TypeVar("F", bound=Callable[..., Any])


def option_parameters(model: type[BaseModel]) -> Callable[[F], F]:
    """Give a function ``fn(**options)`` one keyword-only parameter per field of ``model``, with the
    field's type and default: what Prefect shows, validates and stores as a flow's parameters, so a
    flow's flat parameters are written once, as the model's fields."""

    def apply(fn: F) -> F:
        parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default_of(model, name),
                                        annotation=info.annotation) for name, info in model.model_fields.items()]
        returns = inspect.signature(fn).return_annotation
        fn.__signature__ = inspect.Signature(parameters, return_annotation=returns)  # type: ignore[attr-defined]
        return fn

    return apply


DEFAULT_SEGMENT_ROUNDS = 500
"""A segment of 500 rounds is about 2,000 nodes in the UI's graph (round flow run, its parent task
run, two task runs): far under the 10,000 at which the graph stops rendering."""


class TrainingRunOptions(BaseModel):
    """Everything one training-run flow run is given: which run, and how to orchestrate it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- which run -----------------------------------------------------------------------------
    run_url: str | None = Field(
        default=None,
        description="The run: a folder or an fsspec URL (s3://, gs://, file://). A new run is created there "
        "unless it exists, which is then continued.")
    preset: str = Field(default="demo", description="Recipe preset of a new run (`demo`, `smoke`, `gpu`).")
    learners: int = Field(default=0, ge=0, description="Learners of a new run (0: the preset's).")
    rounds: int = Field(
        default=0, ge=0, description="Outer rounds of a new or forked run (0: the preset's or the source's).")
    config_path: str | None = Field(
        default=None,
        description="YAML/JSON file with `config:` and `recipe:` keys for a new run (instead of the preset).")
    resume_from: str | None = Field(
        default=None,
        description="Continue this run from its last committed round (with `fork_round`: fork it into `run_url`).")
    fork_round: int | None = Field(
        default=None, ge=0, description="Fork `resume_from` at this round (0: its latest) into a new run at `run_url`.")
    storage_options: dict[str, Any] | None = Field(
        default=None,
        description="fsspec storage options of the bucket. Prefer credentials in the workers' environment: "
        "flow parameters show in the UI.")

    # -- how to orchestrate it -------------------------------------------------------------------
    poll_interval_s: float = Field(
        default=0.2, gt=0, description="Longest sleep of the synchronizer between two polls of an open round (s).")
    merge_device: str = Field(
        default="cpu", description="Where the synchronizer merges and takes the outer step: cpu, auto, cuda, "
        "cuda:N or mps (the training run's worker must have that device).")
    eval_device: str = Field(
        default="auto", description="Where the training run's evaluator measures validation loss, on its own thread "
        "and off the rounds' path: auto (CUDA if present, else CPU), cpu, cuda, cuda:N, mps, or off (no evaluator "
        "here: run python -m atoll.train.evaluator elsewhere, or none).")
    fleet: FleetOptions = Field(default_factory=lambda: FleetOptions(), description="The run's learner flow runs.")
    nest_rounds: bool = Field(
        default=False,
        description="Run each round flow run as a subflow of the training run (nested under it in the UI), "
        "instead of a flow run of its own tagged with the run and the segment: about twice the API calls and "
        "server writes per round, and a round waits for them (docs/prefect.md, 'What a round costs').")
    record_rounds: bool = Field(
        default=True,
        description="Run each round inline in the training-run process and record its flow run from a background "
        "thread (Running when the round opens, Completed when it commits, its phases as task runs at their real "
        "times, its log lines, the same artifacts and event), so no round waits for the Prefect API and the "
        "synchronizer keeps up with fast learners (small H). False: each round is a flow run executed by "
        "Prefect's engine, at ~0.6 s of API calls per round on the round's path: fine when rounds are seconds "
        "apart (large H), or to debug a round. Ignored with nest_rounds (docs/prefect.md, 'What a round costs').")
    pipeline_commits: bool = Field(
        default=True,
        description="Recorded rounds: hand each merged round's commit (its payload writes and record) to a "
        "background pipeline and open the next round at once, as `run_synchronizer` does; records stay in round "
        "order and create-once (docs/training.md). False: each round commits before the next one opens.")
    segment_rounds: int = Field(
        default=DEFAULT_SEGMENT_ROUNDS, ge=1,
        description="Rounds per training-run flow run: after this many, the run continues in a new flow run "
        "(a segment: same run tag, linked from this one), so no flow run's graph grows past the UI's limit. "
        "Needs the training run to come from a deployment (else it runs on in one flow run).")

    @property
    def target_url(self) -> str | None:
        """The URL of the run these options train: ``resume_from`` when continuing, else ``run_url``."""
        if self.resume_from and self.fork_round is None:
            return self.resume_from
        return self.run_url
