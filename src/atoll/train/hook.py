"""Bring your own training loop: any PyTorch trainer joins an atoll run as a learner.

    import atoll

    with atoll.join(run_url, "learner-3", model, optimizer, tokens_per_step=batch * context):
        for x, y in loader:                 # the user's loop, unchanged
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()                # atoll acts here, after every optimizer step
            optimizer.zero_grad()

:func:`join` registers a post-step hook on the optimizer. After each optimizer step it does what
atoll's own learner does after its inner step, with the very same code (atoll's own loop,
:func:`atoll.train.inner.run_learner`, is a user of this hook too: a
:class:`~atoll.train.session.LearnerSession` around :meth:`~atoll.train.learner.Learner.record_step`):

* publishes the due fragment's delta with its counters (encoded and written on a background
  thread, so the step does not wait for the bucket);
* overwrites fragments in place when a new global version lands (optimizer state is kept);
* saves what rejoin needs (the optimizer's state, the step counter and :attr:`LearnerHook.user_state`,
  a JSON dict for the loop's own position) when its pacing says so: within a share of its uplink
  bytes by default, or every ``save_every_steps`` (:mod:`atoll.train.save_pacing`), in the
  background;
* reports its tokens/s (and on CUDA its MFU and peak memory) with each contribution, for
  ``atoll status``;
* holds the learner's lease and heartbeats, so a newer copy fences this one, ``atoll stop`` and
  SIGTERM stop it cleanly, and Prefect's healing relaunches it when it dies.

When the learner must stop (the run is finished or stopped, SIGTERM, fenced, orphaned) the hook
raises :class:`~atoll.train.learner.LearnerExit` out of ``optimizer.step()``; the ``with`` block
saves and swallows it, so the loop needs no change. With ``on_exit="flag"`` nothing is raised and
the loop (or a framework callback) checks :attr:`LearnerHook.should_exit` instead.

Entering the block **overwrites the model's weights** with the run's latest global state (and the
optimizer's state with this learner's saved state, on rejoin): the bucket is the truth, the
model's own initialisation is only used when the run is created
(:func:`atoll.create_run <atoll.train.run.create_run>` with ``model=``).

Under ``torch.distributed`` (the user's own DDP: ``join`` sees an initialized default group of
more than one rank) the ranks form one island: rank 0 does all the bucket I/O and, after each
step, broadcasts whether to stop and the fragments it adopted; every rank must call ``join`` with
the same arguments and take the same steps. Counters count ``tokens_per_step x world`` tokens.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from atoll.storage.handle import RunHandle
from atoll.storage.learner_side import LearnerStore
from atoll.train.learner import Learner, LearnerExit, LearnerOptions, LearnerSummary, Replica
from atoll.train.lease import die_with_parent
from atoll.train.session import Build, LearnerSession
from atoll.train.speed import RateMeter, flops_per_token

__all__ = ["LearnerHook", "join"]

ENV_RUN_URL = "ATOLL_RUN_URL"
ENV_LEARNER_ID = "ATOLL_LEARNER_ID"
ENV_FLOW_RUN_ID = "ATOLL_FLOW_RUN_ID"
"""What the learner flow sets for a user's command (:mod:`atoll.flows.learner`): ``join()``
without a run URL or learner id reads them, so one script serves every learner."""


class LearnerHook:
    """One training loop as an atoll learner: what :func:`join` returns (a context manager).

    ``rank`` and ``world``: this process's place in the loop's torch.distributed group (``join``
    reads them; rank 0 does the bucket I/O and tells the others). ``should_stop`` (asked before
    each step) and ``build`` are for atoll's own loop (:func:`atoll.train.inner.run_learner`),
    which drives this hook like any user's loop: it passes no model and no optimizer but
    ``build``, which makes them (and says how they train) once the lease is held.
    """

    def __init__(self, store: LearnerStore, learner_id: str, model: torch.nn.Module | None,
                 optimizer: torch.optim.Optimizer | None, *, tokens_per_step: int | Callable[[], int] | None,
                 options: LearnerOptions, log: Callable[[str], None], on_exit: str, rank: int = 0, world: int = 1,
                 should_stop: Callable[[], bool] = lambda: False, build: Build | None = None) -> None:
        if on_exit not in ("raise", "flag"):
            raise ValueError(f"on_exit must be 'raise' or 'flag', got {on_exit!r}")
        if (model is None or optimizer is None) == (build is None):
            raise TypeError("LearnerHook needs the model and its optimizer, or (atoll's own loop) build")
        self.store, self.learner_id, self.model, self.optimizer = store, learner_id, model, optimizer
        self.tokens_per_step, self.options, self.log, self.on_exit = tokens_per_step, options, log, on_exit
        self.should_stop, self._build = should_stop, build
        self.loss: float | torch.Tensor | None = None
        """Set it to the step's loss (optional): it goes into contributions and progress lines."""
        self.exit_reason: str | None = None
        """Why the learner stops ("finished", "stopped", "sigterm", "fenced", ...); None while it trains."""
        self.rank, self.world = rank, world
        self.session: LearnerSession | None = None
        self.learner: Learner | None = None
        self._handle: Any = None
        self._t_last = 0.0

    # -- the user's view --------------------------------------------------------------------------
    @property
    def should_exit(self) -> bool:
        """True once the learner must stop: leave the loop (``on_exit="flag"``)."""
        return self.exit_reason is not None

    @property
    def user_state(self) -> dict[str, Any]:
        """A JSON dict saved with the learner's state and restored on rejoin: put the loop's own
        position here (epoch, batch index, scheduler step ...)."""
        assert self.learner is not None, "use it inside the with block"
        return self.learner.user_state

    @property
    def step_count(self) -> int:
        """Optimizer steps this learner has taken in the run (restored on rejoin)."""
        assert self.learner is not None, "use it inside the with block"
        return self.learner.step_count

    @property
    def run_progress(self) -> float:
        """The run's progress in [0, 1]: the newest global version this learner holds / the
        recipe's max_rounds. What atoll's own loop runs its lr cosine on (a schedule that follows
        the run, not this learner's step counter, keeps slow and fast learners in step)."""
        assert self.learner is not None, "use it inside the with block"
        return min(1.0, max(self.learner.versions) / self.learner.recipe.max_rounds)

    @property
    def summary(self) -> LearnerSummary:
        assert self.learner is not None
        return self.learner.summary

    def step(self, *, tokens: int | None = None, loss: float | torch.Tensor | None = None,
             step_time_s: float | None = None) -> None:
        """Call after each optimizer step when ``join(tokens_per_step=None)``; the optimizer hook
        calls it otherwise. ``tokens``: tokens this rank trained on in the step; ``step_time_s``:
        the step's duration when the loop knows better (default: the time since the last call)."""
        if self.learner is None:
            raise RuntimeError("LearnerHook.step() outside its with block")
        if self.exit_reason is not None:  # the loop went on after the exit was signalled
            if self.on_exit == "raise":
                raise LearnerExit(self.exit_reason)
            return
        if tokens is None:
            tpp = self.tokens_per_step
            if tpp is None:
                raise ValueError("pass step(tokens=...) or join(..., tokens_per_step=...)")
            tokens = int(tpp() if callable(tpp) else tpp)
        if loss is None:
            loss = self.loss
        now = time.perf_counter()
        step_time_s, self._t_last = (now - self._t_last if step_time_s is None else step_time_s), now
        with torch.no_grad():
            if self.rank == 0:
                reason = self._lead(tokens * self.world, loss, step_time_s)
            else:
                reason = self._follow(tokens * self.world, step_time_s)
        if reason is not None:
            self.exit_reason = reason
            if self.on_exit == "raise":
                raise LearnerExit(reason)

    def poll_exit(self) -> str | None:
        """Before the loop's first step (one process, rank 0): why the learner stops already (the
        run may be finished), as ``step`` asks after every step; sets :attr:`exit_reason`."""
        if self.session is None or self.world > 1:
            raise RuntimeError("LearnerHook.poll_exit() is for one process inside its with block")
        self.exit_reason = self.session.exit_reason_now()
        return self.exit_reason

    # -- rank 0: the session, then tell the other ranks ------------------------------------------
    def _lead(self, tokens: int, loss: float | torch.Tensor | None, step_time_s: float) -> str | None:
        session, learner = self.session, self.learner
        assert session is not None and learner is not None
        before = list(learner.versions)
        value = float(loss.item() if isinstance(loss, torch.Tensor) else loss) if loss is not None else None
        learner.record_step(tokens, loss=value, step_time_s=step_time_s)
        session.after_step()
        reason = session.exit_reason_now()
        if self.world > 1:
            adopted = [p for p, (v, seen) in enumerate(zip(learner.versions, before, strict=True)) if v != seen]
            _broadcast_step(learner, reason, adopted)
        return reason

    # -- ranks 1..N-1: counters only, fragments from rank 0 --------------------------------------
    def _follow(self, tokens: int, step_time_s: float) -> str | None:
        import torch.distributed as dist

        learner = self.learner
        assert learner is not None
        learner.step_count += 1
        learner.summary.steps += 1
        learner.summary.tokens += tokens
        msg: list[Any] = [None]
        dist.broadcast_object_list(msg, src=0)
        reason, adopted, versions = msg[0]
        learner.weights.broadcast(learner, adopted)
        learner.versions = list(versions)
        learner.summary.aligned += len(adopted)
        return reason if isinstance(reason, str) else None

    # -- entering and leaving -------------------------------------------------------------------
    def _given(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, str | None]:
        assert self.model is not None and self.optimizer is not None
        return self.model, self.optimizer, None

    def __enter__(self) -> LearnerHook:
        if self.rank == 0:
            self.session = LearnerSession(self.store, self.learner_id, self._build or self._given, options=self.options,
                                          should_stop=self.should_stop, log=self.log)
            self.session.__enter__()
            self.learner = self.session.learner
            assert self.learner is not None
            if self._build is not None:  # built in the session: the learner holds them
                self.model, self.optimizer = self.learner.model, self.learner.opt
            else:  # a user's loop: its speed in each contribution, for atoll status (atoll's loop sets its own)
                self.learner.speed_report = _speed_meter(self.learner, self.world).report
            if self.world > 1:
                _broadcast_ready(self.learner)
        else:
            assert self.model is not None and self.optimizer is not None, "build is for one process"
            self.learner = _follower(self.store, self.learner_id, self.model, self.optimizer, self.rank, self.world)
        if self.tokens_per_step is not None:
            assert self.optimizer is not None
            self._handle = self.optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step())
        self._t_last = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.rank == 0:
            assert self.session is not None
            if self.exit_reason is not None:
                self.session.reason = self.exit_reason
            elif exc is None:  # the loop ended by itself (its data ran out)
                self.session.reason = "should_stop"
            # Under torch.distributed every rank leaves its loop at the same step (the same loop,
            # or the stop rank 0 broadcast), so nothing more is sent here; a rank that fails is
            # the launcher's to stop (torchrun stops the others), and the island is relaunched.
            return bool(self.session.__exit__(exc_type, exc, tb))
        return isinstance(exc, LearnerExit)


