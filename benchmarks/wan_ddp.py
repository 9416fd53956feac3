"""The baseline of benchmarks/wan.py: the same model, data and global batch as an atoll run's
recipe, trained by plain data-parallel SGD (DDP over gloo), one rank per site, under torchrun.

    torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --local-addr SITE_IP [--max-restarts R] benchmarks/wan_ddp.py --recipe recipe.json \\
        --out DIR --steps S [--eval-every E] [--checkpoint-every C]

Rank r trains on the recipe's data shard r of N (atoll learner r's shard: ``BatchStream`` with
``learner_index=r``) with learner r's batch size, so a step is the union of the learners' batches;
the recipe's model, seed and AdamW, its lr warmup and a cosine over ``--steps``. Gradients are
all-reduced every step (DDP), across the sites' shaped links (``GLOO_SOCKET_IFNAME``).

Rank 0 appends to ``<out>/timeline.jsonl`` one line per event, with wall time (``time.time()``):
``start`` (a worker group began, after rendezvous and loading), ``step`` (its number and its
duration: the time from the batch to the optimizer's step, all-reduce included), ``eval`` (the
validation loss of the model after that step, the recipe's evaluation, and how long it took:
evaluations are not training time) and ``checkpoint``. With ``--checkpoint-every C`` rank 0 saves
the model, AdamW's state and the step every C steps (safetensors and JSON in ``<out>/ckpt``); a
worker group that torchrun restarts after a failure resumes from the newest one, so the steps
after it are done twice: goodput counts each step once (the last time it was done).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file


def log_event(out: Path, **event: Any) -> None:
    with open(out / "timeline.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), **event}) + "\n")


def save_checkpoint(folder: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Model and AdamW state as safetensors plus the step as JSON, swapped in atomically."""
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        tensors[f"param/{name}"] = p.detach().contiguous()
        state = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{key}/{i}"] = state[key].contiguous()
        if "step" in state:
            tensors[f"step/{i}"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "meta.json").write_text(json.dumps({"step": step}))
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    if old.exists():
        for f in old.iterdir():
            f.unlink()
        old.rmdir()


def load_checkpoint(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """The saved step (0 without a checkpoint); the model and AdamW's state are loaded in place."""
    if not (folder / "meta.json").exists():
        return 0
    tensors = load_file(str(folder / "state.safetensors"))
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            p.copy_(tensors[f"param/{name}"])
            if f"exp_avg/{i}" in tensors:
                opt.state[p] = {"exp_avg": tensors[f"exp_avg/{i}"].clone(),
                                "exp_avg_sq": tensors[f"exp_avg_sq/{i}"].clone(),
                                "step": tensors[f"step/{i}"].reshape(()).clone()}
    return int(json.loads((folder / "meta.json").read_text())["step"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", required=True, help="the atoll run's recipe as JSON (Recipe.to_dict())")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True, help="the token budget, in global steps")
    p.add_argument("--eval-every", type=int, default=0, help="validation loss every this many steps (0: at the end)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: never (no elastic resume)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from atoll.train import data as data_mod
    from atoll.train.model import loss_fn
    from atoll.train.recipe import Recipe, lr_at_step

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    recipe = Recipe.from_dict(json.loads(Path(args.recipe).read_text()))
    model = recipe.model_factory()()
    context = recipe.context_for(model)
    corpus = recipe.data.corpus()
    stream = data_mod.BatchStream(corpus.train, context_tokens=context, learner_index=rank, num_learners=world,
                                  seed=recipe.data.seed, interleave=recipe.data.shard == "interleaved")
    batch = recipe.learners[rank % len(recipe.learners)].batch_size
    opt = recipe.inner.make(model.parameters())
    ckpt = out / "ckpt"
    start = load_checkpoint(ckpt, model, opt) if args.checkpoint_every else 0
    if start:  # each rank's stream continues where that step left it
        total = start * batch
        stream.load_state_dict({**stream.state_dict(), "epoch": total // stream.num_windows,
                                "position": total % stream.num_windows})
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's (loaded) weights
    global_batch_tokens = sum(s.batch_size for s in recipe.learners[:world]) * context
    if rank == 0:
        log_event(out, kind="start", step=start, world=world, tokens_per_step=global_batch_tokens)
    for step in range(start + 1, args.steps + 1):
        t0 = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at_step(recipe.inner, step, step / args.steps)
        x, y = stream.next_batch(batch)
        loss = loss_fn(ddp, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here, over the sites' links
        if recipe.inner.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.inner.grad_clip)
        opt.step()
        if rank == 0:
            log_event(out, kind="step", step=step, dur=time.time() - t0, loss=float(loss.item()))
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                t1 = time.time()
                val = data_mod.evaluate(model, corpus.val, batches=recipe.eval_batches, batch_size=16,
                                        context_tokens=context)
                log_event(out, kind="eval", step=step, val_loss=val, dur=time.time() - t1)
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                t1 = time.time()
                save_checkpoint(ckpt, step, model, opt)
                log_event(out, kind="checkpoint", step=step, dur=time.time() - t1)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        log_event(out, kind="done", step=args.steps)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
