"""Synchronizer throughput: how fast atoll's real synchronizer commits rounds at real model sizes.

    python benchmarks/sync_throughput.py [--quick] [--sizes 10M,86M,350M,1B] [--fragments 8,24]
        [--learners 4,8] [--codecs int4,fp32] [--rounds 5] [--emulate-s 60] [--step-ms 60] [--s3]
        [--out out/bench/sync_throughput]

No GPU and no training: an **emulated fleet** of M replay learners publishes real-sized
contributions (random deltas of the fragment's exact shapes, in the run's uplink codec, counters of
H steps of ``batch x context`` tokens at the learner step time) through ``LearnerStore``, against the
real :class:`~atoll.train.synchronizer.Synchronizer` on a real store (a local folder, or moto's S3
server with ``--s3``). The models are GPTs on bytes (atoll.train.model's shapes, built on the meta
device and filled with random values, never run): 10.9 M (``mini``), 86 M (``small`` on bytes:
12 x 768), 354 M (28 x 1024) and 1.01 B (20 x 2048). H = P, tau = 2, K = 1 + grace, RDA, Nesterov
0.7 / 0.9 (the paper's), with int4 both ways (the demo's codecs) or fp32 both ways (core's default).

Per configuration, three measurements on one run:

* **Rounds with their inputs ready**: before each round the fleet publishes its M contributions
  to the round's fragment (not timed); the synchronizer then polls, merges, takes the outer step
  and commits (timed: wall seconds, CPU seconds of the process, and the requests and bytes its
  store sent, counted by the store itself: ``atoll.storage.wire``). Right after, the **I/O lower
  bound** of that round on the same store, with plain fsspec calls: read the M payloads the round
  merged and write what the round must write (one fp32 fragment, plus the compressed downlink
  update when the downlink is compressed), and its **arithmetic floor** (``round_floor.py``: the
  hashing, decoding, merging, outer step and downlink encode any round must do, timed with bare
  torch on memory already mapped; on a CPU machine it, not the I/O, bounds a round). The first
  round warms up (allocations, page faults) and is left out of the medians; sustained rounds/s =
  measured rounds / their summed wall time.
* **Rounds back to back**: the fleet publishes the inputs of P rounds (one per fragment) first,
  then the synchronizer runs them one after another (``Synchronizer.tick``: each commit before the
  next round opens) and then P more pipelined (``Synchronizer.step``, what ``run_synchronizer``
  runs: a round's payloads and record are written while the next round polls and merges,
  :mod:`atoll.train.commit_pipeline`); seconds per round of each (``seq s/r``, ``piped s/r``).
* **An emulated run**: for ``--emulate-s`` seconds the replay learners step on a clock of
  ``--step-ms`` per inner step (GPU-like, 60 ms), publish each fragment when the schedule says
  (t mod H = t_p, backing off as atoll's learner does when the base does not move), adopt every
  new version they see (resetting that fragment's counters; they never download it), while
  :func:`~atoll.train.sync_loop.run_synchronizer` runs its loop. Effective H is what
  ``atoll status`` reports (:func:`atoll.runs.contributions.effective_h`: inner steps per merged
  contribution), over the rounds after the first pass over the fragments. A synchronizer that
  keeps up needs P / (H x step) rounds per second.

Prints progress while it works, a table at the end, and writes ``sync_throughput.png`` (round time
against parameters, one line per configuration, dashed: its I/O bound, dash-dot: that bound plus
the arithmetic floor) and ``sync_throughput.json``
under ``--out``. A size whose estimated memory does not fit the machine is skipped, with a message.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
import torch

from atoll.core.compress import EncodedTensor, encode
from atoll.core.config import DilocoConfig
from atoll.core.weights import Counters
from atoll.runs.contributions import effective_h
from atoll.storage import LearnerStore, RunReader, SynchronizerStore, paths
from atoll.storage.records import ContributionRecord
from atoll.storage.wire import WireCounts
from atoll.train.learner import publish_due
from atoll.train.model import GPT, GPTConfig, micro, mini, small
from atoll.train.recipe import DataSpec, LearnerSpec, Recipe
from atoll.train.run import create_run
from atoll.train.sync_loop import run_synchronizer
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_floor import ArithmeticFloor  # noqa: E402 - beside this script

SIZES: dict[str, GPTConfig] = {
    "0.1M": micro(),  # the unit test's size
    "10M": mini(),
    "86M": small(vocab_size=256, tie_embeddings=False),
    "350M": small(vocab_size=256, tie_embeddings=False, num_layers=28, embed_dim=1024, num_heads=16),
    "1B": small(vocab_size=256, tie_embeddings=False, num_layers=20, embed_dim=2048, num_heads=16,
                context_tokens=2048),
}
"""GPTs on bytes, by their rounded parameter count."""

BATCH = 8
"""Sequences per learner step: a contribution's tokens are c_steps x BATCH x context."""

