"""The outer optimizer: Nesterov SGD per fragment, run by the synchronizer.

    b <- mu * b + Delta
    Theta <- Theta - eta * (Delta + mu * b)

(the same update as ``torch.optim.SGD(nesterov=True)`` with the outer gradient as the gradient).
The momentum buffers start at zero and round-trip through a plain ``dict[str, Tensor]`` so they
are saved with every checkpoint as safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["NesterovOuterOptimizer"]


class NesterovOuterOptimizer:
    """Nesterov SGD over named fp32 tensors; ``step`` returns new tensors and keeps inputs intact."""

    def __init__(self, *, lr: float = 0.7, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {momentum!r}")
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[str, torch.Tensor] = {}

    def step(self, params: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply one outer step for the tensors in ``update``; returns the new parameters."""
        if set(update) - set(params):
            raise KeyError(f"update names not in params: {sorted(set(update) - set(params))[:5]}")
        new: dict[str, torch.Tensor] = {}
        for name, delta in update.items():
            theta = params[name]
            delta32 = delta.float()
            if delta32.shape != theta.shape:
                raise ValueError(f"update for {name!r} has shape {tuple(delta32.shape)}, param {tuple(theta.shape)}")
            # The same operations, in the same order, as torch.optim.SGD(nesterov=True) (tests
            # compare bit for bit), with as few fresh buffers as that allows (a merge is bound by
            # memory traffic). The momentum buffers are this optimizer's own (load_state_dict
            # copies) and are updated in place.
            buf = self.buffers.get(name)
            if buf is None:
                buf = delta32.clone()
            elif self.momentum:
                buf = buf.mul_(self.momentum).add_(delta32)
            else:
                buf = delta32  # mu = 0: b = 0 * b + Delta = Delta, without two passes over memory
            self.buffers[name] = buf
            if self.momentum:
                step = delta32.add(buf, alpha=self.momentum).mul_(self.lr)
            else:
                step = delta32 * self.lr
            new[name] = (theta.float() - step).to(theta.dtype)
        return new

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Momentum buffers keyed ``momentum.<param name>`` (safetensors-ready, contiguous fp32).

        The live buffers, not copies: the next :meth:`step` updates them in place, so save or
        :meth:`load_state_dict` (which copies) them before stepping again."""
        return {f"momentum.{n}": b.contiguous() for n, b in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        buffers: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not key.startswith("momentum."):
                raise KeyError(f"unexpected outer optimizer state key {key!r}")
            buffers[key[len("momentum."):]] = value.float().clone()
        self.buffers = buffers