def _speed_meter(learner: Learner, world: int) -> RateMeter:
    """Tokens/s, MFU (CUDA) and peak memory of a user's loop, from publish to publish."""
    config = getattr(learner.model, "config", None)
    context = learner.recipe.context_tokens or getattr(config, "context_tokens", 0)
    per_token = flops_per_token(learner.model, context if isinstance(context, int) else 0)
    return RateMeter(learner.device, flops_per_token=per_token, tokens=lambda: learner.tokens_total, chips=world)


def join(run: str | RunHandle | None = None, learner_id: str | None = None, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None, *, tokens_per_step: int | Callable[[], int] | None = None,
         storage_options: Mapping[str, Any] | None = None, options: LearnerOptions | None = None,
         log: Callable[[str], None] = print, on_exit: str = "raise") -> LearnerHook:
    """Join the run at ``run`` (a URL or an open run handle) as learner ``learner_id``, training
    ``model`` with ``optimizer`` in the caller's own loop. Use it as a context manager.

    ``run`` and ``learner_id`` default to ``$ATOLL_RUN_URL`` and ``$ATOLL_LEARNER_ID`` (set by the
    learner flow when it runs a user's command). ``tokens_per_step`` (an int, or a callable read
    after each step) makes every ``optimizer.step()`` a learner step; leave it None to call
    :meth:`LearnerHook.step` yourself (e.g. from a framework callback, with gradient
    accumulation). ``options``: :class:`~atoll.train.learner.LearnerOptions` (heartbeats, orphan
    timeout, ``log_every_steps`` ...); the flow run id is taken from ``$ATOLL_FLOW_RUN_ID``.
    """
    if model is None or optimizer is None:
        raise TypeError("join() needs the model and its optimizer")
    url = run if run is not None else os.environ.get(ENV_RUN_URL)
    lid = learner_id or os.environ.get(ENV_LEARNER_ID)
    if url is None or not lid:
        raise ValueError(f"join() needs the run URL and the learner id (arguments, or ${ENV_RUN_URL} and "
                         f"${ENV_LEARNER_ID} as the learner flow sets them)")
    if isinstance(url, RunHandle):
        store = url if isinstance(url, LearnerStore) else LearnerStore.beside(url)
    else:
        store = LearnerStore.open(url, storage_options)
    options = options or LearnerOptions()
    if options.flow_run_id is None and os.environ.get(ENV_FLOW_RUN_ID):
        import dataclasses

        options = dataclasses.replace(options, flow_run_id=os.environ[ENV_FLOW_RUN_ID])
    rank, world = _distributed()
    return LearnerHook(store, lid, model, optimizer, tokens_per_step=tokens_per_step, options=options,
                       log=log, on_exit=on_exit, rank=rank, world=world)