POLL_INTERVAL_S = 0.1
"""The synchronizer's longest sleep between polls (``python -m atoll.train.local synchronizer``'s default)."""

DELTA_SCALE = 1e-3
"""Size of the replay deltas' values (the weights are ~0.02): small enough for no outlier guard to refuse them."""

BUCKET = "atoll-sync-throughput"
MOTO_S3 = Path(__file__).resolve().parents[1] / "tests" / "moto_s3.py"


# -- progress ---------------------------------------------------------------------------------------

class Progress:
    """Timestamped lines; while a long step runs, a line every ``every_s`` says it is still running."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.t0 = time.monotonic()
        self.every_s = every_s
        self._phase = ""
        self._since = self._last = self.t0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def say(self, text: str) -> None:
        with self._lock:
            self._last = time.monotonic()
            print(f"[{self._last - self.t0:7.1f}s] {text}", flush=True)

    @contextmanager
    def phase(self, text: str) -> Iterator[None]:
        self.say(text)
        self.doing(text)
        try:
            yield
        finally:
            self.doing("")

    def doing(self, text: str) -> None:
        """What a line saying it is still running names (nothing printed now)."""
        with self._lock:
            self._phase, self._since = text, time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                quiet = time.monotonic() - self._last >= self.every_s
                phase, since = self._phase, self._since
            if quiet:
                self.say(f"  ... still {phase or 'working'} ({time.monotonic() - since:.0f} s)")

    def close(self) -> None:
        self._stop.set()


# -- the run: config, recipe, version-0 weights ---------------------------------------------------

@dataclass(frozen=True)
class Setup:
    size: str
    fragments: int
    learners: int
    codec: str
    masters: int = 1
    """``DilocoConfig.master_snapshot_every``: above 2, masters written on 2 versions out of this many."""
    pacing: float = 0.0
    """``DilocoConfig.round_pacing``: above 0, a round waits for that share of H steps of new work per learner."""

    @property
    def name(self) -> str:
        return f"{self.size} P={self.fragments} M={self.learners} {self.codec}" + (
            f" m{self.masters}" if self.masters > 2 else "") + (f" paced{self.pacing:g}" if self.pacing else "")


def random_model(cfg: GPTConfig, seed: int = 0) -> torch.nn.Module:
    """A GPT of ``cfg``'s shapes with random values: built on the meta device (no init pass), then
    given memory and filled once (a 1 B model is one 4 GB allocation, nothing more)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return model


def parameter_count(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def run_config(setup: Setup) -> tuple[DilocoConfig, Recipe]:
    codec = setup.codec
    config = DilocoConfig(num_learners=setup.learners, num_fragments=setup.fragments, inner_steps=setup.fragments,
                          overlap_steps=2, min_quorum=1, compression=codec,  # type: ignore[arg-type]
                          downlink_compression=codec, master_snapshot_every=setup.masters,  # type: ignore[arg-type]
                          round_pacing=setup.pacing)
    recipe = Recipe(
        model=SIZES[setup.size].to_dict(), data=DataSpec(max_corpus_mb=1.0),
        learners=tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=BATCH) for i in range(setup.learners)),
        max_rounds=10**9, eval_every_rounds=0, eval_batches=0, checkpoint_every_rounds=0,
    )
    return config, recipe


def tokens_per_step(setup: Setup) -> int:
    return BATCH * SIZES[setup.size].context_tokens


# -- the fleet --------------------------------------------------------------------------------------

class DeltaBank:
    """Every learner's delta for fragment p, already in the run's uplink codec: views of one random
    fp32 buffer the size of the largest fragment (so fp32 deltas cost no more memory than that),
    encoded once per fragment (int4: the codes and scales, ~0.6 bytes per parameter). Every learner
    sends the same values: what a round costs does not depend on them."""

    def __init__(self, store: RunReader, keep: bool) -> None:
        self.store, self.keep = store, keep
        plan = store.plan
        numel = max(plan.fragment_numel(p) for p in range(plan.num_fragments))
        self.flat = torch.randn(numel, generator=torch.Generator().manual_seed(1)).mul_(DELTA_SCALE)
        self._cache: dict[int, dict[str, EncodedTensor]] = {}

    def delta(self, p: int) -> dict[str, EncodedTensor]:
        got = self._cache.get(p)
        if got is not None:
            return got
        config, offset = self.store.config, 0
        out: dict[str, EncodedTensor] = {}
        for name, shape in self.store.manifest.fragment_shapes(p).items():
            n = math.prod(shape)
            out[name] = encode(self.flat[offset:offset + n].view(shape), config.compression,
                               block_size=config.compression_block_size, copy=False)
            offset += n
        if not self.keep:
            self._cache.clear()
        self._cache[p] = out
        return out


def fleet_handles(store: SynchronizerStore, learners: int) -> list[LearnerStore]:
    """One handle per learner, each counting its own traffic (never the synchronizer's)."""
    return [LearnerStore.beside(store.sibling(metered_apart=True)) for _ in range(learners)]


