"""Throughput on one device: the learner against a bare PyTorch loop, and the merge against memcpy.

    python benchmarks/throughput.py [--quick] [--device auto] [--model tiny] [--batch 8] [--out out/]
    python benchmarks/throughput.py --device cuda --island-ranks 0     # a GPU: the gpu preset's model, ~1.5 min

Defaults by device. CPU: the tiny GPT, batch 8, H = P = 8 (a publish every step: the worst case),
fp32 contributions, an inner-state save every 50 steps. CUDA: the gpu preset's model
(``atoll.train.recipe.gpu_recipe``, 12 x 768, context 1024, bytes: ~86 M), batch 16, bf16, fused
AdamW, and its H = 64, P = 8 with int4 contributions (a publish every 8 steps); no inner-state
saves (a ~1 GB save every 50 steps of ~50 ms would measure the disk, not the learner; ``--save-every``
puts them back). It prints a line after every round of blocks (a few seconds apart).

Side by side in one process, on the same device (``auto``: CUDA, then MPS, then CPU):

* **(a) learner tokens/s vs a bare PyTorch loop**: the same model (same init), the same batch
  size, the same data stream and the same AdamW + grad clip, with the same autocast. The bare
  loop is just forward, backward, clip, step. The learner is :class:`atoll.train.inner.RecipeLearner`
  on a run in a local folder: per-step lr schedule, counters, and with H = P a fragment published
  on *every* step (delta on the device, one device-to-host copy, encode, sha256, payload + record
  written create-once), plus its periodic inner-state saves. Blocks of steps alternate between the
  two (bare, learner, bare, ...) and each side's median block counts, so drift on a noisy machine
  hits both. Goal: learner >= 0.97x bare. Also per CPU-second of the whole process (every
  thread), which a machine shared with other jobs disturbs far less than wall time.
* **(b) synchronizer merge + outer step in GB/s vs a memcpy of the same bytes**: M deltas of one
  fragment (re-anchor, token weights, RDA or mean, Nesterov step; ``merge_on_device`` exactly as
  the synchronizer calls it in steady state: with its reused ``MergeWorkspace`` and, as ``out``,
  the fragment version the previous round retired; half the deltas against an older base). The
  bytes counted are every fp32 tensor the round has to read (M deltas, the current fragment, the
  older base, the momentum: (M + 3) x fragment); the baseline is ``dst.copy_(src)`` of exactly that
  many bytes into a preallocated ``dst`` on the same device (reads and writes those bytes once:
  the least a pass over the inputs can cost). The merge also writes the new fragment, the momentum
  and the merged update, and reads some intermediates more than once. Goal: >= 0.5x memcpy.
* **(c) island scaling 1 -> 2 ranks**: the same learner as an island of 1 and of 2 ranks
  (:mod:`atoll.train.island`: DDP inner steps, gloo on CPU, NCCL on CUDA; rank 0 publishes), each
  rank with the same per-rank batch, timed inside the ranks after warm-up; scaling efficiency =
  tokens/s(2 ranks) / (2 x tokens/s(1 rank)). On CUDA it needs 2 GPUs; on a CPU box each rank has
  ``--threads`` threads, so it needs 2 free cores to mean anything.
* **(d) the hook's overhead** (``--hook-only``: nothing else, 60 pairs of blocks): the bare loop itself, unchanged, inside ``atoll.join`` (the user's
  own loop as a learner: an optimizer post-step hook that counts, publishes the due fragment in
  the background, adopts, saves, with lease, heartbeats and fetcher threads running), against the
  very same loop object with the hook switched off, block by block (separate instances of one
  loop differ by a few percent on a CPU); reported as step time added, the median over pairs of
  adjacent blocks. Goal: < 3%.

On CUDA it also reports MFU (model FLOPs utilisation: 6 N + 12 L d T FLOPs per token against the
chip's dense bf16 peak; ``--peak-tflops`` for chips not in the table). Prints a table and writes
``throughput.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from atoll.core.config import DilocoConfig
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.synchronize import FragmentContribution, MergePolicy, MergeWorkspace
from atoll.core.weights import Counters
from atoll.storage import LearnerStore
from atoll.storage.paths import to_url
from atoll.train import speed
from atoll.train.data import BatchStream
from atoll.train.device import autocast as autocast_context
from atoll.train.device import resolve_device
from atoll.train.inner import RecipeLearner
from atoll.train.merge_device import merge_on_device
from atoll.train.model import count_parameters, loss_fn
from atoll.train.recipe import DataSpec, InnerOptimConfig, LearnerSpec, Recipe, gpu_recipe, lr_at_step
from atoll.train.run import create_run

PEAK_BF16_TFLOPS = speed.PEAK_BF16_TFLOPS  # dense, no sparsity


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    return speed.peak_tflops(device, override)


def model_spec(name: str) -> Any:
    """A model preset's name, or 'gpu': the gpu recipe preset's model (a GPTConfig as a dict)."""
    return gpu_recipe(1)[1].model if name == "gpu" else name


def progress(t0: float, text: str) -> None:
    print(f"[{time.perf_counter() - t0:6.1f}s] {text}", flush=True)


# -- (a) learner vs bare loop --------------------------------------------------------------------

@dataclass
class LoopResult:
    name: str
    blocks: list[float] = field(default_factory=list)
    """tokens/s of each timed block"""
    cpu_blocks: list[float] = field(default_factory=list)
    """tokens per CPU-second of this process (every thread: the background writer's work counts)"""

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.blocks)

    @property
    def tokens_per_cpu_s(self) -> float:
        return statistics.median(self.cpu_blocks)


