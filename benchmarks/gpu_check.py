"""The GPU check: what atoll does on this machine's GPU, in under 5 minutes, as one table.

    python benchmarks/gpu_check.py [--peak-tflops X] [--fleet-s 75] [--out out/gpu-check]
    make gpu-check

On a machine without a CUDA device it says so and exits 0 without running anything. With one it
prints a progress line at least every ~10 s, then a table of:

1. **the CUDA tests**: ``pytest -m cuda`` over the test files that hold them (skipped, and said
   so, when pytest is not installed: the rest needs only the runtime packages);
2. **one learner against a bare PyTorch loop** on the gpu preset's model (12 x 768, context 1024,
   bytes, batch 16, bf16, fused AdamW, H = 64, P = 8, int4): ``benchmarks/throughput.py``'s (a),
   blocks interleaved, neither side compiled (compiling takes a minute of the budget and helps both
   alike); tokens/s of each and MFU (6 N + 12 L d T FLOPs per token over the chip's dense bf16
   peak, ``--peak-tflops`` for chips not in ``atoll.train.speed``'s table);
3. **4 learners sharing the GPU with the synchronizer merging on it** for ``--fleet-s`` seconds:
   the gpu preset (compile off, no periodic saves, no evaluation), the learners as processes
   (``python -m atoll.train.local learner --device cuda``), the synchronizer in this process with
   ``SynchronizerOptions(device="cuda")``; from the bucket afterwards, with atoll's own report
   functions (``atoll.runs``: ``GoodputTracker``, ``effective_h``, the wire tracker): rounds/s,
   effective H against H, goodput, merged-work share, bytes per token;
4. **evaluation and saves**: the evaluator on the GPU over the fleet's last committed model, and a
   gpu-preset learner's inner-state save (blocking, and the step's stall for a background one).

Imports torch, numpy, safetensors, fsspec and (for the table's plot-free output) nothing else of
note: no Prefect, pydantic or cloud clients on its path (tests/train/test_gpu_preset.py checks).
Writes the table to ``<out>/gpu_check.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA_TEST_FILES = ("tests/train/test_device.py",)
"""Test files holding the tests marked ``cuda`` (pytest collects only these: the rest of the suite
imports Prefect, moto and the cloud clients)."""


class Progress:
    """Progress lines with the seconds since the check started."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", flush=True)


def no_cuda_message() -> str:
    return (f"gpu check: no CUDA device on this machine (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda or 'none'}); nothing was run. Run `make gpu-check` on a GPU machine.")


# -- 1. the CUDA tests -----------------------------------------------------------------------------

def cuda_tests(say: Progress, timeout_s: float) -> str:
    if importlib.util.find_spec("pytest") is None:
        return "skipped: pytest is not installed (pip install pytest)"
    say(f"pytest -m cuda {' '.join(CUDA_TEST_FILES)}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-o", "addopts=",
           *CUDA_TEST_FILES]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else f"exit {out.returncode}"
    if out.returncode not in (0, 5):
        print(out.stdout[-4000:], out.stderr[-2000:], sep="\n", flush=True)
    return summary


# -- 2. one learner against a bare loop -----------------------------------------------------------

def learner_vs_bare(root: Path, device: torch.device, say: Progress, *, quick: bool,
                    peak: float | None) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    args = argparse.Namespace(
        hook_only=False, model="micro" if quick else "gpu", batch=4 if quick else 16,
        autocast="bf16" if device.type == "cuda" else "", fragments=8, inner_steps=64, codec="int4", save_every=0,
        warmup=2 if quick else 3, blocks=3 if quick else 5, block_steps=5 if quick else 10, corpus_mb=2.0,
        device=device, threads=1)
    say(f"learner vs bare loop: model {args.model}, batch {args.batch}, {args.blocks} blocks x {args.block_steps} steps")
    loops, params = throughput.bench_learner(root / "throughput", args, device)
    bare, learner = loops[0], loops[1]
    fpt = throughput.flops_per_token(args.model, params)
    mfu = (lambda rate: rate * fpt / (peak * 1e12)) if peak else (lambda rate: None)
    return {"params": params, "bare": bare.tokens_per_s, "learner": learner.tokens_per_s,
            "mfu_bare": mfu(bare.tokens_per_s), "mfu_learner": mfu(learner.tokens_per_s),
            "hook": loops[-1].tokens_per_s / loops[-2].tokens_per_s}


# -- 3. four learners and the synchronizer on one GPU ---------------------------------------------