def publish_round(handles: list[LearnerStore], bank: DeltaBank, p: int, base: int, setup: Setup,
                  step_s: float) -> dict[str, ContributionRecord]:
    """Each learner's contribution to fragment ``p``: H steps since it adopted version ``base``."""
    steps = setup.fragments
    out = {}
    for i, h in enumerate(handles):
        counters = Counters(c_steps=steps, c_tokens=steps * tokens_per_step(setup))
        rec = h.publish_contribution(f"learner-{i}", p, base, counters, bank.delta(p),
                                     info={"step_time_s": step_s, "pool": "replay"})
        out[rec.key] = rec
    return out


# -- rounds with their inputs ready ---------------------------------------------------------------

def release_memory() -> None:
    """Collect garbage and hand the freed heap back to the system (glibc's ``malloc_trim``): each
    phase builds its own synchronizer, and glibc keeps the freed memory of the last one in its
    per-thread arenas, which at 1 B parameters is enough to run the next phase out of memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def rss_gb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def io_bound_s(store: SynchronizerStore, inputs: list[ContributionRecord], writes: list[bytes | memoryview],
               repeats: int = 3) -> float:
    """Seconds to read the round's input payloads and write ``writes``, with plain fsspec calls on
    the synchronizer's own filesystem: the reads at once, then the writes at once (a round can
    only write once it has read). The median of ``repeats``: one stall of a shared disk's
    write-back would otherwise set it."""
    obj = store.store
    fs = obj.fs
    sources = [obj.path(paths.blob_key(r.payload.sha256, r.learner_id)) for r in inputs]
    times = []
    with ThreadPoolExecutor(max_workers=16) as pool:
        for _ in range(repeats):
            scratch = [obj.path(f"bench-io/{uuid.uuid4().hex}") for _ in writes]
            t0 = time.perf_counter()
            got = list(pool.map(fs.cat_file, sources))
            list(pool.map(fs.pipe_file, scratch, writes))
            times.append(time.perf_counter() - t0)
            assert [len(b) for b in got] == [r.payload.nbytes for r in inputs]
            del got
            for path in scratch:
                fs.rm_file(path)
    return statistics.median(times)


@dataclass
class RoundRow:
    round: int
    fragment: int
    wall_s: float
    cpu_s: float
    wire: WireCounts
    io_bound_s: float
    arith_s: float
    """The round's arithmetic floor (``round_floor.ArithmeticFloor``) at its fragment's size."""
    polls: int
    merged: int
    merge_s: float
    """From the closing poll to the merged fragment: list, read and decode the payloads, merge, outer step."""
    commit_s: float
    """From the merged fragment to the commit: the downlink update, the state objects, the commit record."""

    def to_dict(self) -> dict[str, Any]:
        w = self.wire
        return {"round": self.round, "fragment": self.fragment, "wall_s": round(self.wall_s, 6),
                "cpu_s": round(self.cpu_s, 6), "polls": self.polls, "merged": self.merged,
                "merge_s": round(self.merge_s, 4), "commit_s": round(self.commit_s, 4),
                "requests_read": w.gets + w.heads + w.lists, "requests_written": w.puts + w.deletes,
                "bytes_read": w.bytes_down, "bytes_written": w.bytes_up, "wire": w.to_dict(),
                "io_bound_s": round(self.io_bound_s, 6), "ratio": round(self.wall_s / self.io_bound_s, 2),
                "arith_s": round(self.arith_s, 6),
                "floor_ratio": round(self.wall_s / (self.io_bound_s + self.arith_s), 2)}


def one_round(sync: Synchronizer) -> tuple[RoundSummary, int]:
    """Tick until the open round commits; (its summary, polls it took)."""
    polls = 0
    while True:
        out = sync.tick()
        polls += 1
        if isinstance(out, RoundSummary):
            return out, polls
        time.sleep(min(max((out.recheck_at_s or 0) - sync.clock(), 0.005), POLL_INTERVAL_S))


def measure_rounds(url: str, options: Mapping[str, Any] | None, setup: Setup, rounds: int, step_s: float,
                   progress: Progress) -> tuple[list[RoundRow], float]:
    """``rounds`` rounds, each with the fleet's M contributions published before it opens."""
    store = SynchronizerStore.open(url, options)
    with progress.phase(f"{setup.name}: the synchronizer reads the global state"):
        sync = Synchronizer(store, options=SynchronizerOptions(poll_interval_s=POLL_INTERVAL_S))
    bank = DeltaBank(store, keep=False)
    fleet = fleet_handles(store, setup.learners)
    plan = store.plan
    most = max(plan.fragment_numel(p) for p in range(plan.num_fragments))
    junk = memoryview(numpy.random.default_rng(0).bytes(4 * most))  # the I/O bound's writes: prefixes of it
    config = store.config
    floor = ArithmeticFloor(most, setup.learners, config.compression, config.downlink_compression,
                            config.outer_momentum, config.compression_block_size)
    rows, peak = [], rss_gb()
    for _ in range(rounds):
        r = sync.round + 1
        p = sync.fragment_of_round(r)
        progress.doing(f"{setup.name}: round {r}: the fleet publishes, the synchronizer merges and commits")
        published = publish_round(fleet, bank, p, sync.versions[p], setup, step_s)
        gc.collect()
        w0, c0, t0 = store.store.wire_counts(), time.process_time(), time.perf_counter()
        summary, polls = one_round(sync)
        wall, cpu, wire = time.perf_counter() - t0, time.process_time() - c0, store.store.wire_counts() - w0
        record = summary.record
        assert summary.won and record.updated, f"round {r} did not merge: {summary.line()}"
        inputs = [published[a.key] for a in record.accepted]
        # What the round must write: the master where its version writes one (every version, or
        # 2 out of every master_snapshot_every), and the learners' update.
        sizes = [4 * plan.fragment_numel(p)] if record.state[p].master_written else []
        if setup.codec != "fp32":  # learners read the compressed update; the fp32 master is the resume truth
            sizes.append(int(record.stats["bytes_out_per_learner"]))
        bound = io_bound_s(store, inputs, [junk[:n] if store.store.is_local else bytes(junk[:n]) for n in sizes])
        phases = summary.info["phases"]
        row = RoundRow(r, p, wall, cpu, wire, bound, floor.seconds(plan.fragment_numel(p)), polls, len(record.accepted),
                       merge_s=phases["merged_at_s"] - phases["closed_at_s"],
                       commit_s=phases["committed_at_s"] - phases["merged_at_s"])
        rows.append(row)
        peak = max(peak, rss_gb())
        progress.doing("")
        progress.say(f"{setup.name}: round {r} (fragment {p}, {plan.fragment_numel(p) / 1e6:.1f} M params, "
                     f"{len(inputs)} merged): {wall:.3f} s (merge {row.merge_s:.3f}, commit {row.commit_s:.3f}), "
                     f"CPU {cpu:.2f} s, {wire.line()}; I/O bound {bound:.3f} s ({wall / bound:.1f}x), "
                     f"arithmetic floor {row.arith_s:.3f} s ({wall / (bound + row.arith_s):.1f}x both)")
    return rows, peak


