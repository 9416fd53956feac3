"""Codecs: encode and decode time of one 86M-parameter fragment, the straightforward codec against atoll's.

    python benchmarks/codec_speed.py [--size 86M] [--fragments 8] [--block-size 32] [--repeats 7]
        [--out out/bench/codec_speed]

What a synchronizer round at 86 M (P = 8) spends in codecs, per fragment (the largest of the 8 of a
GPT on bytes, 12 x 768, with its real tensor shapes; random values of a delta's size):

* **decode payload**: an int4 contribution's safetensors bytes to fp32 tensors with every check
  (``atoll.storage.codec.bytes_to_encoded``, what the synchronizer does M times a round);
* **decode**: the int4 decode alone (encoded parts to fp32);
* **encode**: int4 encode of the fragment (what a learner does per publish);
* **downlink step**: the int4 update against the learners' view and the new view
  (``atoll.core.downlink.downlink_step``, once per round).

Each row runs the straightforward implementation (kept here, written out: nibbles unpacked one by
one, stacked, converted, scaled and trimmed; decoded values checked for NaN again; the downlink's
encode, decode and add as three steps) and atoll's, interleaved in one process, best and median of
``--repeats``, wall time and the process's CPU time (steadier on a shared machine); both give
the same bits (checked before timing). On a machine with CUDA it adds
**payload to device**: the bytes to fp32 tensors on the GPU, decoded on the host and copied (the
fp32 values travel) against copied encoded and decoded there (``device=``).

Prints a table and writes ``codec_speed.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from atoll.core.compress import EncodedTensor, all_finite, decode_fragment, encode
from atoll.core.downlink import downlink_step
from atoll.core.fragments import plan_fragments
from atoll.storage.codec import PART_SEPARATOR, bytes_to_encoded, encoded_to_bytes
from atoll.train.model import GPT, GPTConfig, micro, mini, small

SIZES: dict[str, GPTConfig] = {"0.1M": micro(), "10M": mini(), "86M": small(vocab_size=256, tie_embeddings=False)}
"""GPTs on bytes by rounded parameter count (benchmarks/sync_throughput.py's)."""

DELTA_SCALE = 1e-3
"""Size of the random deltas' values."""


# -- the straightforward codec, written out ---------------------------------------------------------

def old_encode_int4(x: torch.Tensor, block_size: int) -> EncodedTensor:
    x32 = x.detach().float().contiguous()
    if not all_finite(x32):
        raise ValueError("NaN or Inf")
    flat = x32.reshape(-1)
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, block_size)
    scales = blocks.abs().amax(dim=1) / 7
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-7, 7).to(torch.int16) + 8
    q = q.reshape(-1).to(torch.uint8)
    codes = q[0::2] | (q[1::2] << 4)
    return EncodedTensor("int4", tuple(x32.shape), {"codes": codes.contiguous(), "scales": scales.contiguous()},
                         block_size)


def old_decode(enc: EncodedTensor) -> torch.Tensor:
    n = math.prod(enc.shape)
    if enc.codec != "int4":
        return enc.parts["data"].float().reshape(enc.shape).clone()
    codes, scales = enc.parts["codes"], enc.parts["scales"]
    lo = (codes & 0x0F).to(torch.int16) - 8
    hi = (codes >> 4).to(torch.int16) - 8
    q = torch.stack([lo, hi], dim=1).reshape(-1, enc.block_size).float()
    return (q * scales.float()[:, None]).reshape(-1)[:n].reshape(enc.shape).contiguous()


