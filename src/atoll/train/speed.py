"""How fast a learner trains: tokens/s, model FLOPs utilisation (MFU) and peak device memory.

MFU is the model's FLOPs per token times tokens/s over the chip's dense bf16 peak. A GPT's FLOPs
per token are ``6 N + 12 L d T`` (PaLM's count: 6 per parameter for forward and backward, plus
attention's scores and values over a context of T); any other model counts ``6 N``. The peak
comes from :data:`PEAK_BF16_TFLOPS` by the CUDA device's name, or from ``$ATOLL_PEAK_TFLOPS``
(``--peak-tflops``) for chips not in the table. No MFU on the CPU or MPS: their peaks are not a
number one can look up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

__all__ = ["PEAK_BF16_TFLOPS", "PEAK_TFLOPS_ENV", "RateMeter", "flops_per_token", "peak_tflops"]

PEAK_BF16_TFLOPS: dict[str, float] = {  # dense (no sparsity), bf16 tensor cores, from the vendors' sheets
    "H200": 989.0, "H100": 989.0, "GH200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
    "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "A6000": 155.0,
    "B200": 2250.0, "GB200": 2500.0, "MI300X": 1307.0, "MI250X": 383.0, "RTX 4090": 165.0,
    "RTX 3090": 71.0, "V100": 125.0, "T4": 65.0,
}
"""CUDA device-name fragment -> dense bf16 peak in TFLOP/s; longer names are matched first
("A10G" before "A10", "L40S" before "L40" and "L4"). V100 and T4 have no bf16: their fp16 peak."""

PEAK_TFLOPS_ENV = "ATOLL_PEAK_TFLOPS"
"""Environment variable with the chip's dense bf16 peak in TFLOP/s (overrides the table)."""


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The dense bf16 peak of ``device`` in TFLOP/s: ``override``, else ``$ATOLL_PEAK_TFLOPS``,
    else the table by CUDA device name; None on the CPU, MPS or an unknown chip."""
    if override:
        return float(override)
    env = os.environ.get(PEAK_TFLOPS_ENV, "").strip()
    if env:
        try:
            return float(env) if float(env) > 0 else None
        except ValueError:
            return None
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def flops_per_token(model: torch.nn.Module, context_tokens: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L d T`` for atoll's GPT (``model.config``), else ``6 N``."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cfg = getattr(model, "config", None)
    layers, width = getattr(cfg, "num_layers", None), getattr(cfg, "embed_dim", None)
    if isinstance(layers, int) and isinstance(width, int):
        return 6.0 * params + 12.0 * layers * width * context_tokens
    return 6.0 * params


class RateMeter:
    """Tokens/s, MFU and peak memory since the previous reading, for a learner's progress lines.

    ``tokens`` returns the learner's tokens so far; each :meth:`line` covers the wall time and the
    tokens since the one before (saves and publishes included: what the run gets). ``chips``: the
    devices those tokens were trained on (an island's ranks), whose peaks add up."""

    def __init__(self, device: torch.device, *, flops_per_token: float, tokens: Callable[[], int], chips: int = 1,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.device, self.flops_per_token, self.tokens, self.clock = device, flops_per_token, tokens, clock
        peak = peak_tflops(device)
        self.peak = peak * chips if peak else None
        self._last = (clock(), tokens())

    def reading(self) -> tuple[float, float | None, float | None]:
        """(tokens/s, MFU or None, peak device memory in GiB or None) since the last reading."""
        now, tokens = self.clock(), self.tokens()
        (t0, n0), self._last = self._last, (now, tokens)
        rate = (tokens - n0) / max(1e-9, now - t0)
        mfu = rate * self.flops_per_token / (self.peak * 1e12) if self.peak else None
        memory = None
        if self.device.type == "cuda" and torch.cuda.is_available():
            memory = torch.cuda.max_memory_allocated(self.device) / 2**30
        return rate, mfu, memory

    def report(self) -> dict[str, float]:
        """The reading as a contribution's ``info["speed"]`` (``atoll status``'s learner rows):
        ``tok_s``, and ``mfu`` and ``peak_mem_gib`` where known."""
        rate, mfu, memory = self.reading()
        out = {"tok_s": round(rate, 1)}
        if mfu is not None:
            out["mfu"] = round(mfu, 4)
        if memory is not None:
            out["peak_mem_gib"] = round(memory, 3)
        return out

    def line(self) -> str:
        """``, 41,230 tok/s, MFU 38.2%, peak mem 11.4 GiB`` (MFU and memory where known)."""
        rate, mfu, memory = self.reading()
        out = f", {rate:,.0f} tok/s"
        if mfu is not None:
            out += f", MFU {mfu:.1%}"
        if memory is not None:
            out += f", peak mem {memory:.1f} GiB"
        return out
