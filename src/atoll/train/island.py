"""A learner as a torch.distributed group: one island, N ranks doing DDP (or FSDP2) inner steps.

An island of ``LearnerSpec.ranks`` processes (one per local GPU, or gloo CPU processes) trains one
learner's model data-parallel:

* every rank builds the same learner from the bucket (reads only: recipe, latest global state,
  the learner's saved inner state), so all start identical: rank 0 in
  :func:`~atoll.train.inner.run_learner`, the others as a :class:`~atoll.train.inner.RecipeLearner`;
* each inner step, every rank draws the island's batch (``ranks * batch_size`` windows, the same
  data stream as a one-rank learner with that batch) and trains on its slice; DDP averages the
  gradients, so the island takes the step one process would take on the whole batch (up to the
  order of floating-point sums); the counters count the island's tokens;
* **rank 0 does the bucket I/O**: it publishes the due fragment, polls for new commits, adopts
  new global versions and saves the inner state. After each step it broadcasts what it adopted
  (and the versions the lr schedule follows, and whether to stop); the other ranks receive the
  adopted fragments' tensors by broadcast, so every rank holds the same weights again;
* with ``LearnerSpec.shard = "fsdp2"`` the model is wrapped with
  ``torch.distributed.fsdp.fully_shard`` (each block of every ``nn.ModuleList``, then the root)
  instead of DDP: parameters, gradients, AdamW state and the learner's bases are DTensor shards
  (the learner's weights are then :class:`Shards` instead of a replica).
  Every rank then takes part in what touches them: a publish gathers the due fragment's delta
  (``full_tensor()``) on every rank and rank 0 writes it; a fragment rank 0 adopted is scattered
  from rank 0 into every rank's shards (``distribute_tensor``) before the next step; a save gathers
  the full AdamW state on rank 0 (``get_optimizer_state_dict`` with ``full_state_dict``) in the same
  layout a one-rank learner saves, and a rejoin distributes it back. Every rank loads the global
  state of the round rank 0 started from, so their shards agree;
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
import signal
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atoll.core.pseudograd import check_same_layout, learner_delta
from atoll.storage.learner_side import LearnerStore
from atoll.train.device import fragment_to_host, resolve_device
from atoll.train.inner import InnerLoop, RecipeLearner, run_learner
from atoll.train.inner_state import inner_state_tensors
from atoll.train.learner import Learner, LearnerOptions, LearnerSummary
from atoll.train.lease import die_with_parent
from atoll.train.run import load_recipe

# FSDP2, DTensor, distributed state dicts and DDP are imported where they are used: together they
# are ~5 s of a loaded machine's import time, paid by every learner process that starts (a relaunch
# after a SIGKILL included), and a one-rank learner never touches them.

__all__ = ["Shards", "die_with_parent", "island_device", "run_island", "free_port"]


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


# -- FSDP2: the learner's weights as shards ---------------------------------------------------------
class Shards:
    """An FSDP2 island's weights (:class:`~atoll.train.learner.Weights`): parameters, bases and
    AdamW state are DTensor shards, so every rank takes part in what touches them.

    * a publish gathers the due fragment's delta on every rank; rank 0 writes it;
    * a fragment rank 0 adopts waits in ``unwritten`` until every rank writes it into its shards
      (:meth:`broadcast`, before the next step);
    * a save gathers the island's full AdamW state on rank 0 (``gather``, set by rank 0's link).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.unwritten: dict[int, dict[str, torch.Tensor]] = {}
        """Rank 0: fragments adopted and not yet written into the shards."""
        self.gather: Callable[[], dict[str, torch.Tensor]] | None = None
        """Rank 0: the island's full AdamW state in the saved layout (collective)."""

    def delta_to_host(self, learner: Learner, fragment: int, out: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
        shards = learner_delta(learner.bases[fragment], learner.plan.select(learner.params, fragment))
        gathered = {n: d.full_tensor() for n, d in shards.items()}  # type: ignore[attr-defined]
        return fragment_to_host(gathered) if self.rank == 0 else None

    def adopt(self, learner: Learner, fragment: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        check_same_layout(learner.plan.select(learner.params, fragment), tensors, what=f"global fragment {fragment}")
        self.unwritten[fragment] = dict(tensors)
        learner.counters.reset(fragment, version)

    def inner_state(self, learner: Learner, *, snapshot: bool) -> dict[str, torch.Tensor]:
        if self.gather is None:
            raise RuntimeError("only rank 0 of an FSDP2 island saves, through its link")
        return self.gather()

    def broadcast(self, learner: Learner, fragments: list[int]) -> None:
        """Rank 0 scatters the adopted values (host) into every rank's shards, which also become
        the fragment's base. The counters restart on every rank."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            for p in fragments:
                values = self.unwritten.pop(p, {}) if self.rank == 0 else {}
                for name in learner.plan.fragments[p]:
                    param = learner.params[name]
                    assert isinstance(param, DTensor)
                    src = values[name].to(device=param.device, dtype=param.dtype) if self.rank == 0 else \
                        torch.empty(param.shape, device=param.device, dtype=param.dtype)
                    shard = distribute_tensor(src, param.device_mesh, param.placements, src_data_rank=0)
                    param.copy_(shard)
                    learner.bases[p][name] = shard
                if self.rank != 0:
                    learner.counters.reset(p, learner.versions[p])


def _wrap_fsdp2(loop: InnerLoop, learner: Learner) -> Shards:
    """Shard the learner's model with FSDP2 (every rank, collectively) and move its bases and the
    AdamW state it loaded into DTensor shards of the same layout (each rank keeps its slice: all
    ranks loaded the same values). The optimizer is rebuilt on the sharded parameters."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    model = learner.model
    loaded = {name: learner.opt.state.get(p, {}) for name, p in learner.params.items()}
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                if any(True for _ in block.parameters()):
                    fully_shard(block)
    fully_shard(model)
    loop.forward_model = model
    learner.params = dict(model.named_parameters())

    def shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        assert isinstance(param, DTensor)
        full = value.detach().to(device=param.device, dtype=param.dtype)
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)

    with torch.no_grad():
        learner.bases = [{n: shard_like(t, learner.params[n]) for n, t in base.items()} for base in learner.bases]
    learner.opt = loop.opt = learner.recipe.inner.make(model.parameters())
    for name, p in learner.params.items():
        st = loaded.get(name)
        if st:
            learner.opt.state[p] = {"step": torch.as_tensor(st["step"]).detach().clone(),
                                    "exp_avg": shard_like(st["exp_avg"], p),
                                    "exp_avg_sq": shard_like(st["exp_avg_sq"], p)}
    learner.weights = shards = Shards(loop.rank)
    return shards


def _wrap_ddp(loop: InnerLoop, learner: Learner) -> None:
    from torch.nn.parallel import DistributedDataParallel

    ids = [learner.device.index] if learner.device.type == "cuda" else None
    loop.forward_model = DistributedDataParallel(learner.model, device_ids=ids)


def _full_inner_state(learner: Learner) -> dict[str, torch.Tensor]:
    """FSDP2, every rank: gather the AdamW state to rank 0's host (empty on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(learner.model, learner.opt,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state: Any = sd.get("state", {})
    return inner_state_tensors(state) if dist.get_rank() == 0 else {}


# -- rank 0: the learner process, telling the other ranks ------------------------------------------
class _RankZeroLink:
    """Rank 0's side of the island inside :func:`~atoll.train.inner.run_learner` (which takes the
    lease, heartbeats, handles SIGTERM, publishes, polls, adopts and saves, as for any learner)."""

    def __init__(self, world: int, shard: str = "ddp") -> None:
        self.world = world
        self.shard = shard
        self._versions: list[int] = []
        self._final: tuple[int, dict[str, torch.Tensor]] | None = None
        self._stopped = False

    def attach(self, loop: InnerLoop, learner: Learner) -> None:
        # The other ranks build their learner only now, after rank 0 took the lease (an older copy
        # is fenced and saves nothing more), so they load the inner state rank 0 loaded; they check.
        dist.broadcast_object_list([(learner.step_count, loop.stream.state_dict(), list(learner.versions),
                                     learner.start_round)], src=0)
        if self.shard == "fsdp2":
            _wrap_fsdp2(loop, learner).gather = lambda: self._gather(learner)
        else:
            _wrap_ddp(loop, learner)  # DDP also broadcasts rank 0's weights
        self._versions = list(learner.versions)

    def before_step(self, learner: Learner) -> None:
        adopted = [p for p, (v, seen) in enumerate(zip(learner.versions, self._versions, strict=True)) if v != seen]
        self._versions = list(learner.versions)
        _send(learner, adopted, command="step")

    def _gather(self, learner: Learner) -> dict[str, torch.Tensor]:
        """FSDP2: the island's full AdamW state on rank 0 (the other ranks join the gather)."""
        if self._stopped:  # the final save, after the loop: gathered by finish()
            if self._final is None or self._final[0] != learner.step_count:
                raise RuntimeError("the island stopped without gathering its final state")
            return self._final[1]
        _send(learner, [], command="save")
        return _full_inner_state(learner)

    def finish(self, learner: Learner, *, clean: bool) -> None:
        try:
            if clean and self.shard == "fsdp2":  # rank 0 saves next: gather while every rank is here
                self._final = (learner.step_count, self._gather(learner))
            self._stopped = True
            _send(learner, [], command="stop")
        except Exception:  # noqa: BLE001 - a rank is gone already: spawn stops the others
            self._stopped = True