# -- torch.distributed: one island, rank 0 does the I/O -----------------------------------------
def _distributed() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast_ready(learner: Learner) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([(learner.step_count, list(learner.versions), learner.start_round)], src=0)


def _follower(store: LearnerStore, learner_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              rank: int, world: int) -> Learner:
    """Ranks 1..N-1: the same learner (same weights, same saved optimizer state) without bucket
    writes, built once rank 0 holds the lease (so an older copy saves nothing more)."""
    import torch.distributed as dist

    ready: list[Any] = [None]
    dist.broadcast_object_list(ready, src=0)
    step, versions, start_round = ready[0]
    # The global state of rank 0's round, not the newest: a commit between the two would leave
    # the ranks out of step.
    learner = Learner(store, learner_id, model, optimizer, log=lambda _: None, lockstep=False, start_round=start_round,
                      weights=Replica(publishes=False))
    if learner.step_count != step:
        raise RuntimeError(f"rank {rank} of learner {learner_id} loaded step {learner.step_count} but rank 0 is at "
                           f"step {step}: the learner's saved state changed while the island started")
    learner.versions = list(versions)
    return learner


def _broadcast_step(learner: Learner, reason: str | None, adopted: list[int]) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([(reason, adopted, list(learner.versions))], src=0)
    learner.weights.broadcast(learner, adopted)


