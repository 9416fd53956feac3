"""The inner state a learner saves for rejoin: its optimizer's state by parameter name, as fp32
(or bf16 moments) tensors in one layout (``adamw.<name>.<key>``) whatever the island's sharding, nothing pickled."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["inner_state_tensors", "load_inner_state", "local_inner_state", "moments_as"]


def inner_state_tensors(states: Mapping[str, Mapping[str, Any]], *,
                        moments: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Optimizer state by parameter name -> the saved layout: ``adamw.<name>.<key>`` tensors on
    the host (any optimizer: the prefix is historical; tensors and numbers, nothing pickled).
    Step counts and other numbers are fp32 (exact up to 2^24 steps); state tensors (AdamW's
    moments) are ``moments`` (fp32, or bf16 to halve a save: cast where the state lives, before
    the copy to the host).

    The layout does not depend on how the island was sharded: a DDP island can rejoin as FSDP2
    and back."""
    tensors: dict[str, torch.Tensor] = {}
    for name, st in states.items():
        for key, value in (st or {}).items():
            if key == "step" or not isinstance(value, torch.Tensor):
                if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
                    continue  # not a number (e.g. a flag): the optimizer rebuilds it
                tensors[f"adamw.{name}.{key}"] = torch.as_tensor(value, dtype=torch.float32).reshape(1).cpu()
            else:
                tensors[f"adamw.{name}.{key}"] = value.detach().to(moments).contiguous().cpu()
    return tensors


def moments_as(tensors: dict[str, torch.Tensor], moments: torch.dtype) -> dict[str, torch.Tensor]:
    """A saved layout with its state tensors (not the ``.step`` counts) in ``moments``."""
    return {k: t if k.endswith(".step") or t.dtype == moments else t.to(moments) for k, t in tensors.items()}


def local_inner_state(model: torch.nn.Module, opt: torch.optim.Optimizer, *, snapshot: bool = False,
                      moments: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The optimizer's state in the saved layout (state tensors in ``moments``); ``snapshot``:
    copies that the next optimizer step will not change (on the CPU the saved layout otherwise
    shares the state's memory)."""
    states = {name: opt.state.get(p, {}) for name, p in model.named_parameters()}
    tensors = inner_state_tensors(states, moments=moments)
    if snapshot:
        live = {v.data_ptr() for st in states.values() for v in (st or {}).values() if isinstance(v, torch.Tensor)}
        tensors = {k: t.clone() if t.data_ptr() in live else t for k, t in tensors.items()}
    return tensors


def load_inner_state(tensors: dict[str, torch.Tensor], model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Put a saved inner state (:func:`inner_state_tensors`' layout) into ``opt`` for ``model``."""
    for name, p in model.named_parameters():
        prefix = f"adamw.{name}."
        keys = [k for k in tensors if k.startswith(prefix) and "." not in k[len(prefix):]]
        if not keys:
            continue
        state: dict[str, Any] = {}
        for k in keys:
            key, value = k[len(prefix):], tensors[k]
            if key == "step":  # AdamW keeps it as a 0-dim float tensor (on the host unless fused/capturable)
                device = p.device if opt.defaults.get("fused") or opt.defaults.get("capturable") else "cpu"
                state[key] = value.reshape(()).to(device).clone()
            elif value.numel() == p.numel():
                state[key] = value.to(p.device, p.dtype).reshape(p.shape).clone()
            else:  # a per-parameter scalar or other shape: as saved
                state[key] = value.to(p.device).clone()
        opt.state[p] = state
