"""A learner as a torch.distributed group: one island, N ranks doing DDP inner steps.

An island of ``LearnerSpec.ranks`` processes (one per local GPU, or gloo CPU processes) trains one
learner's model data-parallel:

* every rank builds the same :class:`~atoll.train.learner.Learner` from the bucket (reads only:
  recipe, latest global state, the learner's saved inner state), so all start identical;
* each inner step, every rank draws the island's batch (``ranks * batch_size`` windows, the same
  data stream as a one-rank learner with that batch) and trains on its slice; DDP averages the
  gradients, so the island takes the step one process would take on the whole batch (up to the
  order of floating-point sums); the counters count the island's tokens;
* **rank 0 does the bucket I/O**: it publishes the due fragment, polls for new commits, adopts
  new global versions and saves the inner state. After each step it broadcasts what it adopted
  (and the versions the lr schedule follows, and whether to stop); the other ranks receive the
  adopted fragments' tensors by broadcast, so every rank holds the same weights again;
* the island **fails as a unit**: the ranks are started with ``torch.multiprocessing.spawn``,
  which stops every rank when one fails and raises in the launching process (the learner flow),
  so orchestration relaunches the whole island, which rejoins from the bucket.

:func:`run_island` is what the learner flow and ``python -m atoll.train.local learner`` call for
a learner with ``ranks > 1``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from atoll.storage.bucket import RunStore
from atoll.train.device import resolve_device
from atoll.train.learner import Learner, LearnerOptions, LearnerSummary, _Fetcher
from atoll.train.run import load_recipe

__all__ = ["island_device", "run_island", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def island_device(setting: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:<rank>`` when the island runs on CUDA, else the setting."""
    dev = resolve_device(setting, knob="device")
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{rank}"
    return str(dev)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this rank when the launching process dies (the island fails as a unit)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: rank 0 also watches its parent pid in the loop
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _rank_main(rank: int, world: int, url: str, storage_options: dict[str, Any] | None, learner_id: str,
               options: LearnerOptions, port: int, result_dir: str, parent_pid: int) -> None:
    """One rank of the island (a spawned process)."""
    _die_with_parent(parent_pid)
    stop = {"flag": False}
    if rank == 0:  # SIGTERM (forwarded by the launcher): stop after this step, save, exit cleanly
        signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    else:  # the other ranks follow rank 0's decision
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if options.threads:
        torch.set_num_threads(options.threads)
    store = RunStore.open(url, storage_options)
    spec = load_recipe(store).learner(learner_id)[1]
    device = island_device(options.device if options.device is not None else spec.device, rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        summary = _island_loop(store, learner_id, options, rank=rank, world=world, device=device,
                               should_stop=lambda: stop["flag"] or os.getppid() != parent_pid)
        if rank == 0:
            with open(os.path.join(result_dir, "summary.json"), "w") as f:
                json.dump(dataclasses.asdict(summary), f)
    finally:
        dist.destroy_process_group()


def _island_loop(store: RunStore, learner_id: str, options: LearnerOptions, *, rank: int, world: int,
                 device: str, should_stop: Callable[[], bool] = lambda: False,
                 log: Callable[[str], None] = print) -> LearnerSummary:
    quiet: Callable[[str], None] = (lambda _: None) if rank else log
    learner = Learner(store, learner_id, log=quiet, lockstep=options.lockstep, device=device,
                      autocast=options.autocast, rank=rank, world=world,
                      publish_in_background=options.publish_in_background and rank == 0)
    ddp_devices = [learner.device.index] if learner.device.type == "cuda" else None
    learner.forward_model = DistributedDataParallel(learner.model, device_ids=ddp_devices)
    recipe = learner.recipe
    plan = learner.plan
    fetcher = _Fetcher(store, learner.start_round, options.poll_interval_s, retry=options.fetch_retry,
                       log=log) if rank == 0 else None
    if fetcher is not None:
        fetcher.start()

    def decide() -> tuple[list[int], list[int], bool, str | None]:
        """Rank 0: adopt what arrived, and whether the island stops (with an error to raise)."""
        assert fetcher is not None
        adopted: list[int] = []

        def adopt_ready() -> None:
            while True:
                try:
                    round_, fragment, tensors = fetcher.ready.get_nowait()
                except queue.Empty:
                    return
                if learner.adopt(round_, fragment, tensors) and fragment not in adopted:
                    adopted.append(fragment)

        def finished() -> bool:
            return fetcher.latest_round >= recipe.max_rounds

        try:
            fetcher.check()
            adopt_ready()
            while learner.waiting_for() is not None and not should_stop() and not finished():  # lock-step only
                fetcher.check()
                time.sleep(0.005)
                adopt_ready()
            if recipe.save_every_steps and learner.step_count % recipe.save_every_steps == 0:
                learner.save()
            if options.log_every_steps and learner.step_count % options.log_every_steps == 0:
                log(learner.progress_line())
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised here
            return adopted, learner.versions, True, repr(e)
        stop = (should_stop() or finished()
                or (options.max_steps is not None and learner.summary.steps >= options.max_steps))
        return adopted, learner.versions, stop, None

    error: BaseException | None = None
    try:
        while True:
            learner.step()  # DDP: the gradients are averaged over the island's ranks
            msg: list[Any] = [None]
            if rank == 0:
                try:
                    msg = [decide()]
                except BaseException as e:  # noqa: BLE001 - tell the other ranks, then raise
                    error = e
                    msg = [([], learner.versions, True, repr(e))]
            dist.broadcast_object_list(msg, src=0)
            adopted, versions, stop, failure = msg[0]
            # Every rank takes rank 0's version of each adopted fragment (AdamW moments stay).
            with torch.no_grad():
                for p in adopted:
                    for name in plan.fragments[p]:
                        dist.broadcast(learner.params[name].data, src=0)  # same order on every rank
            if rank:
                learner.versions = list(versions)  # the lr schedule follows the run's progress
            if failure is not None:
                if error is not None:
                    raise error
                raise RuntimeError(f"island rank 0 failed: {failure}")
            if stop:
                break
    finally:
        if fetcher is not None:
            fetcher.stop.set()
            fetcher.join(timeout=5)
    if rank == 0:
        learner.save()
        s = learner.summary
        log(f"{learner_id}: island of {world} ranks stopped at step {learner.step_count} "
            f"({s.published} published, {s.aligned} aligned)")
    return learner.summary


def run_island(store: RunStore, learner_id: str, *, options: LearnerOptions | None = None,
               ranks: int | None = None, storage_options: Mapping[str, Any] | None = None,
               log: Callable[[str], None] = print) -> LearnerSummary:
    """Train learner ``learner_id`` as an island of ``ranks`` processes (default: its recipe's ``ranks``).

    Blocks until the island stops (the run is finished, or ``options.max_steps``); returns rank
    0's summary. Any rank failing stops them all and raises here. Each rank opens the run at
    ``store.url`` itself, with ``storage_options`` (credentials otherwise come from the environment,
    which the ranks inherit).
    """
    import tempfile

    options = options or LearnerOptions()
    spec = load_recipe(store).learner(learner_id)[1]
    world = int(ranks or spec.ranks)
    if world < 1:
        raise ValueError(f"an island needs >= 1 rank, got {world}")
    log(f"{learner_id}: starting an island of {world} ranks")
    with tempfile.TemporaryDirectory(prefix="atoll-island-") as tmp:
        ctx = mp.start_processes(_rank_main, nprocs=world, join=False, start_method="spawn",
                                 args=(world, store.url, dict(storage_options or {}) or None, learner_id, options,
                                       free_port(), tmp, os.getpid()))
        assert ctx is not None
        previous = _forward_sigterm([p.pid for p in ctx.processes if p.pid is not None])
        try:
            while not ctx.join():  # raises (and stops every rank) as soon as one rank fails
                pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        with open(os.path.join(tmp, "summary.json")) as f:
            data = json.load(f)
    return LearnerSummary(**data)


def _forward_sigterm(pids: list[int]) -> Any:
    """SIGTERM to the launcher goes to rank 0, which stops the island after its current step."""
    if threading.current_thread() is not threading.main_thread() or not pids:
        return None

    def forward(signum: int, frame: Any) -> None:
        try:
            os.kill(pids[0], signal.SIGTERM)
        except ProcessLookupError:
            pass

    return signal.signal(signal.SIGTERM, forward)