def back_to_back_s(sync: Synchronizer, fleet: list[LearnerStore], bank: DeltaBank, setup: Setup, step_s: float,
                   pipelined: bool) -> float:
    """Seconds per round of P rounds in a row (one per fragment) whose inputs are all published
    first (not timed): one round after another (``Synchronizer.tick``), or pipelined
    (``Synchronizer.step``: a round's commit overlaps the next round's poll and merge)."""
    first, n = sync.round + 1, sync.plan.num_fragments
    for r in range(first, first + n):
        p = sync.fragment_of_round(r)
        publish_round(fleet, bank, p, sync.versions[p], setup, step_s)
    gc.collect()
    t0 = time.perf_counter()
    while sync.round < first + n - 1:
        if pipelined:
            _, decision = sync.step()
        else:
            out = sync.tick()
            decision = None if isinstance(out, RoundSummary) else out
        if decision is not None:
            time.sleep(min(max((decision.recheck_at_s or 0) - sync.clock(), 0.005), POLL_INTERVAL_S))
    sync.drain()
    return (time.perf_counter() - t0) / n


def measure_back_to_back(url: str, options: Mapping[str, Any] | None, setup: Setup, step_s: float,
                         progress: Progress) -> dict[str, float]:
    """:func:`back_to_back_s` one round after another, then pipelined, on one synchronizer."""
    store = SynchronizerStore.open(url, options)
    sync = Synchronizer(store, options=SynchronizerOptions(poll_interval_s=POLL_INTERVAL_S))
    bank, fleet = DeltaBank(store, keep=False), fleet_handles(store, setup.learners)
    try:
        with progress.phase(f"{setup.name}: {setup.fragments} rounds back to back, one after another"):
            sequential = back_to_back_s(sync, fleet, bank, setup, step_s, pipelined=False)
        with progress.phase(f"{setup.name}: {setup.fragments} rounds back to back, pipelined"):
            pipelined = back_to_back_s(sync, fleet, bank, setup, step_s, pipelined=True)
    finally:
        sync.shutdown()
    progress.say(f"{setup.name}: back to back: {sequential:.3f} s per round one after another, "
                 f"{pipelined:.3f} s pipelined ({sequential / pipelined:.2f}x)")
    return {"sequential_round_s": round(sequential, 4), "pipelined_round_s": round(pipelined, 4)}


# -- an emulated run at a GPU-like step time ------------------------------------------------------

