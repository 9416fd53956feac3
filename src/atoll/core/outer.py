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

from atoll.core.merge import BLOCK, blocked, blocks, scale_

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
        self._buffers: dict[str, torch.Tensor] = {}
        self._copies: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """A :meth:`fork`'s buffers not copied yet: name -> (the original's buffer, where its copy goes)."""

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The momentum buffers by parameter name (this optimizer's own: a fork's copies are made first)."""
        for name, (source, target) in self._copies.items():
            self._buffers[name] = target.copy_(source)
        self._copies.clear()
        return self._buffers

    @buffers.setter
    def buffers(self, value: dict[str, torch.Tensor]) -> None:
        self._copies.clear()
        self._buffers = value

    def fork(self, *, reuse: Mapping[str, torch.Tensor] | None = None) -> NesterovOuterOptimizer:
        """A copy with the same settings and momentum values, whose steps leave this one intact
        (a synchronizer's round steps a fork: if another synchronizer wins the commit, it is
        dropped). ``reuse``: tensors nobody else uses any more (e.g. the buffers of a retired fork)
        to copy into where name, shape, device and dtype (fp32) match, instead of fresh buffers;
        the values are the same. Each buffer is copied into its reused
        tensor when first needed: a :meth:`step` writes ``mu * b + Delta`` there straight from this
        optimizer's buffer (the same operations, one pass instead of a copy and an update; none at
        mu = 0, where the buffer is replaced), and reading :attr:`buffers` copies the rest."""
        fork = NesterovOuterOptimizer(lr=self.lr, momentum=self.momentum)
        for name, value in self.buffers.items():
            target = reuse.get(name) if reuse is not None else None
            if target is not None and _reusable(target, value):
                fork._copies[name] = (value, target)
            else:
                fork._buffers[name] = value.float().clone()
        return fork

    def step(self, params: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor], *,
             out: Mapping[str, torch.Tensor] | None = None,
             scratch: Mapping[str, torch.Tensor] | None = None,
             scale: Mapping[str, float | None] | None = None) -> dict[str, torch.Tensor]:
        """Apply one outer step for the tensors in ``update``; returns the new parameters.

        ``out[name]`` (fp32, the parameter's shape, aliasing none of the inputs), where given,
        receives the new parameter; ``scratch[name]`` holds the step ``lr * (Delta + mu * b)``
        on the way. Both are for reused buffers (no fresh, page-faulting allocation per round);
        the values are the same bit for bit. ``scale[name]``: first scale ``update[name]`` in
        place by that factor (None: zero it), RDA's last pass (``core.merge.rda_direction``), fused
        into this one. On the CPU, with ``out`` and an existing momentum buffer, the whole step
        runs block by block (the same element-wise operations in the same order): one read of the
        update, momentum and parameter and one write of each result, instead of a pass per operation."""
        if set(update) - set(params):
            raise KeyError(f"update names not in params: {sorted(set(update) - set(params))[:5]}")
        new: dict[str, torch.Tensor] = {}
        block: torch.Tensor | None = None
        for name, delta in update.items():
            theta = params[name]
            delta32 = delta.float()
            if delta32.shape != theta.shape:
                raise ValueError(f"update for {name!r} has shape {tuple(delta32.shape)}, param {tuple(theta.shape)}")
            scaled = scale is not None and name in scale
            factor = scale[name] if scale is not None and name in scale else None
            # A fork's buffer not copied yet: the update reads the original and writes the copy.
            copy = self._copies.pop(name, None)
            buf, buf_out = copy if copy is not None else (self._buffers.get(name),) * 2
            target = out.get(name) if out is not None else None
            if (target is not None and buf is not None and buf_out is not None and buf.shape == theta.shape
                    and blocked(theta, delta32, target, buf, buf_out)):
                if block is None:
                    block = torch.empty(BLOCK, dtype=torch.float32)
                new[name] = self._blocked_step(theta, delta32, (buf, buf_out), target, block, scaled, factor)
                self._buffers[name] = buf_out if self.momentum else delta32
                continue
            if scaled:
                scale_(delta32, factor)
            # The same operations, in the same order, as torch.optim.SGD(nesterov=True) (tests
            # compare bit for bit), with as few fresh buffers as that allows (a merge is bound by
            # memory traffic). The momentum buffers are this optimizer's own (load_state_dict and
            # fork copy them) and are updated in place, or into a fork's copy.
            if buf is None:
                buf = delta32.clone()
            elif self.momentum:
                buf = torch.mul(buf, self.momentum, out=buf_out).add_(delta32)
            else:
                buf = delta32  # mu = 0: b = 0 * b + Delta = Delta, without two passes over memory
            self._buffers[name] = buf
            tmp = scratch.get(name) if scratch is not None else None
            if self.momentum:
                step = (delta32.add(buf, alpha=self.momentum) if tmp is None else
                        torch.add(delta32, buf, alpha=self.momentum, out=tmp)).mul_(self.lr)
            else:
                step = delta32 * self.lr if tmp is None else torch.mul(delta32, self.lr, out=tmp)
            if target is not None and theta.dtype == torch.float32:
                new[name] = torch.sub(theta, step, out=target)
            else:
                new[name] = (theta.float() - step).to(theta.dtype)
        return new

    def _blocked_step(self, theta: torch.Tensor, delta: torch.Tensor, buf: tuple[torch.Tensor, torch.Tensor],
                      target: torch.Tensor, block: torch.Tensor, scaled: bool, factor: float | None) -> torch.Tensor:
        """:meth:`step` for one tensor, block by block (CPU; everything fp32 and contiguous); ``buf``:
        the momentum buffer and where its update goes (itself, or a fork's copy)."""
        th, d, b, b_out, t = theta.view(-1), delta.view(-1), buf[0].view(-1), buf[1].view(-1), target.view(-1)
        for s in blocks(th.numel()):
            e = min(th.numel(), s + BLOCK)
            db, tmp = d[s:e], block[:e - s]
            if scaled:
                scale_(db, factor)
            if self.momentum:
                bb = torch.mul(b[s:e], self.momentum, out=b_out[s:e]).add_(db)
                torch.add(db, bb, alpha=self.momentum, out=tmp).mul_(self.lr)
            else:
                torch.mul(db, self.lr, out=tmp)
            torch.sub(th[s:e], tmp, out=t[s:e])
        return target

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Momentum buffers keyed ``momentum.<param name>`` (safetensors-ready, contiguous fp32).

        The live buffers, not copies: the next :meth:`step` updates them in place, so save or
        :meth:`load_state_dict` (which copies) them before stepping again."""
        return {f"momentum.{n}": b.contiguous() for n, b in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` in, into fresh buffers (:meth:`fork` reuses tensors instead)."""
        buffers: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not key.startswith("momentum."):
                raise KeyError(f"unexpected outer optimizer state key {key!r}")
            buffers[key[len("momentum."):]] = value.float().clone()
        self.buffers = buffers


def _reusable(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``value`` can be copied into ``target``: fp32, its shape and device, not itself."""
    return (target.shape == value.shape and target.dtype == torch.float32
            and target.device == value.device and target.data_ptr() != value.data_ptr())
