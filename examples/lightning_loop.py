"""A Lightning ``Trainer`` as an atoll learner: one callback, the LightningModule unchanged.

    python examples/lightning_loop.py --create out/pl-run --learners 2
    ATOLL_RUN_URL=out/pl-run ATOLL_LEARNER_ID=learner-0 python examples/lightning_loop.py &
    ATOLL_RUN_URL=out/pl-run ATOLL_LEARNER_ID=learner-1 python examples/lightning_loop.py &
    python -m atoll.train.local synchronizer out/pl-run

:class:`AtollCallback` joins the run when fitting starts (the module and its optimizer), makes each
training batch's optimizer step a learner step (``on_train_batch_end``, after the step) and sets
``trainer.should_stop`` when the learner must stop. The module wraps plain_loop's byte-level model.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plain_loop  # noqa: E402
from plain_loop import BATCH, CONTEXT, Windows, char_lm, corpus  # noqa: E402

import atoll  # noqa: E402


class AtollCallback(L.Callback):
    """Make a Lightning Trainer an atoll learner (one optimizer; ``atoll.join`` with ``on_exit="flag"``)."""

    def __init__(self, run: str | None = None, learner_id: str | None = None, *, tokens_per_step: int,
                 **join_kwargs: Any) -> None:
        self.run, self.learner_id, self.tokens_per_step, self.join_kwargs = run, learner_id, tokens_per_step, join_kwargs
        self.learner: Any = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (optimizer,) = trainer.optimizers
        self.learner = atoll.join(self.run, self.learner_id, pl_module, optimizer, on_exit="flag", **self.join_kwargs)
        self.learner.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.learner.step(tokens=self.tokens_per_step, loss=loss.detach() if loss is not None else None)
        if self.learner.should_exit:
            trainer.should_stop = True

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.learner is not None:
            self.learner.__exit__(None, None, None)


class CharLMModule(L.LightningModule):
    def __init__(self, max_steps: int) -> None:
        super().__init__()
        self.model = char_lm()
        self.max_steps = max_steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # logits [B, T, 256]: what atoll's evaluator calls

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def char_lm_module() -> torch.nn.Module:
    """The recipe's model factory: parameter names as the LightningModule has them (``model.*``)."""
    return CharLMModule(1)


def create(url: str, learners: int, rounds: int) -> None:
    plain_loop.create(url, learners, rounds, model=char_lm_module(), factory="lightning_loop:char_lm_module")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--create", metavar="URL")
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    args = ap.parse_args()
    if args.create:
        create(args.create, args.learners, args.rounds)
        return
    torch.set_num_threads(1)
    callback = AtollCallback(tokens_per_step=BATCH * CONTEXT)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(Windows(corpus(), args.seed), batch_size=BATCH, shuffle=False)
    trainer.fit(CharLMModule(args.max_steps), loader)
    print(f"exit: {callback.learner.exit_reason}, {callback.learner.summary.published} published, "
          f"{callback.learner.summary.aligned} aligned", flush=True)


if __name__ == "__main__":
    main()
