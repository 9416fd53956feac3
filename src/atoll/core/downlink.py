"""The compressed downlink: error feedback between the synchronizer's fp32 master and what learners hold.

Learners do not need the synchronizer's fp32 master copy of a fragment, only something close to
it. With a compressed downlink the synchronizer tracks the *view*: the value a learner following
along holds. For each new version v of a fragment it publishes the version-to-version update
against that view, compressed, and moves the view by exactly what a learner will decode::

    r_v    = master_v - view_{v-1}            (the residual: this version's change plus last drift)
    q_v    = encode(r_v)                       (bf16 or int4, core.compress)
    view_v = view_{v-1} + decode(q_v)          (what every learner computes, to the last bit)

``view_0 = master_0`` (the run's initial weights). The drift ``d_v = master_v - view_v`` is one
quantization error of ``r_v``, and ``r_v = (master_v - master_{v-1}) + d_{v-1}`` carries the
previous drift forward instead of leaving it behind, so the drift does not accumulate:

* int4, block size B: ``|d_v| <= max|block of r_v| / 14`` per element (the codec's bound), hence
  ``max|d_v| <= max|change| / 13`` at every version, where ``max|change|`` bounds every
  ``|master_v - master_{v-1}|`` so far;
* bf16: ``|d_v| <= 2^-8 |r_v|`` per element, hence ``|d_v| <= 2^-8 / (1 - 2^-8) x max|change|``
  elementwise;

each plus the rounding of the two fp32 operations (2^-24 of their operands). Without error
feedback (compressing ``master_v - master_{v-1}`` and adding it up) the errors add up like a
random walk. :func:`drift_bound` is the per-version bound. Pure: torch and the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from atoll.core.compress import EncodedTensor, encode_residual

__all__ = ["DownlinkStep", "apply_update", "downlink_step", "drift_bound", "INT4_DRIFT_DIVISOR", "BF16_DRIFT_RATIO"]

INT4_DRIFT_DIVISOR = 14.0
"""int4: an element's error is at most max|block| / 14 (half a step of max|block| / 7)."""

BF16_DRIFT_RATIO = 2.0**-8
"""bf16 (8 significant bits, rounding to nearest): an element's error is at most 2^-8 of it."""


@dataclass(frozen=True)
class DownlinkStep:
    """One version's downlink: the compressed update learners download and the view it leads to."""

    update: dict[str, EncodedTensor]
    """``encode(master_v - view_{v-1})`` per parameter."""
    view: dict[str, torch.Tensor]
    """``view_{v-1} + decode(update)``, fp32: what a learner holds after applying it."""


def apply_update(view: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``view + update`` per parameter, fp32, new tensors: the one way a view moves (the
    synchronizer and every learner compute it alike, so they agree to the last bit)."""
    if set(view) != set(update):
        raise ValueError(f"update names {sorted(update)[:5]} differ from the view's {sorted(view)[:5]}")
    return {n: torch.add(view[n].float(), update[n].float()) for n in view}


def downlink_step(master: Mapping[str, torch.Tensor], view: Mapping[str, torch.Tensor], codec: str, *,
                  block_size: int = 32) -> DownlinkStep:
    """The update to publish for a new master version, and the view it leads to (error feedback:
    the residual against the view, not against the previous master). ``codec``: 'bf16' or 'int4'
    ('fp32' works too, and then the view equals the master)."""
    if set(master) != set(view):
        raise ValueError(f"master names {sorted(master)[:5]} differ from the view's {sorted(view)[:5]}")
    # One pass per tensor (core.compress.encode_residual): the new view is built from the
    # quantizer's own codes, bit for bit what apply_update(view, decode(update)) gives.
    steps = {n: encode_residual(master[n], view[n], codec, block_size=block_size) for n in master}
    return DownlinkStep(update={n: enc for n, (enc, _) in steps.items()},
                        view={n: moved for n, (_, moved) in steps.items()})


def drift_bound(residual: torch.Tensor, codec: str, *, block_size: int = 32) -> torch.Tensor:
    """Per element, the most ``master_v - view_v`` can differ from 0 after a step whose residual
    (``master_v - view_{v-1}``) is ``residual``, apart from fp32 rounding: int4 ``max|block| / 14``,
    bf16 ``2^-8 |r|``, fp32 0."""
    r = residual.detach().float()
    if codec == "fp32":
        return torch.zeros_like(r)
    if codec == "bf16":
        return r.abs() * BF16_DRIFT_RATIO
    if codec != "int4":
        raise ValueError(f"unknown codec {codec!r}")
    flat = r.reshape(-1)
    pad = (-flat.numel()) % block_size
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block_size)
    per_block = blocks.abs().amax(dim=1, keepdim=True) / INT4_DRIFT_DIVISOR
    return per_block.expand(-1, block_size).reshape(-1)[: flat.numel()].reshape(r.shape).clone()