def _send(learner: Learner, adopted: list[int], *, command: str) -> None:
    """Rank 0 -> every rank: "step", "save" (gather the AdamW state) or "stop", the versions the
    lr schedule follows, and the fragments rank 0 adopted since the last step (their tensors follow,
    in plan order)."""
    dist.broadcast_object_list([(command, adopted, list(learner.versions))], src=0)
    learner.weights.broadcast(learner, adopted)


# -- ranks 1..N-1 -----------------------------------------------------------------------------------
def _follow(store: LearnerStore, learner_id: str, options: LearnerOptions, *, rank: int, world: int,
            device: str, shard: str) -> None:
    """Ranks 1..N-1: the same learner without bucket I/O; each step as rank 0 says."""
    ready: list[Any] = [None]
    dist.broadcast_object_list(ready, src=0)  # rank 0 holds the lease and has built its learner
    step, cursor, versions, start_round = ready[0]
    learner = RecipeLearner(store, learner_id, log=lambda _: None, lockstep=False, device=device,
                            autocast=options.autocast, rank=rank, world=world, start_round=start_round)
    if learner.step_count != step or learner.stream.state_dict() != cursor:
        raise RuntimeError(f"island rank {rank} loaded step {learner.step_count} but rank 0 is at step {step}: "
                           "the learner's saved state changed while the island started; it is relaunched")
    learner.versions = list(versions)
    if shard == "fsdp2":
        _wrap_fsdp2(learner.inner, learner)
    else:
        _wrap_ddp(learner.inner, learner)
    while True:
        msg: list[Any] = [None]
        dist.broadcast_object_list(msg, src=0)
        command, adopted, versions = msg[0]
        learner.versions = list(versions)  # the lr schedule follows the run's progress
        learner.weights.broadcast(learner, adopted)  # every rank takes rank 0's version (AdamW moments stay)
        if command == "stop":
            return
        if command == "save":  # FSDP2: rank 0 saves; every rank joins the gather
            _full_inner_state(learner)
            continue
        learner.step()  # DDP / FSDP2: the gradients are averaged over the island's ranks


