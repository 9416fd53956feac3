"""atoll's own inner loop: the recipe's model, data shard and inner optimizer, one step at a time.

:class:`InnerLoop` is what a user's training loop is to :func:`atoll.join`, built from the run's
recipe: the model on the learner's device (``LearnerSpec.device`` or the launch's ``device``;
``auto``: CUDA, then MPS, then CPU), its :class:`~atoll.train.data.BatchStream` shard, AdamW with
warmup on the learner's own steps then cosine over the run's progress (rounds adopted /
max_rounds), an optional bf16 autocast of the forward pass, and the learner's ``slowdown``.

It is driven two ways, both through :meth:`Learner.record_step <atoll.train.learner.Learner.record_step>`
after every step, the path a user's loop takes too:

* :func:`run_learner`, in real time: the loop is a user of the same
  :class:`~atoll.train.hook.LearnerHook` as ``examples/plain_loop.py`` (lease, heartbeats, the
  fetcher of new versions, stop/fence/orphan exits, saves on schedule). An island's rank 0
  (:mod:`atoll.train.island`) plugs in through an :class:`IslandLink`;
* :class:`RecipeLearner`, step by step: a :class:`~atoll.train.learner.Learner` whose
  :meth:`~RecipeLearner.step` is one inner step, for the virtual-clock driver
  (:mod:`atoll.train.virtual`), an island's other ranks, tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from atoll.storage.learner_side import LearnerStore
from atoll.train.data import BatchStream
from atoll.train.device import autocast as autocast_context
from atoll.train.device import check_autocast, resolve_device
from atoll.train.hook import LearnerHook
from atoll.train.learner import Learner, LearnerOptions, LearnerSummary, Replica
from atoll.train.model import loss_fn
from atoll.train.publisher import BackgroundOutbox, Outbox
from atoll.train.recipe import lr_at_step
from atoll.train.run import load_recipe
from atoll.train.speed import RateMeter, flops_per_token

__all__ = ["InnerLoop", "IslandLink", "RecipeLearner", "run_learner"]


class InnerLoop:
    """The recipe's model, data shard and inner optimizer for learner ``learner_id``.

    ``device`` and ``autocast`` override the recipe's (the launch's settings). In an island of
    ``world`` ranks this is rank ``rank``: it draws the island's batch and trains on its slice
    (``forward_model`` is then the DDP or FSDP2 model, :mod:`atoll.train.island`).
    """

    def __init__(self, store: LearnerStore, learner_id: str, *, device: str | None = None, autocast: str | None = None,
                 rank: int = 0, world: int = 1) -> None:
        self.recipe = recipe = load_recipe(store)
        index, self.spec = recipe.learner(learner_id)
        knob = ("device (LearnerOptions.device, the learner flow's `device` parameter)" if device is not None
                else f"LearnerSpec.device of {learner_id}")
        self.device = resolve_device(device if device is not None else self.spec.device, knob=knob)
        self.autocast = check_autocast(autocast if autocast is not None else self.spec.autocast)
        self.rank, self.world = rank, world
        self.model: torch.nn.Module = recipe.model_factory()().to(self.device)
        self.forward_model: torch.nn.Module = self.model
        self.stream = BatchStream(recipe.data.corpus().train, context_tokens=recipe.context_for(self.model),
                                  learner_index=index, num_learners=store.config.num_learners,
                                  seed=recipe.data.seed, interleave=recipe.data.shard == "interleaved")
        self.opt: torch.optim.Optimizer = recipe.inner.make(self.model.parameters())
        self.compiled = compile_model(self.model, self.spec.compile, self.device)
        self.prefetch = self.device.type == "cuda"
        """Draw the next batch and start its copy to the device while the device still works on
        this step (pinned host memory, non-blocking): the host's batch work overlaps the step."""
        self._next: tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None = None

    def describe(self) -> str:
        """How this loop trains, for the learner's join line."""
        micro = f" in micro-batches of {self.spec.micro_batch}" if self.spec.micro_batch else ""
        return (f"batch {self.spec.batch_size}{micro}, slowdown {self.spec.slowdown:g}x, "
                f"device {self.device}{' bf16 autocast' if self.autocast else ''}"
                f"{', fused AdamW' if self.opt.defaults.get('fused') else ''}{', compiled' if self.compiled else ''}")

    def resume(self, learner: Learner) -> None:
        """Continue the data stream where the learner's saved inner state left it; save its cursor
        from now on (the position before a prefetched batch: that batch is not trained yet); its
        progress lines say tokens/s, and on CUDA MFU and peak memory."""
        self._next = None
        if learner.saved_cursor is not None:
            self.stream.load_state_dict(learner.saved_cursor)
        learner.data_cursor = self.cursor
        per_token = flops_per_token(self.model, self.recipe.context_for(self.model))
        learner.progress_extra = RateMeter(self.device, flops_per_token=per_token,
                                           tokens=lambda: learner.tokens_total, chips=self.world).line
        learner.speed_report = RateMeter(self.device, flops_per_token=per_token,  # its own window: publish to publish
                                         tokens=lambda: learner.tokens_total, chips=self.world).report

    def cursor(self) -> dict[str, Any]:
        """The data position of the next batch this loop will train on."""
        return dict(self._next[2]) if self._next is not None else self.stream.state_dict()

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The island's next batch, this rank's slice, on its way to the device; and the cursor before it."""
        cursor = self.stream.state_dict()
        b = self.spec.batch_size
        x, y = self.stream.next_batch(b * self.world)  # every rank draws the island's batch ...
        if self.world > 1:  # ... and trains on its own slice of it
            x, y = x[self.rank * b:(self.rank + 1) * b], y[self.rank * b:(self.rank + 1) * b]
        if self.device.type == "cuda":  # page-locked: the copy below runs without the host waiting
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True), cursor

    def _backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the step's batch, in micro-batches with accumulated gradients
        when ``LearnerSpec.micro_batch`` asks; the mean loss (not synced to the host)."""
        micro = self.spec.micro_batch or x.shape[0]
        chunks = list(zip(x.split(micro), y.split(micro), strict=True))
        total = torch.zeros((), device=self.device)
        for i, (xc, yc) in enumerate(chunks):
            with _gradient_sync(self.forward_model, i == len(chunks) - 1):
                with autocast_context(self.device, self.autocast):
                    loss = loss_fn(self.forward_model, xc, yc)
                (loss / len(chunks)).backward()
            total += loss.detach() / len(chunks)
        return total

    def step(self, learner: Learner, *, step_time_s: float | None = None) -> tuple[int, float, float]:
        """One inner step of ``learner``'s model: lr, batch, forward, backward, clip, AdamW.

        Returns the island's tokens, the loss and the step time: ``step_time_s`` when given (the
        virtual-clock driver), else the measured time, stretched by the learner's ``slowdown``."""
        learner.check_writes()  # a background write failed: stop here, loudly
        t0 = time.perf_counter()
        # Warmup on this learner's steps, cosine over the run's progress.
        for group in self.opt.param_groups:
            group["lr"] = lr_at_step(self.recipe.inner, learner.step_count + 1, learner.run_progress())
        x, y, _ = self._next if self._next is not None else self._draw()
        self._next = None
        self.opt.zero_grad(set_to_none=True)
        loss = self._backward(x, y)
        if self.recipe.inner.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.inner.grad_clip)
        self.opt.step()
        if self.prefetch:  # the device is still busy with this step: the host draws the next batch
            self._next = self._draw()
        loss_value = loss.item()
        if step_time_s is None:
            if self.spec.slowdown > 1:  # stand-in for an older chip: stretch the step
                time.sleep((self.spec.slowdown - 1) * (time.perf_counter() - t0))
            step_time_s = time.perf_counter() - t0
        return int(x.numel()) * self.world, loss_value, step_time_s  # the island's tokens


