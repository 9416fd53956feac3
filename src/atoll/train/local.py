"""Run Decoupled DiLoCo locally without Prefect: one synchronizer and M learner processes.

    python -m atoll.train.local run --preset demo --bucket ./runs/demo
    python -m atoll.train.local learner file:///abs/runs/demo --learner-id learner-2   # rejoin by hand
    python -m atoll.train.local synchronizer file:///abs/runs/demo

Every learner is its own OS process (so one can be SIGKILLed without harming the rest) and
rebuilds everything from the run URL: the recipe, config and initial state live in the bucket.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from atoll.core.fragments import FragmentGroup
from atoll.storage.learner_side import LearnerStore
from atoll.storage.paths import to_url
from atoll.storage.reader import RunReader
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.train.evaluator import Evaluator, EvaluatorOptions
from atoll.train.inner import run_learner
from atoll.train.learner import LearnerOptions
from atoll.train.recipe import RECIPE_PRESETS, Recipe
from atoll.train.run import create_run, load_recipe
from atoll.train.speed import PEAK_TFLOPS_ENV
from atoll.train.sync_loop import run_synchronizer
from atoll.train.synchronizer import SynchronizerOptions

__all__ = ["LearnerRestarts", "LocalRun", "main"]


class LocalRun:
    """Start/stop/kill the processes of a local run (used by the CLI, tests and benchmarks)."""

    def __init__(self, url: str, *, log_dir: str | os.PathLike[str] | None = None, threads: int = 1,
                 extra_env: Mapping[str, str] | None = None) -> None:
        self.url = url
        self.log_dir = Path(log_dir) if log_dir else None
        self.threads = threads
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        self.learners: dict[str, subprocess.Popen[bytes]] = {}
        self.synchronizer: subprocess.Popen[bytes] | None = None

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "atoll.train.local", *args]
        if not self.log_dir:
            return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=self.env)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as out:  # the child keeps its own copy of the fd
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def start_learner(self, learner_id: str, *extra: str) -> subprocess.Popen[bytes]:
        proc = self._spawn(["learner", self.url, "--learner-id", learner_id, "--threads", str(self.threads), *extra],
                           learner_id)
        self.learners[learner_id] = proc
        return proc

    def start_learners(self, recipe: Recipe) -> None:
        """One process per learner of the recipe."""
        for spec in recipe.learners:
            self.start_learner(spec.learner_id)

    def start_synchronizer(self, *extra: str) -> subprocess.Popen[bytes]:
        self.synchronizer = self._spawn(["synchronizer", self.url, "--threads", str(self.threads), *extra],
                                        "synchronizer")
        return self.synchronizer

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL: no cleanup hook runs, exactly like a lost spot instance."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        procs = [*self.learners.values(), *([self.synchronizer] if self.synchronizer else [])]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def _terminate_gracefully() -> Callable[[], bool]:
    """SIGTERM sets a flag the loops poll, so a terminated learner still saves its state."""
    flag = {"stop": False}

    def handler(signum: int, frame: Any) -> None:
        flag["stop"] = True

    signal.signal(signal.SIGTERM, handler)
    return lambda: flag["stop"]


def _cmd_learner(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    store = LearnerStore.open(args.url)
    options = LearnerOptions(log_every_steps=args.log_every, max_steps=args.max_steps,
                             poll_interval_s=args.poll_interval_s, heartbeat_interval_s=args.heartbeat_interval_s,
                             orphan_timeout_s=args.orphan_timeout_s or None, device=args.device,
                             autocast=args.autocast, threads=args.threads or None)
    if load_recipe(store).learner(args.learner_id)[1].ranks > 1:  # an island: N ranks, DDP
        from atoll.train.island import run_island

        summary = run_island(store, args.learner_id, options=options, log=lambda s: print(s, flush=True))
    else:
        # Each process takes the learner's next lease (a restarted one fences its predecessor) and
        # handles SIGTERM itself: it finishes the step, saves its state and exits 0.
        summary = run_learner(store, args.learner_id, log=lambda s: print(s, flush=True), options=options)
    print(f"exit_reason={summary.exit_reason}", flush=True)
    return 0


def _cmd_synchronizer(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    store = SynchronizerStore.open(args.url)
    group = FragmentGroup.parse(args.group)
    opts = SynchronizerOptions(poll_interval_s=args.poll_interval_s, device=args.device or "cpu",
                               fragment_group=group, peer_timeout_s=args.peer_timeout_s,
                               synchronizer_id="synchronizer" if group.whole else f"synchronizer/{group.index}of{group.count}")
    log = lambda s: print(s, flush=True)  # noqa: E731
    # One evaluator per run: a split synchronizer's first merger runs it (it reads committed state).
    evaluator = _evaluator(store, args.eval_device, log) if group.index == 0 else None
    run_synchronizer(store, options=opts, evaluator=evaluator, should_stop=_terminate_gracefully(), log=log)
    return 0


def _evaluator(store: SynchronizerStore, device: str, log: Callable[[str], None]) -> Evaluator | None:
    """The synchronizer's evaluator thread on ``device`` (None for 'off')."""
    options = EvaluatorOptions(device=device)
    return Evaluator(store, options=options, log=log) if options.enabled else None