class CommitWatch:
    """What the fleet sees of the global versions: one thread polls the commits every step, as each
    learner would (a real learner polls on its own; one poll here keeps the emulation light)."""

    def __init__(self, store: RunReader, step_s: float) -> None:
        self.store, self.step_s = store, step_s
        self.round = store.latest_round()
        rec = store.read_commit(self.round) if self.round else None
        self.versions: tuple[int, ...] = rec.versions if rec else (0,) * store.plan.num_fragments
        self.stop = threading.Event()
        self.cpu_s = 0.0

    def run(self) -> None:
        c0 = time.thread_time()
        while not self.stop.wait(self.step_s):
            for rec in self.store.poll_commits(self.round):
                self.round, self.versions = rec.round, rec.versions
        self.cpu_s = time.thread_time() - c0


@dataclass
class ReplayLearner:
    """One learner that never trains: it steps on the clock, publishes each fragment when the
    schedule says (atoll's learner's back-off included) and adopts each new version it sees."""

    index: int
    store: LearnerStore
    bank: DeltaBank
    watch: CommitWatch
    setup: Setup
    step_s: float
    publishes: int = 0
    late: int = 0
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0

    def run(self, t0: float, until: float) -> None:
        c0 = time.thread_time()
        plan, h = self.store.plan, self.setup.fragments
        version = list(self.watch.versions)
        aligned = [0] * plan.num_fragments  # the step at which each fragment was last adopted
        done = 0
        start = t0 + self.index * self.step_s / self.setup.learners  # learners out of phase
        while (due_t := start + (done + 1) * self.step_s) < until:
            time.sleep(max(0.0, due_t - time.monotonic()))
            step = int((time.monotonic() - start) / self.step_s)  # a GPU does not wait for a publish
            for p, v in enumerate(self.watch.versions):
                if v > version[p]:
                    version[p], aligned[p] = v, step
            due = {p: s for s in range(done + 1, step + 1) if (p := plan.fragment_at(s)) is not None}
            for p, s in due.items():
                c_steps = s - aligned[p]
                if c_steps > 0 and publish_due(c_steps, h):
                    self._publish(p, version[p], c_steps)
                    self.late += time.monotonic() - (start + s * self.step_s) > self.step_s
            done = step
        self.cpu_s = time.thread_time() - c0

    def _publish(self, p: int, base: int, c_steps: int) -> None:
        try:
            counters = Counters(c_steps=c_steps, c_tokens=c_steps * tokens_per_step(self.setup))
            self.store.publish_contribution(f"learner-{self.index}", p, base, counters, self.bank.delta(p),
                                            info={"step_time_s": self.step_s, "pool": "replay"})
            self.publishes += 1
        except Exception as e:  # noqa: BLE001 - reported in the row, the emulation goes on
            self.errors.append(f"{type(e).__name__}: {e}")


def emulate(url: str, options: Mapping[str, Any] | None, setup: Setup, seconds: float, step_s: float,
            progress: Progress) -> dict[str, Any]:
    """The fleet on its clock for ``seconds`` while ``run_synchronizer`` runs its loop."""
    store = SynchronizerStore.open(url, options)
    first = store.latest_round()
    bank = DeltaBank(store, keep=True)
    for p in range(store.plan.num_fragments):
        bank.delta(p)  # encoded before the clock starts, as a GPU learner's delta is ready at its step
    watch = CommitWatch(RunReader.beside(store.sibling(metered_apart=True)), step_s)
    handles = fleet_handles(store, setup.learners)
    learners = [ReplayLearner(i, h, bank, watch, setup, step_s) for i, h in enumerate(handles)]
    lines = {"n": 0, "at": 0.0}

    def log(line: str) -> None:  # a round line at most every 5 s
        lines["n"] += line.startswith("round")
        if not line.startswith("round") or time.monotonic() - lines["at"] >= 5.0:
            lines["at"] = time.monotonic()
            progress.say(f"{setup.name}: emulated fleet: {line.strip()}")

    clock: dict[str, float] = {}
    started = threading.Event()

    def should_stop() -> bool:
        # First called once the loop runs (state read, lease taken): the fleet's clock starts here.
        if not started.is_set():
            clock["c0"], clock["t0"] = time.process_time(), time.monotonic()
            clock["until"] = clock["t0"] + seconds
            started.set()
        return time.monotonic() >= clock["until"]

    def learner(lr: ReplayLearner) -> None:
        started.wait()
        lr.run(clock["t0"], clock["until"])

    threads = [threading.Thread(target=learner, args=(lr,), daemon=True) for lr in learners]
    threads.append(threading.Thread(target=lambda: started.wait() and watch.run(), daemon=True))
    for t in threads:
        t.start()
    try:
        last = run_synchronizer(store, options=SynchronizerOptions(poll_interval_s=POLL_INTERVAL_S),
                                should_stop=should_stop, log=log)
    finally:
        if not started.is_set():  # the loop failed before it ran: the fleet does not start
            clock.update(c0=time.process_time(), t0=time.monotonic(), until=time.monotonic())
            started.set()
        watch.stop.set()
        for t in threads:
            t.join()
    cpu = time.process_time() - clock["c0"]
    return emulated_figures(store, setup, first, last, seconds, step_s, learners, watch, cpu)


