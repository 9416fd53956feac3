"""Pseudo-gradients (outer gradients) of one fragment.

Sign convention (paper arXiv 2604.21428, Sec. 3: outer gradients): a learner publishes ``delta = Theta_p(b) - theta_{m,p}``: the global
fragment at the base version b it last aligned to, minus its own current fragment. The
synchronizer re-anchors it at the *current* global value:

    v_m = Theta_p(current) - theta_{m,p} = (Theta_p(current) - Theta_p(b)) + delta_m

so a contribution computed against an old version is never applied as if it were fresh. With
b = current the correction term is zero and v_m = delta_m. All arithmetic is fp32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from atoll.core.merge import BLOCK, blocked, blocks

__all__ = ["learner_delta", "anchor_gradient", "outer_gradient", "outer_gradients", "check_same_layout"]

Tensors = Mapping[str, torch.Tensor]


def check_same_layout(a: Tensors, b: Tensors, *, what: str = "tensors") -> None:
    """Raise ValueError naming the first tensor whose name set or shape differs."""
    if set(a) != set(b):
        missing = sorted(set(a) ^ set(b))
        raise ValueError(f"{what}: tensor names differ: {missing[:5]}")
    for name in a:
        if a[name].shape != b[name].shape:
            raise ValueError(f"{what}: shape of {name!r} is {tuple(b[name].shape)}, expected {tuple(a[name].shape)}")


def learner_delta(base: Tensors, local: Tensors) -> dict[str, torch.Tensor]:
    """delta = base - local, in fp32 (what a learner publishes for one fragment)."""
    check_same_layout(base, local, what="learner_delta")
    return {n: base[n].detach().float() - local[n].detach().float() for n in base}


def _sub(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return a - b if out is None else torch.sub(a, b, out=out)


def anchor_gradient(current: Tensors, base: Tensors, *, out: Tensors | None = None) -> dict[str, torch.Tensor]:
    """current - base, in fp32: the re-anchoring term shared by every contribution against ``base``.

    ``out``: fp32 tensors of the same layout to write into (a merge's reused workspace); the
    values are the same bit for bit."""
    check_same_layout(current, base, what="outer_gradient(base)")
    return {n: _sub(current[n].detach().float(), base[n].detach().float(), out[n] if out is not None else None)
            for n in current}


def outer_gradient(current: Tensors, base: Tensors, delta: Tensors, *,
                   anchor: Tensors | None = None, out: Tensors | None = None) -> dict[str, torch.Tensor]:
    """v = (current - base) + delta, in fp32; equals ``current - theta_learner``.

    ``anchor`` is ``current - base`` when the caller has it already (:func:`anchor_gradient`, once
    per base version); the result is the same tensor for tensor. When ``base`` *is* ``current``
    (the same mapping) the correction is zero and v is ``delta`` itself (as fp32, not copied).
    ``out``: where to write v otherwise (fp32, same layout; a reused workspace), same values.
    """
    check_same_layout(current, base, what="outer_gradient(base)")
    check_same_layout(current, delta, what="outer_gradient(delta)")
    if base is current:
        return {n: delta[n].float() for n in current}
    if anchor is None:
        anchor = anchor_gradient(current, base)
    if out is not None:
        return {n: torch.add(anchor[n], delta[n].float(), out=out[n]) for n in current}
    return {n: anchor[n] + delta[n].float() for n in current}


def outer_gradients(current: Tensors, base: Tensors, deltas: Sequence[Tensors], *,
                    out: Sequence[Tensors] | None = None,
                    anchor_out: Tensors | None = None) -> list[dict[str, torch.Tensor]]:
    """:func:`outer_gradient` of several deltas against one ``base``, with the same values.

    ``out[i]`` receives the i-th outer gradient (fp32, ``current``'s layout; a reused workspace).
    Then, on the CPU, each tensor is done block by block: ``current - base`` of a block is computed
    once into a small buffer and added to each delta's block, so the anchor term never makes a
    round trip through memory; elsewhere it goes to ``anchor_out`` (or a fresh tensor) first.
    """
    if base is current:
        return [outer_gradient(current, current, d) for d in deltas]
    for d in deltas:
        check_same_layout(current, d, what="outer_gradient(delta)")
    if out is None:
        anchor = anchor_gradient(current, base, out=anchor_out)
        return [outer_gradient(current, base, d, anchor=anchor) for d in deltas]
    check_same_layout(current, base, what="outer_gradient(base)")
    results: list[dict[str, torch.Tensor]] = [{} for _ in deltas]
    block: torch.Tensor | None = None
    for name, cur in current.items():
        b = base[name]
        ds = [delta[name].float() for delta in deltas]
        targets = [o[name] for o in out]
        if blocked(cur, b, *ds, *targets):
            if block is None:
                block = torch.empty(BLOCK, dtype=torch.float32)
            c, bf = cur.view(-1), b.view(-1)
            dfs, tfs = [x.view(-1) for x in ds], [t.view(-1) for t in targets]
            for s in blocks(c.numel()):
                a = torch.sub(c[s:s + BLOCK], bf[s:s + BLOCK], out=block[:min(BLOCK, c.numel() - s)])
                for x, t in zip(dfs, tfs, strict=True):
                    torch.add(a, x[s:s + BLOCK], out=t[s:s + BLOCK])
        else:
            a = _sub(cur.detach().float(), b.detach().float(), anchor_out[name] if anchor_out is not None else None)
            for x, t in zip(ds, targets, strict=True):
                torch.add(a, x, out=t)
        for r, t in zip(results, targets, strict=True):
            r[name] = t
    return results