def make_run(root: Path, args: argparse.Namespace) -> tuple[str, Recipe]:
    config = DilocoConfig(num_learners=1, num_fragments=args.fragments, inner_steps=args.inner_steps or args.fragments,
                          overlap_steps=1, min_quorum=1, compression=args.codec, downlink_compression=args.codec)
    recipe = Recipe(
        model=model_spec(args.model), data=DataSpec(max_corpus_mb=args.corpus_mb),
        learners=(LearnerSpec(learner_id="learner-0", batch_size=args.batch, device=str(args.device),
                              autocast=args.autocast),),
        inner=InnerOptimConfig(lr=3e-3, warmup_steps=10, schedule="steps", total_steps=100_000,
                               fused=args.device.type == "cuda"),
        max_rounds=1_000_000, eval_every_rounds=0, save_every_steps=args.save_every,
    )
    url = to_url(str(root / "run"))
    create_run(url, config, recipe)
    return url, recipe


class BareLoop:
    """The plain PyTorch loop: nothing of atoll but the model, the batches and the loss."""

    def __init__(self, recipe: Recipe, device: torch.device, autocast: str) -> None:
        self.device, self.autocast = device, autocast
        self.model = recipe.model_factory()().to(device)
        self.model.train()
        self.opt = recipe.inner.make(self.model.parameters())
        self.inner = recipe.inner
        self.batch = recipe.learners[0].batch_size
        corpus = recipe.data.corpus()
        self.stream = BatchStream(corpus.train, context_tokens=recipe.context_for(self.model), learner_index=0,
                                  num_learners=1, seed=recipe.data.seed)
        self.steps = 0
        self.tokens_per_step = self.batch * recipe.context_for(self.model)

    def step(self) -> int:
        self.steps += 1
        for group in self.opt.param_groups:
            group["lr"] = lr_at_step(self.inner, self.steps)
        x, y = self.stream.next_batch(self.batch)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast_context(self.device, self.autocast):
            loss = loss_fn(self.model, x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
        self.opt.step()
        return int(x.numel())


def timed_block(step: Callable[[], int], steps: int, device: torch.device,
                flush: Callable[[], None] | None = None) -> tuple[float, float]:
    """(tokens/s, tokens per CPU-second) of ``steps`` steps; ``flush`` (the background writer's)
    is inside the timing, so writes that have not finished by the end of the block count against
    the block. CPU seconds are the whole process's (``time.process_time``: every thread), so on a
    shared machine, where wall time also counts waiting for a core, they still charge the
    learner for all its work, the background writer's included."""
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = sum(step() for _ in range(steps))
    if flush is not None:
        flush()
    sync(device)
    return tokens / (time.perf_counter() - t0), tokens / max(1e-9, time.process_time() - c0)


def publish_every_due_fragment() -> None:
    """No synchronizer runs here, so no base ever moves, and a learner would back off to rarer
    publishes (``publish_due``); keep the cadence of a learner whose synchronizer keeps up."""
    import atoll.train.learner as learner_mod

    learner_mod.publish_due = lambda c_steps, inner_steps: True


def bench_learner(root: Path, args: argparse.Namespace, device: torch.device) -> tuple[list[LoopResult], int]:
    """Bare loop, the learner as run_learner runs it (contributions written in the background),
    and the learner writing each contribution inside its step; blocks interleaved."""
    publish_every_due_fragment()
    bare = None
    learners = {}
    for background in (True, False) if not args.hook_only else ():
        url, recipe = make_run(root / ("bg" if background else "fg"), args)
        learners[background] = RecipeLearner(LearnerStore.open(url), "learner-0", log=lambda _: None,
                                             publish_in_background=background)
        bare = bare or BareLoop(recipe, device, args.autocast)

    def stepper(learner: RecipeLearner) -> Callable[[], int]:
        def step() -> int:
            before = learner.tokens_total
            learner.step()
            if recipe.save_every_steps and learner.step_count % recipe.save_every_steps == 0:
                learner.save()  # also waits for the contributions still being written
            return learner.tokens_total - before
        return step

    # (d) the same bare loop, unchanged, inside atoll.join: the hook after every optimizer step
    # (a user's own loop as a learner, docs/byo-loop.md) with its lease, heartbeats and fetcher.
    import atoll
    from atoll.train.learner import LearnerOptions

    # Its baseline is the very same loop object (same model and optimizer memory, same data
    # stream) with the hook switched off in the blocks in between: separate model instances of
    # one loop differ in speed by a few percent on a CPU (memory placement), more than the hook.
    url, recipe = make_run(root / "hook", args)
    user = BareLoop(recipe, device, args.autocast)
    hook = atoll.join(url, "learner-0", user.model, user.opt, tokens_per_step=None,
                      options=LearnerOptions(handle_sigterm=False, orphan_timeout_s=None, lockstep=False),
                      log=lambda _: None)  # no synchronizer here: never wait for a merge
    hook.__enter__()
    assert hook.learner is not None
    hook_on = [True]
    # What join(tokens_per_step=...) registers, behind a switch (join's documented manual mode).
    user.opt.register_step_post_hook(lambda opt, a, kw: hook.step(tokens=user.tokens_per_step) if hook_on[0] else None)

    def hooked(on: bool) -> Callable[[], int]:
        def step() -> int:
            hook_on[0] = on
            return user.step()
        return step

    loops = [("the same loop, hook off", hooked(False)), ("bare loop + atoll.join", hooked(True))]
    flushes = {"bare loop + atoll.join": hook.learner.flush}
    if bare is not None:
        loops = [("bare PyTorch loop", bare.step), ("atoll learner", stepper(learners[True])),
                 ("atoll learner, writes in the step", stepper(learners[False])), *loops]
        flushes["atoll learner"] = learners[True].flush
    t0 = time.perf_counter()
    progress(t0, f"built {len(loops)} loops; warming up ({args.warmup} steps each)")
    try:
        for _ in range(args.warmup):  # compile kernels, fill caches, allocate
            for _, step in loops:
                step()
        if learners:
            learners[True].flush()
        results = [LoopResult(name) for name, _ in loops]
        last = time.perf_counter()
        for i in range(args.blocks):
            for res, (name, step) in zip(results, loops, strict=True):
                wall, cpu = timed_block(step, args.block_steps, device, flush=flushes.get(name))
                res.blocks.append(wall)
                res.cpu_blocks.append(cpu)
            if time.perf_counter() - last > 5 or i == args.blocks - 1:
                last = time.perf_counter()
                progress(t0, f"blocks {i + 1}/{args.blocks}: " + ", ".join(
                    f"{r.name} {r.blocks[-1]:,.0f}" for r in results) + " tokens/s")
    finally:
        hook.__exit__(None, None, None)
    return results, count_parameters(user.model)


def flops_per_token(spec: Any, params: int) -> float:
    from atoll.train.model import MODEL_PRESETS, GPTConfig

    spec = model_spec(spec) if isinstance(spec, str) else spec
    cfg = MODEL_PRESETS[spec] if isinstance(spec, str) and spec in MODEL_PRESETS else None
    if isinstance(spec, dict):
        cfg = GPTConfig.from_dict(spec)
    if cfg is None:
        return 6.0 * params
    if callable(cfg):
        cfg = cfg()
    return 6.0 * params + 12.0 * cfg.num_layers * cfg.embed_dim * cfg.context_tokens


# -- (c) island scaling ---------------------------------------------------------------------------

def _island_rank(rank: int, world: int, url: str, device: str, port: int, steps: int, warmup: int,
                 threads: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from atoll.train.island import island_device

    torch.set_num_threads(threads)
    publish_every_due_fragment()
    dev = island_device(device, rank)
    backend = "nccl" if dev.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(dev))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        learner = RecipeLearner(LearnerStore.open(url), "learner-0", log=lambda _: None, device=dev, rank=rank,
                                world=world, lockstep=False, publish_in_background=rank == 0)
        learner.forward_model = DistributedDataParallel(
            learner.model, device_ids=[learner.device.index] if learner.device.type == "cuda" else None)
        for _ in range(warmup):
            learner.step()
        learner.flush()
        dist.barrier()
        sync(learner.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            learner.step()
        learner.flush()
        sync(learner.device)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if rank == 0:
            Path(out).write_text(str(steps * learner.spec.batch_size * world * learner.recipe.context_for(learner.model)
                                     / elapsed))
    finally:
        dist.destroy_process_group()


def bench_island(root: Path, args: argparse.Namespace, device: torch.device) -> list[tuple[int, float]]:
    """tokens/s of the learner as an island of 1 and of ``--island-ranks`` ranks (same per-rank batch)."""
    import torch.multiprocessing as mp

    from atoll.train.island import free_port

    results = []
    for world in (1, args.island_ranks):
        if device.type == "cuda" and world > torch.cuda.device_count():
            break
        url, _ = make_run(root / f"island-{world}", args)
        out = root / f"island-{world}.txt"
        mp.spawn(_island_rank, nprocs=world, join=True,
                 args=(world, url, str(device), free_port(), args.block_steps * 2, args.warmup, args.threads,
                       str(out)))
        results.append((world, float(out.read_text())))
    return results


# -- (b) merge vs memcpy -------------------------------------------------------------------------

@dataclass
class MergeResult:
    name: str
    gb_per_s: float
    memcpy_gb_per_s: float

    @property
    def ratio(self) -> float:
        return self.gb_per_s / self.memcpy_gb_per_s


def _best_of(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_merge(args: argparse.Namespace, device: torch.device) -> list[MergeResult]:
    """M contributions to one fragment of ``--fragment-mb`` MB (4 tensors), resident on ``device``."""
    g = torch.Generator().manual_seed(0)
    numel = int(args.fragment_mb * 2**20 / 4)
    shapes = {"w0": numel // 2, "w1": numel // 4, "w2": numel // 8, "w3": numel - numel // 2 - numel // 4 - numel // 8}
    current = {n: torch.randn(k, generator=g).to(device) for n, k in shapes.items()}
    old = {n: (t + 0.01).to(device) for n, t in current.items()}
    contributions = [
        FragmentContribution(key=f"k{i}", learner_id=f"l{i}", base_version=3 if i % 2 else 2,
                             counters=Counters(c_steps=8, c_tokens=8 * 1024 * (1 + i)),
                             delta={n: (0.01 * torch.randn(k, generator=g)).to(device) for n, k in shapes.items()})
        for i in range(args.contributions)
    ]
    # Every byte the round must read: the M deltas, the current fragment, the one older base that
    # half of them re-anchor against, and the momentum buffer.
    nbytes = (args.contributions + 3) * numel * 4
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    rules = ("rda", "mean")
    opts = {}
    for rule in rules:
        opts[rule] = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
        opts[rule].buffers = {n: torch.zeros_like(t) for n, t in current.items()}
    # As the synchronizer keeps them: one workspace, and the version a won round retired as the
    # next round's output (here: the same buffers every round, as in steady state).
    workspace = MergeWorkspace()
    retired = {n: torch.empty_like(t) for n, t in current.items()} if device.type == "cpu" else None
    policies = {rule: MergePolicy(merge=rule) for rule in rules}

    def merge(rule: str) -> None:
        merge_on_device(device, current=current, bases={3: current, 2: old}, contributions=contributions,
                        optimizer=opts[rule], policy=policies[rule], workspace=workspace, out=retired)

    # Interleaved (memcpy, rda, mean, memcpy, ...): a busy machine slows all three alike.
    times: dict[str, list[float]] = {"memcpy": [], **{r: [] for r in rules}}
    for i in range(args.merge_repeats + 1):
        for name in times:
            t = _best_of(lambda: dst.copy_(src), 1, device) if name == "memcpy" else \
                _best_of(lambda: merge(name), 1, device)  # noqa: B023 - called right here
            if i:  # the first pass warms up (allocator, page faults, kernels)
                times[name].append(t)
    memcpy = nbytes / statistics.median(times["memcpy"]) / 1e9
    out = [MergeResult(f"merge + outer step ({rule}, M={args.contributions})",
                       nbytes / statistics.median(times[rule]) / 1e9, memcpy) for rule in rules]
    return out


# -- report ----------------------------------------------------------------------------------------

def table(loops: list[LoopResult], merges: list[MergeResult], *, mfu: tuple[float, float] | None,
          island: list[tuple[int, float]]) -> str:
    lines = [f"{'measure':<44} {'value':>14} {'baseline':>14} {'ratio':>7} {'goal':>7}"]
    lines.append("-" * len(lines[0]))
    unhooked, hooked = loops[-2:]
    if len(loops) == 2:  # --hook-only
        return "\n".join([*lines, *_hook_rows(unhooked, hooked)])
    bare, learner, inline = loops[:3]
    ratio = learner.tokens_per_s / bare.tokens_per_s
    lines.append(f"{'(a) learner tokens/s vs bare PyTorch loop':<44} {learner.tokens_per_s:>14,.0f} "
                 f"{bare.tokens_per_s:>14,.0f} {ratio:>7.3f} {'>=0.97':>7}")
    lines.append(f"{'    same, writing contributions in the step':<44} {inline.tokens_per_s:>14,.0f} "
                 f"{bare.tokens_per_s:>14,.0f} {inline.tokens_per_s / bare.tokens_per_s:>7.3f}")
    lines.append(f"{'    tokens per CPU-second (all threads)':<44} {learner.tokens_per_cpu_s:>14,.0f} "
                 f"{bare.tokens_per_cpu_s:>14,.0f} {learner.tokens_per_cpu_s / bare.tokens_per_cpu_s:>7.3f}")
    if mfu is not None:
        lines.append(f"{'    MFU (learner / bare)':<44} {mfu[1]:>13.1%} {mfu[0]:>13.1%}")
    lines += _hook_rows(unhooked, hooked)
    for m in merges:
        lines.append(f"{'(b) ' + m.name + ' GB/s':<44} {m.gb_per_s:>14.2f} {m.memcpy_gb_per_s:>14.2f} "
                     f"{m.ratio:>7.3f} {'>=0.5':>7}")
    if len(island) == 2:
        (_, one), (n, many) = island
        lines.append(f"{f'(c) island tokens/s, {n} ranks vs 1 rank':<44} {many:>14,.0f} {one:>14,.0f} "
                     f"{many / one:>7.3f} {f'~{n}':>7}")
        lines.append(f"{'    scaling efficiency':<44} {many / (n * one):>14.1%}")
    else:
        lines.append(f"{'(c) island scaling':<44} {'not measured (--island-ranks < 2, or too few GPUs)':>46}")
    return "\n".join(lines)


def _hook_rows(unhooked: LoopResult, hooked: LoopResult) -> list[str]:
    # Each hooked block against the hook-off block just before it (drift cancels), median.
    pairs = list(zip(unhooked.blocks, hooked.blocks, strict=True))
    added = statistics.median(off / on for off, on in pairs) - 1.0
    cpu_added = statistics.median(off / on for off, on in zip(unhooked.cpu_blocks, hooked.cpu_blocks, strict=True))
    return [f"{'(d) bare loop + atoll.join vs the same, off':<44} {hooked.tokens_per_s:>14,.0f} "
            f"{unhooked.tokens_per_s:>14,.0f} {hooked.tokens_per_s / unhooked.tokens_per_s:>7.3f} {'':>7}",
            f"{'    step time added by the hook':<44} {added:>14.1%} {'':>14} {'':>7} {'<3%':>7}",
            f"{'    CPU time added (all threads, same pairs)':<44} {cpu_added - 1.0:>14.1%}",
            f"{'    pairs of blocks with the hook slower':<44} {sum(on < off for off, on in pairs):>9} of {len(pairs)}"]


def plot(loops: list[LoopResult], merges: list[MergeResult], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not merges:  # --hook-only: the two sides of (d)
        fig, a = plt.subplots(1, 1, figsize=(5, 4))
        a.boxplot([x.blocks for x in loops], tick_labels=["user loop,\nhook off", "user loop +\natoll.join"])
        a.set_ylabel("tokens/s per block")
        a.set_title("(d) the hook's overhead (goal < 3%)")
        return _save(fig, out)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    bare, learner = loops[0], loops[1]
    a.boxplot([x.blocks for x in loops], tick_labels=["bare loop", "learner", "learner,\nwrites in step", "user loop,\nhook off",
                                                     "user loop +\natoll.join"])
    a.set_ylabel("tokens/s per block")
    a.set_title(f"(a) learner / bare = {learner.tokens_per_s / bare.tokens_per_s:.3f} (goal >= 0.97)")
    names = ["memcpy"] + [m.name.split("(")[1].split(",")[0] for m in merges]
    b.bar(names, [merges[0].memcpy_gb_per_s] + [m.gb_per_s for m in merges], color=["#888", "#2b6cb0", "#63b3ed"])
    b.axhline(0.5 * merges[0].memcpy_gb_per_s, color="r", ls="--", label="goal: 0.5x memcpy")
    b.set_ylabel("GB/s of fp32 inputs")
    b.set_title("(b) merge + outer step vs memcpy")
    b.legend()
    return _save(fig, out)


def _save(fig: Any, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CI size: micro model, few short blocks, a small fragment")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    p.add_argument("--model", default=None, help="model preset, or gpu: the gpu recipe's (default: tiny on CPU, "
                   "gpu on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8 on CPU, 16 on CUDA)")
    p.add_argument("--autocast", default=None, help="'' or bf16 (default: bf16 on CUDA, off elsewhere)")
    p.add_argument("--fragments", type=int, default=8, help="P (= H unless --inner-steps): with H = P one fragment is "
                   "published every step")
    p.add_argument("--inner-steps", type=int, default=None, help="H >= P: a fragment is published every H / P steps "
                   "(default: H = P on a CPU, 64 on CUDA)")
    p.add_argument("--codec", default=None, help="contributions and updates: fp32, bf16, int4 (default: fp32 on a "
                   "CPU, int4 on CUDA)")
    p.add_argument("--save-every", type=int, default=None, help="learner inner-state save cadence in steps, 0: none "
                   "(default: 50 on a CPU, none on CUDA)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--block-steps", type=int, default=20)
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--contributions", type=int, default=4, help="M deltas merged")
    p.add_argument("--fragment-mb", type=float, default=None, help="fragment size (default 64 MB, 256 on CUDA)")
    p.add_argument("--merge-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: like one learner process)")
    p.add_argument("--peak-tflops", type=float, default=None, help="chip's dense bf16 peak, for MFU")
    p.add_argument("--island-ranks", type=int, default=2, help="(c): ranks of the larger island (< 2: skip)")
    p.add_argument("--hook-only", action="store_true", help="only (d), the hook against the same loop without it: "
                   "more blocks in the same time (default 60 blocks x 10 steps)")
    p.add_argument("--out", default="out")
    args = p.parse_args(argv)
    if args.hook_only and "--blocks" not in (argv or sys.argv):
        args.blocks, args.block_steps = 60, 10
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device, knob="--device")
    args.device = device
    cuda = device.type == "cuda"
    if args.quick:
        args.model = args.model or "micro"
        args.batch = args.batch or 4
        args.warmup, args.blocks, args.block_steps = 2, 3, 5
        args.corpus_mb, args.merge_repeats = 2.0, 2
        args.fragment_mb = args.fragment_mb or 4.0
    args.model = args.model or ("gpu" if cuda else "tiny")
    args.batch = args.batch or (16 if cuda else 8)
    if cuda and args.inner_steps is None:
        args.inner_steps = 64  # the gpu preset's (a publish every 8 steps with P = 8)
    args.codec = args.codec or ("int4" if cuda else "fp32")
    args.save_every = (0 if cuda else 50) if args.save_every is None else args.save_every
    args.autocast = ("bf16" if cuda else "") if args.autocast is None else args.autocast
    args.fragment_mb = args.fragment_mb or (256.0 if cuda else 64.0)

    t0 = time.perf_counter()
    progress(t0, f"throughput on {device}: model {args.model}, batch {args.batch}, P = {args.fragments}, "
                 f"H = {args.inner_steps or args.fragments}, {args.codec}, saves every {args.save_every or 'never'}")
    with tempfile.TemporaryDirectory(prefix="atoll-throughput-") as tmp:
        loops, params = bench_learner(Path(tmp), args, device)
        if args.island_ranks >= 2 and not args.hook_only:
            progress(t0, f"(c) island of 1 and {args.island_ranks} ranks")
        island = bench_island(Path(tmp), args, device) if args.island_ranks >= 2 and not args.hook_only else []
    if not args.hook_only:
        progress(t0, f"(b) merge of {args.contributions} x {args.fragment_mb:g} MB")
    merges = bench_merge(args, device) if not args.hook_only else []
    peak = peak_tflops(device, args.peak_tflops)
    mfu = None
    if peak and not args.hook_only:
        fpt = flops_per_token(args.model, params)
        mfu = (loops[0].tokens_per_s * fpt / (peak * 1e12), loops[1].tokens_per_s * fpt / (peak * 1e12))
    name = torch.cuda.get_device_name(device) if cuda else f"{device.type} ({torch.get_num_threads()} threads, "\
                                                          f"{os.cpu_count()} CPUs)"
    print()
    print(f"device {name}; model {args.model} ({params / 1e6:.2f} M params), batch {args.batch}, "
          f"autocast {args.autocast or 'off'}, P = {args.fragments}, H = {args.inner_steps or args.fragments} "
          f"(a publish every {(args.inner_steps or args.fragments) / args.fragments:g} steps); "
          f"medians of {args.blocks} blocks x {args.block_steps} steps; fragment {args.fragment_mb:g} MB, "
          f"M = {args.contributions}")
    print(table(loops, merges, mfu=mfu, island=island))
    print(f"plot: {plot(loops, merges, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
