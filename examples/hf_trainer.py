"""A Hugging Face ``Trainer`` as an atoll learner: one callback, the Trainer otherwise unchanged.

    python examples/hf_trainer.py --create out/hf-run --learners 2
    ATOLL_RUN_URL=out/hf-run ATOLL_LEARNER_ID=learner-0 python examples/hf_trainer.py &
    ATOLL_RUN_URL=out/hf-run ATOLL_LEARNER_ID=learner-1 python examples/hf_trainer.py &
    python -m atoll.train.local synchronizer out/hf-run

:class:`AtollCallback` joins the run when training begins (with the Trainer's own model and
optimizer), makes every optimizer step (``on_step_end``: after gradient accumulation, the
optimizer and the lr scheduler) a learner step, and asks the Trainer to stop when the learner
must stop (run finished or stopped, SIGTERM, fenced). The model is a tiny GPT-2 built from a
config (nothing is downloaded); the data are windows of the Python standard library's source.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plain_loop  # noqa: E402
from plain_loop import BATCH, CONTEXT, corpus  # noqa: E402

import atoll  # noqa: E402


class AtollCallback(TrainerCallback):
    """Make a ``transformers.Trainer`` an atoll learner (``atoll.join`` with ``on_exit="flag"``)."""

    def __init__(self, run: str | None = None, learner_id: str | None = None, *, tokens_per_step: int,
                 **join_kwargs: Any) -> None:
        self.run, self.learner_id, self.tokens_per_step, self.join_kwargs = run, learner_id, tokens_per_step, join_kwargs
        self.learner: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.learner = atoll.join(self.run, self.learner_id, model, optimizer, on_exit="flag", **self.join_kwargs)
        self.learner.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # One optimizer step of the whole (accumulated) batch: publish, adopt, save, heartbeat.
        self.learner.step(tokens=self.tokens_per_step)
        if self.learner.should_exit:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.learner is not None:
            self.learner.__exit__(None, None, None)  # saves (unless fenced), last heartbeat


def tiny_gpt2() -> GPT2LMHeadModel:
    """Built from a config, seeded: every process builds the same start, nothing downloaded."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=32, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


class Windows(plain_loop.Windows):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        x, _ = super().__getitem__(i)
        return {"input_ids": x, "labels": x}  # GPT-2 shifts the labels itself


def create(url: str, learners: int, rounds: int) -> None:
    plain_loop.create(url, learners, rounds, model=tiny_gpt2(), factory="hf_trainer:tiny_gpt2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--create", metavar="URL")
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--out", default="out/hf-trainer")
    args = ap.parse_args()
    if args.create:
        create(args.create, args.learners, args.rounds)
        return
    torch.set_num_threads(1)
    trainer = Trainer(
        model=tiny_gpt2(),
        args=TrainingArguments(output_dir=args.out, per_device_train_batch_size=BATCH, max_steps=args.max_steps,
                               learning_rate=3e-3, warmup_steps=20, lr_scheduler_type="cosine", weight_decay=0.1,
                               logging_steps=50, save_strategy="no", report_to=[], use_cpu=True, seed=args.seed,
                               dataloader_num_workers=0, disable_tqdm=True),
        train_dataset=Windows(corpus(), args.seed),
        callbacks=[AtollCallback(tokens_per_step=BATCH * CONTEXT)],
    )
    trainer.train()
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AtollCallback))
    print(f"exit: {cb.learner.exit_reason}, {cb.learner.summary.published} published, "
          f"{cb.learner.summary.aligned} aligned", flush=True)


if __name__ == "__main__":
    main()