def compile_model(model: torch.nn.Module, setting: str, device: torch.device) -> bool:
    """``torch.compile`` ``model`` in place (its parameter names stay as they are) when ``setting``
    ('off', 'auto', 'on'; ``LearnerSpec.compile``) asks for it on ``device``; whether it did.
    'auto' compiles on CUDA only and lets a failed compilation fall back to eager."""
    if setting == "off" or (setting == "auto" and device.type != "cuda"):
        return False
    if setting == "auto":
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True  # a model the compiler cannot take runs eager
    model.compile()
    return True


def _gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[object]:
    """Skip an island's gradient all-reduce on all but the last micro-batch of a step (DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync``); nothing to skip for one rank."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()  # type: ignore[operator]
    if hasattr(model, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def unsynced() -> Iterator[None]:
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]
        return unsynced()
    return contextlib.nullcontext()


class RecipeLearner(Learner):
    """A :class:`~atoll.train.learner.Learner` on its own :class:`InnerLoop`, stepped by its
    caller, with no lease and no fetcher: :meth:`step` trains one inner step and records it."""

    def __init__(self, store: LearnerStore, learner_id: str, *, log: Callable[[str], None] = print,
                 lockstep: bool | None = None, incarnation: int = 0, device: str | None = None,
                 autocast: str | None = None, publish_in_background: bool = False, rank: int = 0, world: int = 1,
                 start_round: int | None = None) -> None:
        self.inner = InnerLoop(store, learner_id, device=device, autocast=autocast, rank=rank, world=world)
        super().__init__(store, learner_id, self.inner.model, self.inner.opt, log=log, lockstep=lockstep,
                         incarnation=incarnation, start_round=start_round, loop=self.inner.describe(),
                         outbox=BackgroundOutbox if publish_in_background else Outbox,
                         weights=Replica(publishes=rank == 0))
        self.inner.resume(self)

    @property
    def stream(self) -> BatchStream:
        return self.inner.stream

    @property
    def autocast(self) -> str:
        return self.inner.autocast

    @property
    def forward_model(self) -> torch.nn.Module:
        return self.inner.forward_model

    @forward_model.setter
    def forward_model(self, module: torch.nn.Module) -> None:
        self.inner.forward_model = module

    def step(self, *, step_time_s: float | None = None) -> None:
        """One inner step, then publish the fragment that is due (if any)."""
        tokens, loss, step_time_s = self.inner.step(self, step_time_s=step_time_s)
        self.record_step(tokens, loss=loss, step_time_s=step_time_s)


class IslandLink(Protocol):
    """What rank 0 of an island (:mod:`atoll.train.island`) adds to :func:`run_learner`'s loop."""

    world: int
    """Ranks of the island."""

    def attach(self, loop: InnerLoop, learner: Learner) -> None:
        """Once, after the learner is built (wraps the loop's model for DDP or FSDP2)."""

    def before_step(self, learner: Learner) -> None:
        """Before every step: the other ranks learn to take it, with what rank 0 adopted since."""

    def finish(self, learner: Learner, *, clean: bool) -> None:
        """When the loop ends, for any reason: the other ranks stop. ``clean``: the loop ended
        without an error (rank 0 may save next: a sharded island gathers its state first)."""


