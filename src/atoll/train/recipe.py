"""A run's recipe: which model, which data, which learners, how they train.

The recipe is stored in the bucket with the run (``run.json`` ``extra.recipe``), so any process
that knows only the run URL and its learner id can rebuild the same model and its own data
shard. That is what lets a learner be restarted anywhere, by hand, by the local runner or by a
Prefect worker, and it keeps the bucket the single source of truth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from atoll.core.config import ConfigError, DilocoConfig
from atoll.storage.validation import validate_learner_id
from atoll.train.device import DeviceError, check_autocast

__all__ = [
    "InnerOptimConfig",
    "LearnerSpec",
    "SHARD_CHOICES",
    "DataSpec",
    "Recipe",
    "lr_at_step",
    "demo_recipe",
    "smoke_recipe",
    "gpu_recipe",
    "COMPILE_CHOICES",
    "SAVE_MOMENTS_CHOICES",
    "RECIPE_PRESETS",
]


@dataclass(frozen=True, kw_only=True)
class InnerOptimConfig:
    """Each learner's own AdamW: linear warmup on its own steps, then cosine decay over the run.

    With ``schedule="run"`` (default) the cosine follows the *run's* progress, the newest committed
    round a learner has seen over ``Recipe.max_rounds``, so fast and slow learners anneal together
    and all reach the floor as the run ends, as one data-parallel model would. With
    ``schedule="steps"`` it follows each learner's own step counter over ``total_steps``: then a
    fast learner reaches the floor early and idles there while a slow one stops far above it
    (measured in benchmarks/quality.py).
    """

    lr: float = 3e-3
    """Peak inner learning rate."""

    warmup_steps: int = 20
    """Steps of linear warmup from 0 to ``lr``, on the learner's own step counter."""

    schedule: str = "run"
    """What the cosine follows: 'run' (committed rounds / max_rounds, shared by all learners) or
    'steps' (the learner's own step counter / total_steps)."""

    total_steps: int = 2000
    """For ``schedule="steps"``: length of the cosine; after it the lr stays at ``lr * min_lr_ratio``."""

    min_lr_ratio: float = 0.1
    """Floor of the cosine as a fraction of ``lr``."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""

    beta1: float = 0.9
    """AdamW beta1."""

    beta2: float = 0.95
    """AdamW beta2."""

    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""

    fused: bool = False
    """Use torch's fused AdamW kernel (one kernel for every parameter's update instead of a few per
    tensor) where the parameters' device has one (CUDA, and the CPU in recent torch); elsewhere the
    default implementation. Same math; rounding may differ in the last bits."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"inner lr must be finite and > 0 (got {self.lr!r})")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ConfigError("inner warmup_steps must be >= 0 and total_steps >= 1")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"inner min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio!r})")
        if self.schedule not in ("run", "steps"):
            raise ConfigError(f"inner schedule must be 'run' or 'steps' (got {self.schedule!r})")

    def make(self, params: Any) -> torch.optim.AdamW:
        params = list(params)
        kwargs: dict[str, Any] = {"lr": self.lr, "betas": (self.beta1, self.beta2), "weight_decay": self.weight_decay}
        if self.fused:
            try:
                return torch.optim.AdamW(params, **kwargs, fused=True)
            except RuntimeError:  # no fused kernel for this device or dtype: the default implementation
                pass
        return torch.optim.AdamW(params, **kwargs)


def lr_at_step(cfg: InnerOptimConfig, step: int, progress: float | None = None) -> float:
    """Learning rate for 1-based ``step``: linear warmup, then cosine to ``lr * min_lr_ratio``.

    The cosine runs over ``progress`` in [0, 1] when it is given (the run's progress: what a
    learner passes under ``schedule="run"``), else over ``(step - warmup_steps) / (total_steps -
    warmup_steps)``. The warmup always counts the caller's own steps.
    """
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if progress is None:
        progress = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, progress))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


SHARD_CHOICES = ("ddp", "fsdp2")
"""Valid ``LearnerSpec.shard`` settings."""

COMPILE_CHOICES = ("off", "auto", "on")
"""Valid ``LearnerSpec.compile`` settings."""

SAVE_MOMENTS_CHOICES = ("fp32", "bf16")
"""Valid ``Recipe.save_moments_dtype`` settings."""