def emulated_figures(store: RunReader, setup: Setup, first: int, last: int, seconds: float, step_s: float,
                     learners: list[ReplayLearner], watch: CommitWatch, cpu_s: float) -> dict[str, Any]:
    records = store.history(first + 1, last) if last > first else []
    steady = records[setup.fragments:] if len(records) > setup.fragments else records
    eff = effective_h(steady)
    fleet_cpu = sum(lr.cpu_s for lr in learners) + watch.cpu_s
    publishes = sum(lr.publishes for lr in learners)
    return {
        "seconds": seconds, "step_ms": step_s * 1e3, "rounds": len(records),
        "rounds_per_s": len(records) / seconds,
        "needed_rounds_per_s": setup.fragments / (store.config.inner_steps * step_s),  # P rounds per H steps
        "effective_h": None if eff is None else round(eff[0], 2), "effective_h_rounds": len(steady),
        "effective_h_after_first_pass": len(records) > setup.fragments,
        "merged_per_round": (sum(len(r.accepted) for r in records) / len(records)) if records else 0.0,
        "publishes": publishes, "late_publishes": sum(lr.late for lr in learners),
        "publish_errors": [e for lr in learners for e in lr.errors][:5],
        "synchronizer_cores": max(0.0, cpu_s - fleet_cpu) / seconds, "fleet_cores": fleet_cpu / seconds,
    }


# -- one configuration ------------------------------------------------------------------------------

def available_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def estimated_gb(setup: Setup, params: int, s3: bool) -> float:
    """Peak memory of a configuration: the synchronizer's state (the fp32 master, its momentum at
    the paper's outer momentum, with a compressed downlink the learners' view, with masters by
    replay each fragment's previous version: 4 bytes a parameter each), a round's working set
    (decoded deltas, payloads, merge buffers, the new version, momentum and spares: about 2M + 10
    fragments), the arithmetic floor's buffers (M + 5 fragments), the fleet's encoded deltas; moto
    keeps every object in memory too (the version-0 weights, then each round's objects)."""
    fragment = 4 * params / setup.fragments
    copies = 2 + (setup.codec != "fp32") + (setup.masters > 2)
    fleet = 4 * params * (0.16 if setup.codec == "int4" else 0.0) + fragment
    moto = 4 * params * 2 if s3 else 0.0
    floor = fragment * (setup.learners + 5)
    return (4 * params * copies + fragment * (2 * setup.learners + 10) + fleet + moto + floor) / 2**30


def measure(setup: Setup, args: argparse.Namespace, root: str, options: Mapping[str, Any] | None,
            progress: Progress) -> dict[str, Any]:
    params = parameter_count(SIZES[setup.size])
    row: dict[str, Any] = {"config": setup.name, "size": setup.size, "params": params, "fragments": setup.fragments,
                           "learners": setup.learners, "codec": setup.codec, "store": "s3" if options else "local"}
    need, have = estimated_gb(setup, params, bool(options)), available_gb()
    if need > 0.85 * have:  # the rest is for everything else on the machine
        row["skipped"] = f"needs ~{need:.1f} GB of memory, {have:.1f} GB available"
        progress.say(f"{setup.name}: skipped: {row['skipped']}")
        return row
    url = f"{root}/{setup.size}-p{setup.fragments}-m{setup.learners}-{setup.codec}-k{setup.masters}-{uuid.uuid4().hex[:6]}"
    step_s = args.step_ms / 1e3
    try:
        with progress.phase(f"{setup.name}: creating the run ({params / 1e6:.1f} M parameters, "
                            f"{4 * params / 1e9:.2f} GB of version-0 weights)"):
            config, recipe = run_config(setup)
            model = random_model(SIZES[setup.size])
            create_run(url, config, recipe, model=model, storage_options=options)
            del model
            release_memory()
        if setup.masters > 2:  # measure past the first pass, whose versions all write their master (depth 1)
            measure_rounds(url, options, setup, setup.fragments, step_s, progress)
            release_memory()
        rounds, peak = measure_rounds(url, options, setup, args.rounds, step_s, progress)
        row.update(summarize(rounds))
        row["rss_gb"] = round(peak, 2)
        release_memory()
        row["back_to_back"] = measure_back_to_back(url, options, setup, step_s, progress)
        release_memory()
        if args.emulate_s > 0:
            with progress.phase(f"{setup.name}: emulated fleet, {args.emulate_s:g} s at {args.step_ms:g} ms per step"):
                row["emulated"] = emulate(url, options, setup, args.emulate_s, step_s, progress)
            e = row["emulated"]
            progress.say(f"{setup.name}: emulated: {e['rounds']} rounds ({e['rounds_per_s']:.2f}/s, "
                         f"{e['needed_rounds_per_s']:.1f}/s needed), effective H {e['effective_h']} (H = {setup.fragments})")
    finally:
        remove(url, options)
        release_memory()
    return row