def run_learner(
    store: LearnerStore,
    learner_id: str,
    *,
    options: LearnerOptions | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
    link: IslandLink | None = None,
) -> LearnerSummary:
    """Train as learner ``learner_id`` of the run in ``store`` until it is time to exit.

    Takes the learner's next lease first (unless ``options.take_lease`` is False), then builds the
    inner loop and the learner from the bucket. Returns a summary whose ``exit_reason`` says why
    it stopped: "finished", "stopped", "orphaned", "sigterm", "max_steps", "should_stop" (inner
    state saved, final heartbeat ``exited``) or "fenced" (a newer copy holds the lease: nothing
    saved, nothing published after the fence was seen). Raises FetchError (and any other error)
    after a final ``exited`` heartbeat naming it.

    The loop is atoll's own inner step driving a :class:`~atoll.train.hook.LearnerHook`, the
    hook a user's training loop joins with (:func:`atoll.train.hook.join`).
    """
    options = options or LearnerOptions()
    built: list[InnerLoop] = []

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:  # once the session holds the lease
        built.append(InnerLoop(store, learner_id, device=options.device, autocast=options.autocast,
                               world=link.world if link is not None else 1))
        return built[0].model, built[0].opt, built[0].describe()

    hook = LearnerHook(store, learner_id, None, None, build=build, tokens_per_step=None, options=options, log=log,
                       on_exit="flag", should_stop=should_stop)
    with hook:
        assert hook.learner is not None
        _train(hook, built[0], hook.learner, link)
    return hook.summary


def _train(hook: LearnerHook, loop: InnerLoop, learner: Learner, link: IslandLink | None) -> None:
    """Inner steps until the hook says stop; an island's other ranks take each step too."""
    loop.resume(learner)
    clean = False
    try:
        if link is not None:
            link.attach(loop, learner)
        hook.poll_exit()  # the run may be finished already
        while not hook.should_exit:
            if link is not None:
                link.before_step(learner)
            tokens, loss, step_time_s = loop.step(learner)
            hook.step(tokens=tokens, loss=loss, step_time_s=step_time_s)
        clean = True
    finally:
        if link is not None:  # the other ranks stop with rank 0
            link.finish(learner, clean=clean)