def old_bytes_to_encoded(data: bytes, meta: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The payload path before: parts checked, each tensor decoded on its own, then checked again."""
    flat = dict(safetensors.torch.load(bytes(data)))
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, _, part = key.rpartition(PART_SEPARATOR)
        grouped.setdefault(name, {})[part] = t
    out = {}
    for name, m in meta.items():
        parts = grouped[name]
        for t in parts.values():
            if t.is_floating_point() and not all_finite(t):
                raise ValueError("NaN or Inf")
        value = old_decode(EncodedTensor(m["codec"], tuple(m["shape"]), parts, int(m["block_size"])))
        if not all_finite(value):
            raise ValueError("NaN or Inf")
        out[name] = value
    return out


def old_downlink_step(master: Mapping[str, torch.Tensor], view: Mapping[str, torch.Tensor],
                      block_size: int) -> tuple[dict[str, EncodedTensor], dict[str, torch.Tensor]]:
    update = {n: old_encode_int4(master[n].float() - view[n].float(), block_size) for n in master}
    return update, {n: torch.add(view[n].float(), old_decode(e).float()) for n, e in update.items()}


# -- measuring --------------------------------------------------------------------------------------

def fragment_shapes(cfg: GPTConfig, fragments: int) -> dict[str, tuple[int, ...]]:
    """The largest of the model's P fragments, by parameters: name -> shape."""
    with torch.device("meta"):
        model = GPT(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = plan_fragments(shapes, num_fragments=fragments, inner_steps=fragments)
    biggest = max(range(fragments), key=plan.fragment_numel)
    return {n: shapes[n] for n in plan.fragments[biggest]}


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process: every thread) of one call."""
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[n].detach().cpu().contiguous().view(torch.uint8), b[n].detach().cpu().contiguous().view(torch.uint8))
        for n in a)


def compare(name: str, old: Callable[[], object], new: Callable[[], object], repeats: int,
            sync: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Both once (warm-up), then interleaved ``repeats`` times: medians and bests, wall and CPU."""
    old(), new()
    times: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for _ in range(repeats):
        times["old"].append(timed(old, sync))
        times["new"].append(timed(new, sync))
    row: dict[str, Any] = {"what": name}
    for which, runs in times.items():
        for i, clock in enumerate(("wall", "cpu")):
            values = [1e3 * r[i] for r in runs]
            row[f"{which}_{clock}_median_ms"] = statistics.median(values)
            row[f"{which}_{clock}_best_ms"] = min(values)
    row["speedup"] = row["old_wall_median_ms"] / row["new_wall_median_ms"]
    row["cpu_speedup"] = row["old_cpu_median_ms"] / row["new_cpu_median_ms"]
    print(f"  {name}: {row['old_wall_median_ms']:.1f} ms -> {row['new_wall_median_ms']:.1f} ms "
          f"(CPU {row['old_cpu_median_ms']:.1f} -> {row['new_cpu_median_ms']:.1f})", flush=True)
    return row


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    shapes = fragment_shapes(SIZES[args.size], args.fragments)
    numel = sum(math.prod(s) for s in shapes.values())
    g = torch.Generator().manual_seed(0)
    delta = {n: torch.randn(s, generator=g) * DELTA_SCALE for n, s in shapes.items()}
    bs = args.block_size
    encoded = {n: encode(t, "int4", block_size=bs) for n, t in delta.items()}
    data, meta = encoded_to_bytes(encoded)
    view = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    master = {n: view[n] + delta[n] for n in view}

    # Same bits before any timing.
    assert same_bits(old_bytes_to_encoded(data, meta), bytes_to_encoded(data, meta))
    assert all(same_bits(old_encode_int4(t, bs).parts, encoded[n].parts) for n, t in delta.items())
    old_update, old_view = old_downlink_step(master, view, bs)
    step = downlink_step(master, view, "int4", block_size=bs)
    assert same_bits(old_view, step.view) and all(same_bits(old_update[n].parts, step.update[n].parts) for n in view)

    r = args.repeats
    rows = [
        compare("decode payload (bytes -> fp32, checked)", lambda: old_bytes_to_encoded(data, meta),
                lambda: bytes_to_encoded(data, meta), r),
        compare("decode (parts -> fp32)", lambda: {n: old_decode(e) for n, e in encoded.items()},
                lambda: decode_fragment(encoded), r),
        compare("encode (fp32 -> parts)", lambda: {n: old_encode_int4(t, bs) for n, t in delta.items()},
                lambda: {n: encode(t, "int4", block_size=bs) for n, t in delta.items()}, r),
        compare("downlink step (update + view)", lambda: old_downlink_step(master, view, bs),
                lambda: downlink_step(master, view, "int4", block_size=bs), r),
    ]
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert same_bits(bytes_to_encoded(data, meta, device=cuda), bytes_to_encoded(data, meta))
        rows.append(compare(
            "payload to device (bytes -> fp32 on CUDA)",
            lambda: {n: t.to(cuda) for n, t in old_bytes_to_encoded(data, meta).items()},
            lambda: bytes_to_encoded(data, meta, device=cuda), r, sync=torch.cuda.synchronize))
    info = {"size": args.size, "fragments": args.fragments, "fragment_params": numel, "tensors": len(shapes),
            "block_size": bs, "payload_mb": len(data) / 1e6, "threads": torch.get_num_threads(),
            "load_avg": os.getloadavg()[0], "device": torch.cuda.get_device_name() if torch.cuda.is_available()
            else "cpu", "torch": torch.__version__}
    return rows, info


def table(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = [f"{info['size']} P={info['fragments']}: one fragment of {info['fragment_params'] / 1e6:.1f}M params "
             f"({info['tensors']} tensors), int4 block {info['block_size']}, payload {info['payload_mb']:.1f} MB; "
             f"{info['threads']} threads, load {info['load_avg']:.1f}, {info['device']}", "",
             "| per fragment | before ms | after ms | speed-up | before CPU ms | after CPU ms | CPU speed-up |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['old_wall_median_ms']:.1f} | {r['new_wall_median_ms']:.1f} | "
                     f"{r['speedup']:.1f}x | {r['old_cpu_median_ms']:.1f} | {r['new_cpu_median_ms']:.1f} | "
                     f"{r['cpu_speedup']:.1f}x |")
    lines.append("")
    lines.append("ms: median of the repeats, wall; CPU ms: CPU time of the process (all threads) in the same calls.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="86M")
    ap.add_argument("--fragments", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", default="out/bench/codec_speed")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, info = measure(args)
    print()
    print(table(rows, info))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec_speed.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