def fleet_recipe(learners: int, *, quick: bool) -> tuple[Any, Any]:
    from atoll.train.recipe import DataSpec, LearnerSpec, gpu_recipe

    config, recipe = gpu_recipe(learners)
    specs = tuple(LearnerSpec(**{**vars(s), "compile": "off"}) for s in recipe.learners)
    recipe = recipe.replace(learners=specs, data=DataSpec(max_corpus_mb=8.0), max_rounds=10**6, eval_every_rounds=0,
                            save_every_steps=0)
    if quick:  # a CPU dry run of the same code paths, with rounds that come sooner
        config = config.replace(inner_steps=8)
        recipe = recipe.replace(model="micro", learners=tuple(LearnerSpec(**{**vars(s), "batch_size": 4, "autocast": ""})
                                                              for s in specs), data=DataSpec(max_corpus_mb=2.0))
    return config, recipe


def fleet(root: Path, device: torch.device, say: Progress, *, seconds: float, learners: int,
          quick: bool) -> dict[str, Any]:
    from atoll.runs.contributions import effective_h
    from atoll.runs.goodput import GoodputTracker
    from atoll.storage import RunReader, SynchronizerStore
    from atoll.storage.paths import to_url
    from atoll.train.local import LocalRun
    from atoll.train.run import create_run
    from atoll.train.sync_loop import run_synchronizer
    from atoll.train.synchronizer import SynchronizerOptions

    config, recipe = fleet_recipe(learners, quick=quick)
    url = to_url(str(root / "fleet"))
    create_run(url, config, recipe)
    say(f"fleet: {learners} learner processes on {device} + the synchronizer merging on it, {seconds:.0f} s "
        f"(H = {config.inner_steps}, P = {config.num_fragments}, {config.compression} up, "
        f"{config.downlink_compression} down); logs in {root / 'fleet-logs'}")
    run = LocalRun(url, log_dir=root / "fleet-logs", threads=2)
    for spec in recipe.learners:
        run.start_learner(spec.learner_id, "--device", str(device), "--log-every", "100")
    deadline = time.monotonic() + seconds
    last = [time.monotonic(), ""]

    def log(line: str) -> None:  # a line every ~10 s, not one per round
        last[1] = line
        if time.monotonic() - float(last[0]) >= 10:
            last[0] = time.monotonic()
            say(f"  synchronizer: {line[:150]}")

    def should_stop() -> bool:
        dead = [lid for lid, p in run.learners.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"learner(s) {dead} exited early: see {root / 'fleet-logs'}")
        return time.monotonic() > deadline

    try:
        run_synchronizer(SynchronizerStore.open(url), options=SynchronizerOptions(device=str(device)),
                         should_stop=should_stop, log=log)
    finally:
        for proc in run.learners.values():  # the measurement is over: no final saves
            run.kill(proc)
    reader = RunReader.open(url)
    latest = reader.latest_round()
    history = reader.history(1, latest) if latest else []
    tracker = GoodputTracker(reader)
    report = tracker.update()
    eff = effective_h(history[config.num_fragments:])
    span = history[-1].created_at - history[0].created_at if len(history) > 1 else 0.0
    wire = tracker.wire
    moved = wire.learners.bytes_total + wire.synchronizer.bytes_total
    return {"url": url, "latest": latest, "h": config.inner_steps, "learners": learners,
            "rounds_per_s": (len(history) - 1) / span if span > 0 else None, "eff_h": eff[0] if eff else None,
            "goodput": report.goodput, "merged_share": report.merged_share,
            "bytes_per_token": moved / wire.learner_tokens if wire.learner_tokens else None,
            "report": [report.line(), *wire.lines()]}


# -- 4. evaluation and saves ----------------------------------------------------------------------