def summarize(rounds: list[RoundRow]) -> dict[str, Any]:
    """Medians over the rounds after the first (all of them if there is only one)."""
    steady = rounds[1:] or rounds
    rows = [r.to_dict() for r in steady]

    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in rows))

    return {"round_s": round(med("wall_s"), 4), "cpu_s": round(med("cpu_s"), 4),
            "merge_s": round(med("merge_s"), 4), "commit_s": round(med("commit_s"), 4),
            "requests_read": med("requests_read"), "requests_written": med("requests_written"),
            "mb_read": round(med("bytes_read") / 1e6, 2), "mb_written": round(med("bytes_written") / 1e6, 2),
            "io_bound_s": round(med("io_bound_s"), 4), "ratio": round(med("ratio"), 2),
            "arith_s": round(med("arith_s"), 4), "floor_ratio": round(med("floor_ratio"), 2),
            "rounds_per_s": round(len(steady) / sum(r.wall_s for r in steady), 3),
            "first_round_s": round(rounds[0].wall_s, 4), "rounds": [r.to_dict() for r in rounds]}


def remove(url: str, options: Mapping[str, Any] | None) -> None:
    if not options:
        shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
        return
    try:
        import s3fs

        s3fs.S3FileSystem(**options).rm(url, recursive=True)
    except Exception as e:  # noqa: BLE001 - moto is stopped at the end anyway
        print(f"could not delete {url}: {e}")


# -- report -----------------------------------------------------------------------------------------

COLUMNS = (("config", "<24"), ("params", ">8"), ("round s", ">8"), ("CPU s", ">7"), ("req r/w", ">9"),
           ("MB r/w", ">13"), ("I/O s", ">7"), ("ratio", ">7"), ("arith s", ">8"), ("floor x", ">8"), ("rounds/s", ">9"), ("seq s/r", ">8"),
           ("piped s/r", ">10"), ("eff. H", ">7"),
           ("emul. r/s", ">10"), ("needed", ">7"), ("sync cores", ">11"), ("fleet cores", ">12"), ("late", ">6"),
           ("RSS GB", ">7"))