class LearnerRestarts:
    """Restart the learner processes of a :class:`LocalRun` that exited before the run finished.

    A restarted learner rejoins from the bucket. One that keeps dying is restarted with a doubling
    back-off (1, 2, 4 ... 60 s between restarts), so a learner that cannot start does not spin.
    """

    def __init__(self, run: LocalRun, *, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda s: print(s, flush=True)) -> None:
        self.run, self.clock, self.log = run, clock, log
        self.restarts: dict[str, int] = {}
        self._not_before: dict[str, float] = {}

    def dead_learners(self) -> list[str]:
        """Restart every learner process that has exited (when its back-off allows); returns their ids."""
        now = self.clock()
        restarted = []
        for lid, proc in list(self.run.learners.items()):
            if proc.poll() is None or now < self._not_before.get(lid, 0.0):
                continue
            n = self.restarts[lid] = self.restarts.get(lid, 0) + 1
            self._not_before[lid] = now + min(60.0, 2.0 ** (n - 1))
            self.log(f"{lid} exited with {proc.returncode}; restarting it (it rejoins from the bucket)")
            self.run.start_learner(lid)
            restarted.append(lid)
        return restarted


def _cmd_run(args: argparse.Namespace) -> int:
    config, recipe = RECIPE_PRESETS[args.preset](args.learners) if args.learners else RECIPE_PRESETS[args.preset]()
    if args.rounds:
        recipe = recipe.replace(max_rounds=args.rounds)
    url = to_url(args.bucket)
    store = RunReader.open(url)
    if store.exists():
        print(f"resuming run at {url} from round {store.latest_round()}")
    else:
        print(f"creating run at {url}: {config.num_learners} learners, P={config.num_fragments}, "
              f"H={config.inner_steps}, K={config.min_quorum}, {recipe.max_rounds} rounds")
        store = create_run(url, config, recipe)
    recipe = load_recipe(store)
    log_dir = Path(args.log_dir) if args.log_dir else (Path(url[len("file://"):]) / "logs" if url.startswith("file://") else None)
    stop_requested = _terminate_gracefully()  # SIGTERM: stop the synchronizer, then the learners
    with LocalRun(url, log_dir=log_dir, threads=1) as run:
        run.start_learners(recipe)
        print(f"started {len(recipe.learners)} learner processes (logs in {log_dir})")
        t0 = time.monotonic()
        restart = LearnerRestarts(run)

        def should_stop() -> bool:
            # Checked on every poll of the open round, not only when a round commits: with K = M
            # no round can commit while a learner is dead, so waiting for one would wait forever.
            if stop_requested():
                return True
            restart.dead_learners()
            return False

        sync = SynchronizerStore.open(url)
        log = lambda s: print(f"[{time.monotonic() - t0:6.1f}s] {s}", flush=True)  # noqa: E731
        last = run_synchronizer(sync, evaluator=_evaluator(sync, args.eval_device, log), should_stop=should_stop,
                                log=log)
    final, measured = sync.read_commit(last), sync.read_eval(last) if last else None
    loss = measured.val_loss if measured is not None else final.stats.get("val_loss") if final else None
    print(f"done: {last} rounds in {time.monotonic() - t0:.0f}s; final validation loss {loss}; bucket {url}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atoll.train.local", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="create (or resume) a run and train it with local processes")
    r.add_argument("--preset", default="demo", choices=sorted(RECIPE_PRESETS))
    r.add_argument("--bucket", default="./runs/demo", help="folder or fsspec URL of the run")
    r.add_argument("--learners", type=int, default=0, help="number of learners (default: the preset's)")
    r.add_argument("--rounds", type=int, default=0, help="outer rounds (default: the preset's)")
    r.add_argument("--log-dir", default=None)
    r.add_argument("--eval-device", default="auto",
                   help="the evaluator thread's device: auto (CUDA if present, else CPU), cpu, cuda[:N], mps, off")
    r.add_argument("--peak-tflops", type=float, default=None,
                   help="the chips' dense bf16 peak, for MFU in learner progress lines (default: by GPU name)")
    r.set_defaults(fn=_cmd_run)
    for name, fn in (("learner", _cmd_learner), ("synchronizer", _cmd_synchronizer)):
        s = sub.add_parser(name)
        s.add_argument("url")
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--poll-interval-s", type=float, default=0.1)
        s.add_argument("--device", default=None,
                       help="auto, cpu, cuda[:N], mps (learner default: the recipe's; synchronizer: cpu)")
        if name == "synchronizer":
            s.add_argument("--eval-device", default="auto",
                           help="the evaluator thread's device: auto, cpu, cuda[:N], mps, off")
            s.add_argument("--group", default="0/1",
                           help="INDEX/COUNT: merge only fragment group INDEX of COUNT, as one merger of a split "
                                "synchronizer (start one process per group; default 0/1: every fragment)")
            s.add_argument("--peer-timeout-s", type=float, default=30.0,
                           help="a split synchronizer: commit another group's round as empty once its merger "
                                "showed no sign of life for this long")
        if name == "learner":
            s.add_argument("--learner-id", required=True)
            s.add_argument("--log-every", type=int, default=20)
            s.add_argument("--max-steps", type=int, default=None)
            s.add_argument("--heartbeat-interval-s", type=float, default=5.0)
            s.add_argument("--orphan-timeout-s", type=float, default=900.0, help="0: never")
            s.add_argument("--autocast", default=None, help="'' or bf16 (default: the recipe's)")
            s.add_argument("--peak-tflops", type=float, default=None,
                           help="the chip's dense bf16 peak, for MFU in progress lines (default: by GPU name)")
        s.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    if getattr(args, "peak_tflops", None):  # learner processes inherit it (atoll.train.speed)
        os.environ[PEAK_TFLOPS_ENV] = str(args.peak_tflops)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
