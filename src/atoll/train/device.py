"""Where a learner or a synchronizer computes: device choice, autocast, and the one copy to the host.

* :func:`resolve_device` turns a setting (``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``)
  into a ``torch.device``; ``auto`` picks CUDA, then MPS, then the CPU. Asking for a device this
  machine does not have is a :class:`DeviceError` that names the knob to change.
* :func:`autocast` is the inner step's optional bf16 autocast (``autocast="bf16"``); parameters,
  AdamW state, deltas and all outer-step math stay fp32.
* :func:`fragment_to_host` moves a fragment's tensors to the host with **one** device-to-host copy
  (flattened on the device, one :func:`copy_to_host`, then split into views on the host), which is
  what a learner does once per publish and the synchronizer once per merged fragment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

__all__ = [
    "AUTOCAST_CHOICES",
    "DeviceError",
    "autocast",
    "check_autocast",
    "copy_to_host",
    "fragment_delta_to_host",
    "fragment_to_device",
    "fragment_to_host",
    "resolve_device",
]

AUTOCAST_CHOICES = ("", "bf16")
"""Valid ``autocast`` settings: '' (off: fp32 everywhere) or 'bf16' (inner forward/backward)."""


class DeviceError(ValueError):
    """A device setting that this machine cannot honour (the message names the knob)."""


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(setting: str | torch.device | None, *, knob: str = "device") -> torch.device:
    """The ``torch.device`` for ``setting``; ``None``/``""``/``"auto"``: cuda, then mps, then cpu.

    ``knob`` names the setting in the error (e.g. ``LearnerSpec.device`` or ``--device``).
    """
    if isinstance(setting, torch.device):
        name = str(setting)
    else:
        name = (setting or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"{knob}={name!r} is not a device: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"{knob}={name!r} but CUDA is not available on this machine (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda or 'none'}): set {knob} to 'auto' or 'cpu', "
                "or run this learner on a GPU pool with a CUDA build of torch"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"{knob}={name!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return dev
    if dev.type == "mps":
        if not _mps_available():
            raise DeviceError(f"{knob}={name!r} but MPS is not available on this machine: set {knob} to 'auto' or 'cpu'")
        return dev
    raise DeviceError(f"{knob}={name!r}: atoll supports 'auto', 'cpu', 'cuda[:N]' and 'mps'")


def check_autocast(setting: str, *, knob: str = "autocast") -> str:
    """Validate an autocast setting ('' or 'bf16'; 'none'/'off'/'fp32' mean '')."""
    value = (setting or "").strip().lower()
    if value in ("none", "off", "fp32", "false", "0"):
        value = ""
    if value not in AUTOCAST_CHOICES:
        raise DeviceError(f"{knob}={setting!r}: use '' (off) or 'bf16'")
    return value


def autocast(device: torch.device, setting: str) -> contextlib.AbstractContextManager[None]:
    """The inner step's forward pass context: bf16 autocast on ``device`` or nothing at all."""
    if check_autocast(setting) == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def copy_to_host(flat: torch.Tensor) -> torch.Tensor:
    """The single device-to-host copy of a flattened fragment (a no-op on the CPU).

    Kept as its own function so the copy count is observable (tests wrap it)."""
    return flat.cpu()


