"""The plain loop under torch.distributed (DDP): one learner (island) of N ranks, launched by torchrun.

    python examples/ddp_loop.py --create out/byo-run --ranks 2
    ATOLL_RUN_URL=out/byo-run ATOLL_LEARNER_ID=learner-0 torchrun --standalone --nproc-per-node 2 examples/ddp_loop.py

Every rank calls ``atoll.join`` with the same arguments: rank 0 does all the bucket I/O (lease,
heartbeats, publishing, fetching new global versions, saving) and after each step broadcasts to
the other ranks whether to stop and the fragments it adopted, so every rank holds the same
weights. Each rank trains on its own windows; DDP averages the gradients. The island's counters
count ``tokens_per_step x world`` tokens, so the recipe's ``LearnerSpec`` for this learner needs
``ranks = N`` (see ``create`` below). On GPUs, use the ``nccl`` backend and put the model on
``cuda:<local rank>`` before wrapping it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plain_loop  # noqa: E402
from plain_loop import BATCH, CONTEXT, char_lm, corpus, make_optimizer, next_batch  # noqa: E402

import atoll  # noqa: E402


def create(url: str, ranks: int, rounds: int) -> None:
    """A run with two learners: learner-0 an island of ``ranks`` ranks, learner-1 a plain loop."""
    plain_loop.create(url, 2, rounds, ranks=ranks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--create", metavar="URL", help="create a run (learner-0: --ranks ranks) and exit")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--run", help="run URL (default $ATOLL_RUN_URL)")
    ap.add_argument("--learner-id", help="learner id (default $ATOLL_LEARNER_ID)")
    ap.add_argument("--max-steps", type=int, default=100_000)
    args = ap.parse_args()
    if args.create:
        create(args.create, args.ranks, args.rounds)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank = dist.get_rank()
    model = DistributedDataParallel(char_lm())
    optimizer, schedule = make_optimizer(model, args.max_steps)
    data = corpus()
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own windows
    log = print if rank == 0 else (lambda _: None)
    with atoll.join(args.run, args.learner_id, model, optimizer, tokens_per_step=BATCH * CONTEXT, log=log) as learner:
        for _ in range(args.max_steps):
            x, y = next_batch(data, g)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()  # rank 0: publish/adopt/save; every rank: the adopted fragments
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
    # Every rank holds the same weights (what rank 0 adopted reached them by broadcast).
    flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], t) for t in gathered)
    print(f"rank {rank}: exit {learner.exit_reason}, steps {learner.step_count}, "
          f"aligned {learner.summary.aligned}, ranks identical: {same}", flush=True)
    # Tear down only once every rank is past its last collective: a rank that destroys the gloo
    # group while its peer is still using it can abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