def eval_and_save(root: Path, device: torch.device, url: str, say: Progress, *, quick: bool) -> dict[str, Any]:
    from atoll.core.config import DilocoConfig
    from atoll.storage import LearnerStore, RunReader
    from atoll.storage.paths import to_url
    from atoll.train.inner import RecipeLearner
    from atoll.train.run import create_run, make_evaluator

    out: dict[str, Any] = {}
    reader = RunReader.open(url)
    evaluator = make_evaluator(reader, device=device, autocast="bf16" if device.type == "cuda" else "")
    params = reader.read_global_state(reader.latest_round(), momentum=False).params
    say("evaluation of the fleet's latest model")
    evaluator(params)  # the first call allocates and warms the kernels
    t0 = time.perf_counter()
    out["val_loss"] = evaluator(params)
    out["eval_s"] = time.perf_counter() - t0

    config, recipe = fleet_recipe(1, quick=quick)
    config = DilocoConfig.from_dict({**config.to_dict(), "num_learners": 1})
    store = LearnerStore.beside(create_run(to_url(str(root / "save")), config, recipe))
    learner = RecipeLearner(store, "learner-0", log=lambda _: None, device=str(device), publish_in_background=True)
    for _ in range(2):
        learner.step()
    learner.flush()
    say("inner-state saves")
    t0 = time.perf_counter()
    learner.save()
    out["save_s"] = time.perf_counter() - t0
    out["save_mb"] = sum(t.numel() * t.element_size() for t in learner.weights.inner_state(learner, snapshot=False).values()) / 2**20
    t0 = time.perf_counter()
    learner.save(background=True)
    out["save_stall_s"] = time.perf_counter() - t0
    learner.flush()
    return out


# -- report ----------------------------------------------------------------------------------------

def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def table(name: str, tests: str, speed: dict[str, Any], fl: dict[str, Any], ev: dict[str, Any]) -> str:
    ratio = speed["learner"] / speed["bare"]
    rows = [
        ("device", name),
        ("CUDA tests (pytest -m cuda)", tests),
        (f"learner tokens/s vs bare loop ({speed['params'] / 1e6:.1f} M params)",
         f"{speed['learner']:,.0f} vs {speed['bare']:,.0f} ({ratio:.3f}x)"),
        ("MFU, learner / bare", f"{_num(speed['mfu_learner'], '.1%')} / {_num(speed['mfu_bare'], '.1%')}"),
        ("atoll.join hook, step time ratio", f"{speed['hook']:.3f}x the same loop without it"),
        (f"fleet: {fl['learners']} learners + synchronizer, one device", f"{fl['latest']} rounds, "
         f"{_num(fl['rounds_per_s'], '.2f', ' rounds/s')}"),
        ("effective H against H", f"{_num(fl['eff_h'], '.1f')} against {fl['h']}"),
        ("goodput / merged-work share", f"{_num(fl['goodput'], '.1%')} / {_num(fl['merged_share'], '.1%')}"),
        ("bytes per token trained (up + down)", _num(fl["bytes_per_token"], ",.2f", " B")),
        ("evaluation (eval_batches x 16 sequences)", f"{ev['eval_s']:.2f} s, loss {ev['val_loss']:.4f}"),
        (f"inner-state save ({ev['save_mb']:,.0f} MiB), blocking", f"{ev['save_s']:.2f} s"),
        ("  background save: the step waits", f"{ev['save_stall_s']:.3f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"| {'check':<{width}} | result |", f"|{'-' * (width + 2)}|--------|",
                      *(f"| {k:<{width}} | {v} |" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peak-tflops", type=float, default=None, help="the chip's dense bf16 peak (default: by GPU name)")
    p.add_argument("--fleet-s", type=float, default=75.0, help="seconds the 4-learner fleet trains")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--tests-timeout-s", type=float, default=120.0)
    p.add_argument("--cpu-dry-run", action="store_true", help="the same steps on the CPU with the micro GPT "
                   "(to check the script itself on a machine without a GPU; no claims)")
    p.add_argument("--out", default="out/gpu-check")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(no_cuda_message(), flush=True)
        return 0
    from atoll.train.speed import peak_tflops

    device = torch.device("cpu") if args.cpu_dry_run else torch.device("cuda")
    name = f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})" if device.type == "cuda" else "cpu"
    say = Progress()
    say(f"gpu check on {name}")
    peak = peak_tflops(device, args.peak_tflops)
    tests = cuda_tests(say, args.tests_timeout_s) if device.type == "cuda" else "not run (CPU dry run)"
    say(f"CUDA tests: {tests}")
    with tempfile.TemporaryDirectory(prefix="atoll-gpu-check-") as tmp:
        root = Path(tmp)
        speed = learner_vs_bare(root, device, say, quick=args.cpu_dry_run, peak=peak)
        say(f"learner {speed['learner']:,.0f} tokens/s, bare loop {speed['bare']:,.0f}")
        fl = fleet(root, device, say, seconds=args.fleet_s, learners=args.learners, quick=args.cpu_dry_run)
        for line in fl["report"]:
            say(f"  {line}")
        ev = eval_and_save(root, device, fl["url"], say, quick=args.cpu_dry_run)
    text = table(name, tests, speed, fl, ev)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text(text + "\n")
    print(f"table: {out / 'gpu_check.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