def table(rows: list[dict[str, Any]]) -> str:
    head = "".join(format(name, spec) for name, spec in COLUMNS)
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['config']:<24}{r['params'] / 1e6:>7.1f}M  skipped: {r['skipped']}")
            continue
        e = r.get("emulated") or {}
        b = r.get("back_to_back") or {}
        eff = e.get("effective_h")
        cells = [r["config"], f"{r['params'] / 1e6:.1f}M", f"{r['round_s']:.3f}", f"{r['cpu_s']:.2f}",
                 f"{r['requests_read']:.0f}/{r['requests_written']:.0f}", f"{r['mb_read']:.1f}/{r['mb_written']:.1f}",
                 f"{r['io_bound_s']:.3f}", f"{r['ratio']:.1f}x", f"{r['arith_s']:.3f}", f"{r['floor_ratio']:.1f}x",
                 f"{r['rounds_per_s']:.2f}",
                 f"{b['sequential_round_s']:.3f}" if b else "-", f"{b['pipelined_round_s']:.3f}" if b else "-",
                 "-" if eff is None else f"{eff:.1f}" + ("" if e.get("effective_h_after_first_pass") else "*"),
                 f"{e['rounds_per_s']:.2f}" if e else "-", f"{e['needed_rounds_per_s']:.1f}" if e else "-",
                 f"{e['synchronizer_cores']:.2f}" if e else "-", f"{e['fleet_cores']:.2f}" if e else "-",
                 f"{e['late_publishes'] / max(1, e['publishes']):.0%}" if e else "-", f"{r['rss_gb']:.1f}"]
        lines.append("".join(format(c, spec) for c, (_, spec) in zip(cells, COLUMNS, strict=True)))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path, step_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = [r for r in rows if "skipped" not in r]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in measured:
        groups.setdefault(r["config"].split(" ", 1)[1], []).append(r)  # the config but its size
    for i, (name, rs) in enumerate(sorted(groups.items())):
        rs.sort(key=lambda r: r["params"])
        color = f"C{i % 10}"
        x = [r["params"] for r in rs]
        ax.plot(x, [r["round_s"] for r in rs], "o-", color=color, label=name)
        ax.plot(x, [r["io_bound_s"] for r in rs], "x--", color=color, alpha=0.7,
                label="its I/O bound (dashed, same colour)" if i == 0 else None)
        ax.plot(x, [r["io_bound_s"] + r["arith_s"] for r in rs], "+-.", color=color, alpha=0.7,
                label="I/O bound + arithmetic floor (dash-dot)" if i == 0 else None)
    ax.axhline(step_s, color="k", ls=":", lw=1, label=f"a round per {step_s * 1e3:g} ms step (keeps up at H = P)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("seconds per round (median)")
    ax.set_title("synchronizer round time (solid) against its bounds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sync_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- S3 ---------------------------------------------------------------------------------------------

class MotoProcess:
    """moto's S3 server in a process of its own (tests/moto_s3.py: atomic create-once), so its CPU
    is not the synchronizer's."""

    def __init__(self) -> None:
        import subprocess
        import urllib.request

        import boto3

        from atoll.ops.procs import free_port

        self.endpoint = f"http://127.0.0.1:{free_port()}"
        port = self.endpoint.rsplit(":", 1)[1]
        self.proc = subprocess.Popen([sys.executable, str(MOTO_S3), "-H", "127.0.0.1", "-p", port],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's server did not start on {self.endpoint}") from None
                time.sleep(0.2)
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        self.options = {"key": "testing", "secret": "testing",
                        "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


# -- main -------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10M and 86M, P = 8, M = 4, int4, 4 rounds, 30 s emulated")
    p.add_argument("--sizes", default="10M,86M,350M,1B", help=f"of {','.join(SIZES)}")
    p.add_argument("--fragments", default="8,24", help="P values (H = P)")
    p.add_argument("--learners", default="4,8", help="M values")
    p.add_argument("--codecs", default="int4,fp32", help="uplink = downlink codec: int4, bf16, fp32")
    p.add_argument("--master-every", default="1,16", help="master_snapshot_every values (fp32 runs: 1 only)")
    p.add_argument("--pacing", default="0", help="round_pacing values (0: off, the default preset; 1: H steps a round)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per configuration, the first one a warm-up")
    p.add_argument("--emulate-s", type=float, default=60.0, help="seconds of the emulated run (0: none)")
    p.add_argument("--step-ms", type=float, default=60.0, help="the replay learners' step time")
    p.add_argument("--s3", action="store_true", help="moto's S3 server (its own process) instead of a local folder")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    p.add_argument("--work-dir", default=None, help="where local runs go (default: a temporary folder)")
    p.add_argument("--out", default="out/bench/sync_throughput")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.fragments, args.learners, args.codecs = "10M,86M", "8", "4", "int4"
        args.rounds, args.emulate_s = 4, 30.0
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        p.error(f"unknown size(s) {unknown}; known: {list(SIZES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setups = [Setup(s, int(pf), int(m), c, int(k), float(pace)) for s in args.sizes.split(",")
              for pf in args.fragments.split(",") for m in args.learners.split(",") for c in args.codecs.split(",")
              for k in args.master_every.split(",") if c != "fp32" or int(k) <= 2 for pace in args.pacing.split(",")]
    progress = Progress()
    moto = MotoProcess() if args.s3 else None
    tmp = None if args.s3 or args.work_dir else tempfile.mkdtemp(prefix="atoll-sync-throughput-")
    root = f"s3://{BUCKET}" if args.s3 else paths.to_url(str(Path(args.work_dir or tmp).resolve()))
    machine = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "store": "s3 (moto)" if args.s3 else
               "local folder", "memory_available_gb": round(available_gb(), 1), "load_average": [os.getloadavg()[0]]}
    progress.say(f"{len(setups)} configuration(s) on a {machine['store']}; {machine['cpus']} CPUs, "
                 f"{machine['torch_threads']} torch threads, {machine['memory_available_gb']} GB available")
    rows = []
    try:
        for setup in setups:
            rows.append(measure(setup, args, root, moto.options if moto else None, progress))
    finally:
        progress.close()
        if moto is not None:
            moto.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    machine["load_average"].append(os.getloadavg()[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_throughput.json").write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows},
                                                         indent=1))
    print()
    print(f"synchronizer rounds with inputs ready (median of {max(1, args.rounds - 1)}), and an emulated fleet at "
          f"{args.step_ms:g} ms per step for {args.emulate_s:g} s; {machine['store']}, {machine['cpus']} CPUs, "
          f"load average {machine['load_average'][0]:.1f} at the start, {machine['load_average'][1]:.1f} at the end")
    print(table(rows))
    if any(not r.get("emulated", {}).get("effective_h_after_first_pass", True) for r in rows):
        print("* fewer emulated rounds than one pass over the fragments: effective H over all of them")
    print(f"plot: {plot(rows, out, args.step_ms / 1e3)}")
    print(f"table: {out / 'sync_throughput.json'}")
    at86 = [r for r in rows if r["size"] == "86M" and "skipped" not in r]
    if at86:  # the run's masters by replay where it measured them
        print(f"round time / I/O bound at 86M: {at86[-1]['ratio']:.1f}")
        print(f"round time / (I/O bound + arithmetic floor) at 86M: {at86[-1]['floor_ratio']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
