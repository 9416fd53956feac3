"""A round's reads on an object store: one call at a time against concurrent calls, side by side.

    python benchmarks/round_io.py [--learners 4,16,64] [--latency-ms 20] [--repeats 3] [--out out/]

Every poll of an open round lists each learner's contributions to the fragment at the current and
the previous base version (one LIST per learner and base), reads the records it has not seen (one
GET each), and the close reads the accepted payloads (one GET each). On S3 or GCS each call waits
tens of milliseconds, so one call at a time makes a round's reads grow with the fleet:
``ATOLL_IO_THREADS=1`` is that, the default runs up to 16 calls at once
(``atoll.storage.io_pool.io_map``).

The bucket is moto's S3 server on loopback with ``--latency-ms`` added to every call
(``atoll.storage.faults.StorageFaults``, the hook the chaos soak sets through
``ATOLL_FAULT_STORAGE``; a mean of ``--latency-ms``) to stand in for a
region's round trip: loopback alone answers in about a millisecond, which no object store does.
Each learner has published two contributions (a repeat, as a learner ahead of the synchronizer
does) of the micro model's fragment 0. Prints a table (median of ``--repeats`` reads with a fresh
handle, so no record is cached), with what one round's reads put on the wire (requests by kind and
bytes down, counted by the store: ``atoll.storage.wire``), and writes ``round_io.png``.
"""


from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

import atoll.storage.io_pool as io_pool
from atoll.core.weights import Counters
from atoll.storage import LearnerStore, RunReader
from atoll.storage import store as store_module
from atoll.storage.faults import StorageFaults
from atoll.storage.wire import WireCounts
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run

BUCKET = "atoll-round-io"


def moto_server() -> tuple[object, str, dict]:
    import boto3
    from moto.server import ThreadedMotoServer

    from atoll.ops.procs import free_port

    for name in ("werkzeug", "moto"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    return server, endpoint, options


def prepare(options: dict, learners: int) -> str:
    url = f"s3://{BUCKET}/m{learners}"
    config, recipe = smoke_recipe(learners, max_rounds=4)
    store = LearnerStore.beside(create_run(url, config, recipe, storage_options=options))
    g = torch.Generator().manual_seed(learners)
    shapes = store.manifest.fragment_shapes(0)
    for i in range(learners):
        for steps in (1, 2):
            delta = {n: 1e-3 * torch.randn(*s, generator=g) for n, s in shapes.items()}
            store.publish_contribution(f"learner-{i}", 0, 0, Counters(c_steps=steps, c_tokens=4 * steps), delta)
    return url


def read_round(url: str, options: dict, threads: int) -> tuple[float, float, int, WireCounts]:
    """Seconds to list (records included) and to load the payloads, with a fresh handle; what
    those reads sent to the store."""
    io_pool.IO_THREADS = threads
    store = RunReader.open(url, options)
    before = store.store.wire_counts()
    t0 = time.perf_counter()
    listing = store.list_contributions(0, [0, 1])
    t1 = time.perf_counter()
    newest = {}
    for rec in listing.records:  # the newest of each learner, as a round merges
        newest[rec.learner_id] = rec
    loaded, rejected = store.load_contributions(newest.values())
    t2 = time.perf_counter()
    assert not rejected and len(loaded) == len(newest)
    return t1 - t0, t2 - t1, len(listing.records), store.store.wire_counts() - before


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for threads, style in ((1, "o--"), (io_pool.IO_THREADS_DEFAULT, "o-")):
        pts = [(r["learners"], r["list_s"] + r["load_s"]) for r in rows if r["threads"] == threads]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{threads} call(s) at once")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("learners (M)")
    ax.set_ylabel("seconds per poll + close (list, records, payloads)")
    ax.set_title("a round's reads on S3 (moto + injected latency)")
    ax.legend()
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "round_io.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--learners", default="4,16,64")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added to every object-store call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="out")
    args = p.parse_args(argv)
    server, _, options = moto_server()
    rows = []
    try:
        urls = {m: prepare(options, m) for m in (int(x) for x in args.learners.split(","))}
        # Latency only for the reads measured (publishing above ran at loopback speed). The hook
        # draws each call's delay uniformly from [0, latency_s]: twice the mean asked for.
        store_module._FAULTS = StorageFaults(error=0.0, latency_s=2 * args.latency_ms / 1e3, seed=0)
        for m, url in urls.items():
            for threads in (1, io_pool.IO_THREADS_DEFAULT):
                runs = [read_round(url, options, threads) for _ in range(args.repeats)]
                rows.append({"learners": m, "threads": threads, "records": runs[0][2], "wire": runs[0][3],
                             "list_s": statistics.median(r[0] for r in runs),
                             "load_s": statistics.median(r[1] for r in runs)})
    finally:
        store_module._FAULTS = None
        server.stop()  # type: ignore[attr-defined]
    print(f"a round's reads, moto S3 + {args.latency_ms:g} ms per call, median of {args.repeats}")
    print(f"{'learners':>9}{'records':>9}{'calls at once':>15}{'list + records s':>18}{'payloads s':>12}"
          f"{'total s':>9}{'speed-up':>10}{'LIST':>6}{'GET':>6}{'MB down':>9}")
    for r in rows:
        base = next(x for x in rows if x["learners"] == r["learners"] and x["threads"] == 1)
        total, base_total = r["list_s"] + r["load_s"], base["list_s"] + base["load_s"]
        w = r["wire"]
        print(f"{r['learners']:>9}{r['records']:>9}{r['threads']:>15}{r['list_s']:>18.3f}{r['load_s']:>12.3f}"
              f"{total:>9.3f}{base_total / total:>9.1f}x{w.lists:>6}{w.gets:>6}{w.bytes_down / 1e6:>9.3f}")
    print(f"plot: {plot(rows, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