# -- a user's script as a learner process (what the learner flow runs for LearnerSpec.command) ----
def run_command(command: list[str] | tuple[str, ...], *, run_url: str, learner_id: str,
                flow_run_id: str | None = None, extra_env: Mapping[str, str] | None = None,
                cwd: str | None = None, log: Callable[[str], None] = print) -> int:
    """Run a user's training script as learner ``learner_id`` and wait for it; returns its exit code.

    The script gets ``$ATOLL_RUN_URL``, ``$ATOLL_LEARNER_ID`` and ``$ATOLL_FLOW_RUN_ID`` (what
    :func:`join` reads when it is called without them) and the caller's environment (bucket
    credentials included). Its output is passed to ``log`` line by line. SIGTERM to this process
    is forwarded to the script, which saves and exits (``join`` handles it); if this process is
    SIGKILLed, the script is SIGKILLed too (Linux), so no orphan keeps training.
    """
    import signal
    import subprocess
    import threading

    if not command:
        raise ValueError("run_command needs a command (argv)")
    env = {**os.environ, **(extra_env or {}), ENV_RUN_URL: run_url, ENV_LEARNER_ID: learner_id,
           "PYTHONUNBUFFERED": "1"}
    if flow_run_id:
        env[ENV_FLOW_RUN_ID] = flow_run_id
    log(f"{learner_id}: running the user's command {list(command)!r}")
    proc = subprocess.Popen(list(command), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=functools.partial(die_with_parent, os.getpid()) if os.name == "posix" else None)
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        def forward(signum: int, frame: Any) -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

        previous = signal.signal(signal.SIGTERM, forward)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            log(raw.decode(errors="replace").rstrip("\n"))
        return proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