@dataclass(frozen=True, kw_only=True)
class LearnerSpec:
    """One island: who it is and how it differs from the others."""

    learner_id: str
    """Unique id (letters, digits, '-', '_', '.'): names its bucket prefix and its Prefect runs."""

    batch_size: int = 16
    """Sequences per inner step on each rank of this learner (the island trains on
    ``ranks * batch_size`` sequences per step)."""

    ranks: int = 1
    """Processes of this island (one per local GPU; gloo CPU processes in tests): a torch.distributed
    group doing DDP inner steps (or FSDP2: ``shard``), rank 0 doing the bucket I/O. Give its pool
    ``ranks`` GPUs per learner."""

    shard: str = "ddp"
    """How an island of ``ranks > 1`` splits the work: 'ddp' (every rank holds the whole model and
    its AdamW state; gradients are all-reduced) or 'fsdp2' (``torch.distributed.fsdp.fully_shard``:
    parameters, gradients and AdamW state are sharded over the ranks, for models that do not fit
    on one device). Ignored by a one-rank learner."""

    slowdown: float = 1.0
    """>= 1: each step takes this many times longer (stands in for older chips locally)."""

    pool: str = "local"
    """Prefect work pool (or just a label for local runs) this learner runs on."""

    device: str = "auto"
    """Where this island trains: 'auto' (CUDA, then MPS, then CPU), 'cpu', 'cuda', 'cuda:N' or 'mps'.
    The learner flow's ``device`` parameter overrides it for one launch."""

    autocast: str = ""
    """'' (fp32 everywhere) or 'bf16': autocast the inner forward pass to bf16. Parameters, AdamW
    state, deltas and the outer step stay fp32. The learner flow's ``autocast`` parameter overrides it."""

    micro_batch: int = 0
    """Sequences per forward/backward pass (0: the whole ``batch_size`` in one pass). A step then
    accumulates the gradients of ``batch_size / micro_batch`` passes before its one AdamW update,
    so a step's token batch can exceed what fits in device memory; it must divide ``batch_size``."""

    compile: str = "off"
    """``torch.compile`` the model of atoll's own loop: 'off', 'on', or 'auto' (on CUDA only, and
    back to eager if compiling fails). Compiling costs a minute or so at the first steps."""

    command: tuple[str, ...] = ()
    """A user's own training script to run as this learner instead of atoll's loop (argv, e.g.
    ``("python", "train.py", "--config", "a.yaml")``): the learner flow runs it with
    ``$ATOLL_RUN_URL``, ``$ATOLL_LEARNER_ID`` and ``$ATOLL_FLOW_RUN_ID`` set, and the script joins
    with ``atoll.join(...)`` (docs/byo-loop.md). Leases, fencing, stop and relaunch work as for
    atoll's loop. ``batch_size`` x ``ranks`` x ``Recipe.context_tokens`` must still bound the tokens
    one of its steps claims. The learner flow's ``command`` parameter overrides it for one launch."""

    @property
    def island_batch(self) -> int:
        """Sequences per inner step of the whole island (all ranks)."""
        return self.batch_size * self.ranks

    def __post_init__(self) -> None:
        validate_learner_id(self.learner_id)
        object.__setattr__(self, "command", tuple(self.command))  # a JSON list when read back
        if not all(isinstance(a, str) for a in self.command):
            raise ConfigError(f"learner {self.learner_id}: command must be a list of strings (argv)")
        try:  # the form only: whether this machine has that device is checked where the learner runs
            if self.device.strip().lower() != "auto":
                torch.device(self.device.strip().lower())
        except (RuntimeError, ValueError, AttributeError):
            raise ConfigError(f"learner {self.learner_id}: device must be 'auto', 'cpu', 'cuda[:N]' or 'mps' "
                              f"(got {self.device!r})") from None
        try:
            check_autocast(self.autocast, knob=f"learner {self.learner_id}: autocast")
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        if self.batch_size < 1:
            raise ConfigError(f"learner {self.learner_id}: batch_size must be >= 1")
        if self.ranks < 1:
            raise ConfigError(f"learner {self.learner_id}: ranks must be >= 1")
        if self.micro_batch < 0 or (self.micro_batch and self.batch_size % self.micro_batch):
            raise ConfigError(f"learner {self.learner_id}: micro_batch must be 0 or divide batch_size "
                              f"{self.batch_size} (got {self.micro_batch})")
        if self.compile not in COMPILE_CHOICES:
            raise ConfigError(f"learner {self.learner_id}: compile must be one of {COMPILE_CHOICES} "
                              f"(got {self.compile!r})")
        if self.shard not in SHARD_CHOICES:
            raise ConfigError(f"learner {self.learner_id}: shard must be one of {SHARD_CHOICES} (got {self.shard!r})")
        if not (self.slowdown >= 1 and math.isfinite(self.slowdown)):
            raise ConfigError(f"learner {self.learner_id}: slowdown must be >= 1 (got {self.slowdown!r})")


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where tokens come from. Default: the Python standard library's own source, as bytes."""

    kind: str = "stdlib"
    """'stdlib' (default corpus, no download) or 'tokens' (your pre-tokenized shards)."""

    max_corpus_mb: float = 8.0
    """For 'stdlib': how much of the standard library to use (MB of source)."""

    train_url: str = ""
    """For 'tokens': fsspec URL of the flat train token file."""

    val_url: str = ""
    """For 'tokens': fsspec URL of the flat validation token file."""

    dtype: str | None = None
    """For 'tokens': 'uint16' or 'uint32' (else read from the sidecar JSON)."""

    seed: int = 0
    """Seed of every learner's batch order."""

    shard: str = "interleaved"
    """How the train tokens are split among learners: 'interleaved' (learner i takes every M-th
    window from window i: each shard is a uniform sample of the corpus) or 'contiguous' (learner
    i takes the i-th 1/M of the tokens: shards differ whenever the corpus is ordered)."""

    def __post_init__(self) -> None:
        if self.kind not in ("stdlib", "tokens"):
            raise ConfigError(f"data kind must be 'stdlib' or 'tokens' (got {self.kind!r})")
        if self.shard not in ("interleaved", "contiguous"):
            raise ConfigError(f"data shard must be 'interleaved' or 'contiguous' (got {self.shard!r})")
        if self.kind == "tokens" and not (self.train_url and self.val_url):
            raise ConfigError("data kind 'tokens' needs train_url and val_url")

    def corpus(self) -> Any:
        from atoll.train import data

        if self.kind == "stdlib":
            return data.stdlib_corpus(max_corpus_mb=self.max_corpus_mb)
        return data.token_corpus(self.train_url, self.val_url, dtype=self.dtype)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Everything besides the DiLoCo config that a run needs to be rebuilt from its bucket."""

    model: str | Mapping[str, Any] = "tiny"
    """Preset name ('micro', 'tiny', ...), a GPTConfig as a dict, or 'package.module:function'."""

    model_seed: int = 0
    """Seed of the initial weights (every process builds the identical start)."""

    context_tokens: int = 0
    """Sequence length of a training window. 0: the model's ``config.context_tokens`` (atoll's GPT);
    set it for your own model."""

    data: DataSpec = field(default_factory=DataSpec)
    """Where the tokens come from."""

    learners: tuple[LearnerSpec, ...] = ()
    """The islands; their count must equal the config's num_learners."""

    inner: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    """Inner optimizer of every learner."""

    max_rounds: int = 48
    """The run is finished once this many outer rounds are committed."""

    eval_every_rounds: int = 8
    """Validation loss of the global model every this many rounds (0: never)."""

    eval_batches: int = 4
    """Validation batches (of 16 sequences) per evaluation; 0: never evaluate (a user's model that
    atoll's evaluator, next-token loss on the recipe's data, cannot run)."""

    checkpoint_every_rounds: int = 0
    """Consolidated checkpoint every this many rounds (0: only at the end)."""

    save_every_steps: int | None = None
    """An explicit cadence of the saves of each learner's inner state (AdamW moments, step, data
    cursor) for rejoin: every this many of its own steps; 0: only when it exits. It wins over the
    budget below, which it then ignores. None (default): the budget paces the saves
    (:mod:`atoll.train.save_pacing`)."""

    save_uplink_share: float | None = 0.1
    """The byte budget of saves (``save_every_steps`` None): a learner's saves may send at most
    this many bytes per byte it otherwise sends up (contributions, records, heartbeats) since its
    process started; 0.1 keeps saves within 10% of its uplink traffic. A save is taken once it
    fits, so the first comes after about 1 / share saves' worth of other traffic, and a learner
    whose saves are large next to its contributions saves rarely (``save_moments_dtype`` halves
    them). None: no byte budget (``save_every_s`` alone paces saves)."""

    save_every_s: float = 0.0
    """The time budget of saves (``save_every_steps`` None): at least this many seconds between
    two periodic saves, and from the learner's start to its first. 0: no time floor. A save is
    due when the byte budget and this both allow it."""

    save_moments_dtype: str = "fp32"
    """How the saved AdamW moments are stored: 'fp32' (a resume continues bit for bit) or 'bf16'
    (half the bytes, so twice the saves in the same budget). With 'bf16' a resume restores the
    learner's step and token counters, its data cursor, its ``user_state`` and AdamW's step
    counts exactly (the weights come from the run's global state either way); each moment comes
    back rounded to the nearest bf16 (a relative error of at most 2^-9), so the steps after the
    resume differ from an uninterrupted run's in the low bits, a difference that fades as the
    moments' averages take in new gradients (beta1 0.9: ~10 steps; beta2 0.95: ~20)."""

    def __post_init__(self) -> None:
        ids = [s.learner_id for s in self.learners]
        if len(ids) != len(set(ids)):
            raise ConfigError(f"learner ids must be unique, got {ids}")
        if self.max_rounds < 1:
            raise ConfigError(f"max_rounds must be >= 1 (got {self.max_rounds})")
        self._check_saves()

    def _check_saves(self) -> None:
        every, share, seconds = self.save_every_steps, self.save_uplink_share, self.save_every_s
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            raise ConfigError("save_every_steps must be None (saves paced by save_uplink_share and save_every_s) "
                              f"or an int >= 0 (0: save only on exit); got {every!r}")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not (share > 0 and math.isfinite(share))):
            raise ConfigError("save_uplink_share must be None (no byte budget) or a finite number > 0 "
                              f"(0.1: saves within 10% of a learner's uplink bytes); got {share!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                seconds >= 0 and math.isfinite(seconds)):
            raise ConfigError(f"save_every_s must be a finite number of seconds >= 0 (0: no time floor); got {seconds!r}")
        if every is None and share is None and seconds == 0:
            raise ConfigError("nothing paces the learners' saves: set save_every_steps (0: only on exit), "
                              "save_uplink_share or save_every_s")
        if self.save_moments_dtype not in SAVE_MOMENTS_CHOICES:
            raise ConfigError(f"save_moments_dtype must be one of {SAVE_MOMENTS_CHOICES} "
                              f"(got {self.save_moments_dtype!r})")

    def check(self, config: DilocoConfig) -> None:
        if len(self.learners) != config.num_learners:
            raise ConfigError(
                f"num_learners={config.num_learners} but the recipe lists {len(self.learners)} learners"
            )

    def learner(self, learner_id: str) -> tuple[int, LearnerSpec]:
        for i, spec in enumerate(self.learners):
            if spec.learner_id == learner_id:
                return i, spec
        raise KeyError(f"learner {learner_id!r} is not in this run's recipe ({[s.learner_id for s in self.learners]})")

    def replace(self, **changes: Any) -> Recipe:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def context_for(self, model: torch.nn.Module) -> int:
        """Training-window length for ``model``: the recipe's, else the model's config, else an error."""
        if self.context_tokens:
            return int(self.context_tokens)
        found = getattr(getattr(model, "config", None), "context_tokens", None)
        if not isinstance(found, int) or found < 1:
            raise ConfigError(
                f"{type(model).__name__} has no config.context_tokens: set Recipe(context_tokens=...) "
                "to the sequence length your model accepts"
            )
        return found

    def model_factory(self) -> Any:
        from atoll.train.model import GPTConfig, model_factory

        spec: Any = self.model
        if isinstance(spec, Mapping):
            spec = GPTConfig.from_dict(dict(spec))
        return model_factory(spec, seed=self.model_seed)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["learners"] = [dataclasses.asdict(s) for s in self.learners]
        if isinstance(self.model, Mapping):
            d["model"] = dict(self.model)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recipe:
        d = dict(d)
        return cls(
            **{
                **d,
                "data": DataSpec(**d.get("data", {})),
                "inner": InnerOptimConfig(**d.get("inner", {})),
                "learners": tuple(LearnerSpec(**s) for s in d.get("learners", ())),
            }
        )


def _learners(n: int, *, batch_size: int, slow: int = 0, slowdown: float = 1.5,
              pools: tuple[str, str] = ("cpu-fast", "cpu-slow")) -> tuple[LearnerSpec, ...]:
    return tuple(
        LearnerSpec(
            learner_id=f"learner-{i}",
            batch_size=batch_size,
            slowdown=slowdown if i >= n - slow else 1.0,
            pool=pools[1] if i >= n - slow else pools[0],
        )
        for i in range(n)
    )


def demo_recipe(num_learners: int = 4) -> tuple[DilocoConfig, Recipe]:
    """The demo: tiny GPT on the stdlib corpus, 4 learners (one 1.5x slower), K = 1 + grace, RDA.

    Each setting, with the paper's value beside it where they differ (benchmarks/quality.py
    measures them on CPU-sized models; core's defaults stay the paper's, for real model sizes):

    * H = P = 8 (paper 24), tau = 2 (paper 2), K = 1 + grace gamma 0.5 (paper the same): rounds
      frequent enough for a laptop. Without the grace window the quality benchmark lands 9% worse.
    * Outer step lr 0.8, momentum 0 (paper Nesterov 0.7 / 0.9): at this tiny scale the paper's values
      over-amplify RDA's merged update (1.25x data-parallel's loss with Nesterov 0.7 / 0.9, vs 1.003x with
      lr 1); RDA's merged step (its radius is the contributions' mean norm, not the norm of their
      mean) is still a little long at lr 1: 0.8 is 1.2-2.1% better on both corpora, 0.6 and 1.25
      worse (benchmarks/quality.py, docs/benchmarks.md).
    * int4 deltas up and int4 updates down, with error feedback (core's defaults: fp32 both ways):
      the communication front of benchmarks/quality.py --pareto puts int4 / int4 at H = 8 at 1.005x
      the fp32 row's loss with 1/63 of data-parallel's bytes per token (fp32 both ways: 1/11). H = 24
      reaches 1/189 at 1.029x and round pacing costs 3-4% at this scale, past the 2% budget.
    * Inner AdamW peak lr 6e-3: the best inner lr of the decoupled rows on both of the benchmark's
      corpora (grid 3e-3 / 6e-3 / 1.2e-2); warmup 20 own steps, then a cosine to 10% over the
      run's rounds (``schedule="run"``), so every learner, fast or slow, ends at the floor.
    * The fp32 master written on 2 versions of each fragment out of 16 (``master_snapshot_every``):
      the synchronizer writes 1.6 bytes a parameter per round instead of 5.1, and a reader
      rebuilds a master in between by replaying at most 14 of its rounds (docs/protocol.md).
    * Interleaved data shards (the default): every learner samples the whole corpus.
    * Inner-state saves paced by the default budget, within 10% of a learner's uplink bytes: one
      save (6.7 MB of fp32 moments) about every 1,000 steps, so over the demo's ~400 steps a
      learner saves when it exits (or is stopped), not periodically; a learner killed mid-run
      rejoins from the global state with fresh AdamW moments. (A fixed 50 steps, as before, sent
      twice the contributions' bytes in saves; docs/benchmarks.md#saves.)
    * 400 rounds: with rounds that keep up with the learners (``record_rounds``, as ``make demo``
      runs it) a learner takes H = 8 steps per fragment per sync, so 400 rounds are ~400 steps per
      fast learner (160 rounds were enough only while a synchronizer that fell behind let each
      learner run ~3.5x more steps per round).
    """
    config = DilocoConfig(num_learners=num_learners, num_fragments=8, inner_steps=8, overlap_steps=2,
                          min_quorum=1, initial_grace_s=1.0, outer_lr=0.8, outer_momentum=0.0,
                          compression="int4", downlink_compression="int4", master_snapshot_every=16)
    recipe = Recipe(
        model="tiny",
        data=DataSpec(max_corpus_mb=4.0),
        learners=_learners(num_learners, batch_size=8, slow=1),
        inner=InnerOptimConfig(lr=6e-3, warmup_steps=20, schedule="run"),
        max_rounds=400,
        eval_every_rounds=40,
        checkpoint_every_rounds=200,
    )
    return config, recipe


def smoke_recipe(num_learners: int = 3, *, max_rounds: int = 8) -> tuple[DilocoConfig, Recipe]:
    """For tests: micro GPT, 2 MB of corpus, P = 2 fragments, H = 2."""
    config = DilocoConfig(num_learners=num_learners, num_fragments=2, inner_steps=2, overlap_steps=1,
                          min_quorum=1, initial_grace_s=0.5)
    recipe = Recipe(
        model="micro",
        data=DataSpec(max_corpus_mb=2.0),
        learners=_learners(num_learners, batch_size=4),
        inner=InnerOptimConfig(lr=3e-3, warmup_steps=5, total_steps=200),
        max_rounds=max_rounds,
        eval_every_rounds=4,
        eval_batches=2,
        save_every_steps=5,
    )
    return config, recipe


def gpu_recipe(num_learners: int = 4, *, train_url: str = "", val_url: str = "",
               vocab_size: int = 0) -> tuple[DilocoConfig, Recipe]:
    """A first run on GPUs: GPT-2 small's body (12 x 768, context 1024), bf16, fused AdamW (docs/gpus.md).

    Without token shards it trains on the standard library's bytes (vocab 256, ~86 M parameters,
    untied head: nothing to download); with ``train_url`` / ``val_url`` (atoll's token-shard format,
    ``atoll.train.tokens.write_tokens``) and the tokenizer's ``vocab_size`` it is GPT-2 small itself
    (tied head; ~124 M at 50257). From the command line, a config file with ``preset: gpu`` sets
    ``recipe.data`` and ``recipe.model`` the same way. Each setting and why:

    * H = 64, P = 8, tau = 2: a 100 M model steps in ~30 ms on an H100-class chip, so H = P = 24
      (the paper's, for steps of seconds) would ask the synchronizer for ~8 fragment rounds a second
      per learner; H = 64 asks for one round per 8 steps, a publish of one 1/8 fragment every 8
      steps, and each fragment syncs every 64 steps (DiLoCo's H = 500 keeps quality at this size).
      K = 1 with the adaptive grace window, as the demo.
    * int4 deltas up and int4 updates down (error feedback): at ~1/60 of data-parallel's bytes per
      token the demo's front lost 0.5% (docs/benchmarks.md#communication); a 344 MB fp32 model
      would otherwise move 43 MB per publish.
    * Masters and momentum written on 2 versions out of 24 (``master_snapshot_every``; a GPU
      synchronizer writes all): ~1.8 bytes a parameter per round instead of 9.1 (docs/protocol.md).
    * Outer Nesterov lr 0.7, momentum 0.9 (the paper's, core's defaults): the demo's lr 0.8 without
      momentum is a correction measured for sub-million-parameter models, where the paper's
      momentum over-amplifies RDA's merged update (docs/benchmarks.md#quality); at 100 M and above
      the paper's values are the measured ones.
    * Inner AdamW lr 6e-4, betas (0.9, 0.95), weight decay 0.1 (GPT-2 small's), fused where the
      device has the kernel; warmup 200 own steps, cosine over the run to 10%.
    * bf16 autocast, ``torch.compile`` on CUDA only (``compile="auto"``: off on a CPU, eager again
      if compiling fails); 16 sequences x 1024 tokens per step and learner; set ``micro_batch`` on
      chips with less memory.
    * Inner-state saves paced by the default budget (within 10% of a learner's uplink bytes) with
      bf16 moments: a save is ~330 MB, taken about every 4,100 steps (~2 min at 30 ms a step; fp32
      moments would halve that rate and double the host copy each save takes in the step); a
      resume restores every counter and the data cursor exactly, the moments to bf16
      (``Recipe.save_moments_dtype``). Evaluation every 200 rounds, a checkpoint every 1000; 8000
      rounds are ~64 k steps, ~1 B tokens, per learner.
    """
    config = DilocoConfig(num_learners=num_learners, num_fragments=8, inner_steps=64, overlap_steps=2,
                          min_quorum=1, initial_grace_s=0.5, outer_lr=0.7, outer_momentum=0.9,
                          compression="int4", downlink_compression="int4", master_snapshot_every=24)
    tokens = bool(train_url or val_url)
    if tokens and vocab_size < 1:
        raise ConfigError("gpu_recipe: token shards need the tokenizer's vocab_size")
    model = {"vocab_size": vocab_size, "tie_embeddings": True} if tokens else {"vocab_size": 256, "tie_embeddings": False}
    model.update(context_tokens=1024, num_layers=12, num_heads=12, embed_dim=768)
    data = DataSpec(kind="tokens", train_url=train_url, val_url=val_url) if tokens else DataSpec(max_corpus_mb=32.0)
    learners = tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=16, pool="gpu", device="auto",
                                 autocast="bf16", compile="auto") for i in range(num_learners))
    recipe = Recipe(
        model=model,
        data=data,
        learners=learners,
        inner=InnerOptimConfig(lr=6e-4, warmup_steps=200, schedule="run", weight_decay=0.1, beta1=0.9, beta2=0.95,
                               fused=True),
        max_rounds=8000,
        eval_every_rounds=200,
        eval_batches=8,
        checkpoint_every_rounds=1000,
        save_moments_dtype="bf16",
    )
    return config, recipe


RECIPE_PRESETS = {"demo": demo_recipe, "smoke": smoke_recipe, "gpu": gpu_recipe}