def fragment_to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (one dtype, any device) on the host, with one device-to-host copy.

    The tensors are flattened into one buffer on their device, copied once, and split into
    contiguous views of that host buffer with the original shapes. Values are unchanged bit for bit.
    """
    items = list(tensors.items())
    if not items:
        return {}
    dtypes = {t.dtype for _, t in items}
    if len(dtypes) != 1:
        raise ValueError(f"fragment_to_host needs one dtype, got {sorted(map(str, dtypes))}")
    flat = torch.cat([t.detach().reshape(-1) for _, t in items]) if len(items) > 1 else items[0][1].detach().reshape(-1)
    host = copy_to_host(flat)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, t in items:
        n = t.numel()
        out[name] = host[offset:offset + n].view(t.shape)
        offset += n
    return out


def fragment_delta_to_host(base: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor], *,
                           out: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``base - local`` in fp32 (``core.pseudograd.learner_delta``, the same values) on the host,
    with one device-to-host copy, and no buffer but the flat one that is copied.

    Each tensor's difference is written straight into its slice of one flat buffer on the device
    (no per-tensor delta, no concatenation), which is copied once (:func:`copy_to_host`; nothing
    on the CPU) and split into views with the original shapes. Names and shapes must match.
    ``out``: a flat fp32 host buffer of the fragment's size to write into (reused across
    publishes; on the CPU the differences go straight into it)."""
    names = list(base)
    if set(names) != set(local):
        raise ValueError(f"fragment_delta_to_host: tensor names differ: {sorted(set(names) ^ set(local))[:5]}")
    if not names:
        return {}
    device = base[names[0]].device
    numel = sum(base[n].numel() for n in names)
    if out is not None and (out.numel() != numel or out.dtype != torch.float32 or out.device.type != "cpu"):
        raise ValueError(f"fragment_delta_to_host: out must be a flat fp32 host tensor of {numel} elements")
    flat = out if out is not None and device.type == "cpu" else torch.empty(numel, dtype=torch.float32, device=device)
    locals_ = [local[n].detach() for n in names]
    if isinstance(base, FlatFragment) and all(x.dtype == torch.float32 and x.device == device for x in locals_):
        # One copy of the local tensors into the buffer and one subtraction: the same values.
        for n, x in zip(names, locals_, strict=True):
            if base[n].shape != x.shape:
                raise ValueError(f"fragment_delta_to_host: shape of {n!r} is {tuple(x.shape)}, "
                                 f"expected {tuple(base[n].shape)}")
        torch.cat([x.reshape(-1) for x in locals_], out=flat)
        torch.sub(base.flat, flat, out=flat)
    else:
        offset = 0
        for n, x in zip(names, locals_, strict=True):
            b = base[n].detach()
            if b.shape != x.shape:
                raise ValueError(f"fragment_delta_to_host: shape of {n!r} is {tuple(x.shape)}, expected {tuple(b.shape)}")
            torch.sub(b.float(), x.float(), out=flat[offset:offset + b.numel()].view(b.shape))
            offset += b.numel()
    if flat is out:
        host = out
    elif out is not None:
        host = out.copy_(flat)  # the one device-to-host copy, into the reused buffer
    else:
        host = copy_to_host(flat)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for n in names:
        k = base[n].numel()
        views[n] = host[offset:offset + k].view(base[n].shape)
        offset += k
    return views


def fragment_to_device(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` on ``device`` (the same tensors when they are already there: no copy on the CPU)."""
    return {n: t.to(device, non_blocking=device.type == "cuda") for n, t in tensors.items()}


class FlatFragment(dict[str, torch.Tensor]):
    """A fragment's fp32 tensors as views of one flat buffer (``flat``), in the dict's order.

    A learner keeps its bases like this, so a publish subtracts the whole fragment in one
    operation instead of one per tensor (a fragment of norms and biases has dozens of small
    tensors, and Python's per-operation cost dominated). Read-only: replacing a tensor would
    leave ``flat`` stale."""

    flat: torch.Tensor

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        raise TypeError("a FlatFragment is read-only (its tensors are views of .flat)")


def flat_fragment_to_device(tensors: Mapping[str, torch.Tensor], device: torch.device) -> FlatFragment:
    """``tensors`` as fp32 views of one new flat buffer on ``device`` (values unchanged)."""
    numel = sum(t.numel() for t in tensors.values())
    flat = torch.empty(numel, dtype=torch.float32, device=device)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for n, t in tensors.items():
        view = flat[offset:offset + t.numel()].view(t.shape)
        view.copy_(t.detach())
        views[n] = view
        offset += t.numel()
    out = FlatFragment(views)
    out.flat = flat
    return out
