"""A plain PyTorch training loop as an atoll learner: the loop is unchanged, ``atoll.join`` wraps it.

    # create a run for this model (2 learners, local folder), then start each learner:
    python examples/plain_loop.py --create out/byo-run --learners 2
    python examples/plain_loop.py --run out/byo-run --learner-id learner-0 &
    python examples/plain_loop.py --run out/byo-run --learner-id learner-1 &
    atoll ... / python -m atoll.train.local synchronizer out/byo-run   # merges their work

The model (``char_lm``: a small byte-level language model), the data pipeline (random windows of
the Python standard library's own source) and the optimizer (AdamW with a cosine LambdaLR) are
this script's own; atoll only needs ``tokens_per_step``. Under the learner flow the run URL and
learner id come from ``$ATOLL_RUN_URL`` / ``$ATOLL_LEARNER_ID``, so the same script serves every
learner. A run that also has atoll-loop learners names the model factory in its recipe
(``Recipe(model="plain_loop:char_lm")``, this folder on ``PYTHONPATH``), so both build the same model.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import atoll

CONTEXT = 32
BATCH = 8


class CharLM(nn.Module):
    """Byte-level LM: embedding, a causal depthwise convolution, an MLP, logits over 256 bytes."""

    def __init__(self, width: int = 64, kernel: int = 4) -> None:
        super().__init__()
        self.kernel = kernel
        self.embed = nn.Embedding(256, width)
        self.conv = nn.Conv1d(width, width, kernel, groups=width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # [B, T, W]
        c = self.conv(F.pad(h.transpose(1, 2), (self.kernel - 1, 0))).transpose(1, 2)  # causal: left pad
        h = h + c
        h = h + self.mlp(h)
        return self.head(h)  # [B, T, 256]


def char_lm() -> CharLM:
    """The model factory a recipe can name (``plain_loop:char_lm``): same seed, same start."""
    torch.manual_seed(0)
    return CharLM()


def corpus(max_bytes: int = 1 << 20) -> torch.Tensor:
    """This loop's own data: up to ``max_bytes`` of the standard library's source, as bytes."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:max_bytes]), dtype=torch.uint8).long()


class Windows(torch.utils.data.Dataset):
    """``size`` seeded random windows of ``data``: (input bytes, next bytes), for framework loaders."""

    def __init__(self, data: torch.Tensor, seed: int, size: int = 100_000) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data, self.starts = data, torch.randint(0, len(data) - CONTEXT - 1, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = int(self.starts[i])
        return self.data[j:j + CONTEXT], self.data[j + 1:j + CONTEXT + 1]


def create(url: str, learners: int, rounds: int, *, lockstep: bool = False, model: nn.Module | None = None,
           factory: str = "plain_loop:char_lm", ranks: int = 1) -> None:
    """A run whose weights and fragment plan come from a user's model (default: this script's):
    ``learners`` learners, learner-0 an island of ``ranks`` ranks; ``lockstep``: synchronous
    DiLoCo (K = M, one fragment). ``factory`` is the import string atoll-loop learners would build
    the same model from (the other examples pass theirs)."""
    from atoll.core.config import DilocoConfig, synchronous_diloco
    from atoll.train.recipe import LearnerSpec, Recipe

    if lockstep:
        config = synchronous_diloco(learners, inner_steps=4)
    else:
        config = DilocoConfig(num_learners=learners, num_fragments=2, inner_steps=4, overlap_steps=1, min_quorum=1,
                              initial_grace_s=0.5)
    recipe = Recipe(model=factory, context_tokens=CONTEXT, max_rounds=rounds, eval_every_rounds=0, save_every_steps=10,
                    learners=tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=BATCH, ranks=ranks if i == 0 else 1)
                                   for i in range(learners)))
    atoll.create_run(url, config, recipe, model=model if model is not None else char_lm())
    print(f"created {url}")


def make_optimizer(model: nn.Module, max_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with warmup and a cosine to 10% over ``max_steps``: this loop's own choice."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / max_steps)))))
    return optimizer, schedule


def next_batch(data: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``BATCH`` random windows of ``CONTEXT`` bytes and their next bytes."""
    i = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=g)
    return torch.stack([data[j:j + CONTEXT] for j in i]), torch.stack([data[j + 1:j + CONTEXT + 1] for j in i])


def train(run: str | None, learner_id: str | None, *, seed: int, max_steps: int) -> None:
    torch.set_num_threads(1)
    model = char_lm()
    optimizer, schedule = make_optimizer(model, max_steps)
    data = corpus()
    g = torch.Generator().manual_seed(seed)

    with atoll.join(run, learner_id, model, optimizer, tokens_per_step=BATCH * CONTEXT) as learner:
        # Rejoin: the loop's own position comes back from the bucket with the optimizer state.
        start = int(learner.user_state.get("step", 0))
        for _ in range(start):
            schedule.step()
        for step in range(start, max_steps):
            # --- the user's loop, unchanged -------------------------------------------------
            x, y = next_batch(data, g)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            learner.loss = loss.detach()  # optional: shows in contributions and progress lines
            learner.user_state["step"] = step + 1
            optimizer.step()  # atoll publishes, aligns, saves and heartbeats here
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
    print(f"exit: {learner.exit_reason}, {learner.summary.published} published, {learner.summary.aligned} aligned",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--create", metavar="URL", help="create a run for this model and exit")
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--lockstep", action="store_true", help="with --create: synchronous DiLoCo (K = M)")
    ap.add_argument("--run", help="run URL (default $ATOLL_RUN_URL)")
    ap.add_argument("--learner-id", help="learner id (default $ATOLL_LEARNER_ID)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    args = ap.parse_args()
    if args.create:
        create(args.create, args.learners, args.rounds, lockstep=args.lockstep)
        return
    train(args.run, args.learner_id, seed=args.seed, max_steps=args.max_steps)


if __name__ == "__main__":
    main()