def _rank_main(rank: int, world: int, url: str, storage_options: dict[str, Any] | None, learner_id: str,
               options: LearnerOptions, port: int, result_dir: str, parent_pid: int) -> None:
    """One rank of the island (a spawned process). Rank 0 handles SIGTERM (forwarded by the
    launcher) like any learner: it finishes the step, saves, and the island stops with it."""
    die_with_parent(parent_pid)
    if options.threads:
        torch.set_num_threads(options.threads)
    store = LearnerStore.open(url, storage_options)
    spec = load_recipe(store).learner(learner_id)[1]
    device = island_device(options.device if options.device is not None else spec.device, rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    clean = False
    try:
        if rank:
            _follow(store, learner_id, options, rank=rank, world=world, device=device, shard=spec.shard)
        else:
            summary = run_learner(store, learner_id, options=dataclasses.replace(options, device=device),
                                  should_stop=lambda: os.getppid() != parent_pid,
                                  link=_RankZeroLink(world, spec.shard), log=lambda line: print(line, flush=True))
            with open(os.path.join(result_dir, "summary.json"), "w") as f:
                json.dump(dataclasses.asdict(summary), f)
        clean = True
    finally:
        if clean:
            # Tear gloo down together: a rank that destroyed its group while the other was still
            # in its last collective made that one abort ("terminate called ..." -> SIGABRT).
            dist.barrier()
        dist.destroy_process_group()


def run_island(store: LearnerStore, learner_id: str, *, options: LearnerOptions | None = None,
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
    log(f"{learner_id}: starting an island of {world} ranks ({spec.shard})")
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
