"""Storage benchmark: put/get throughput of a 50 MB delta and commit latency, side by side.

Backends in one run: a local folder, moto's S3 server and gcp-storage-emulator, both started
here on loopback ports. Emulator numbers measure this machine's Python servers, NOT cloud
object stores: use them to compare code paths, never as S3/GCS throughput claims.

    python benchmarks/storage.py [--out out/] [--mb 50] [--repeats 3] [--commits 10]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import torch  # noqa: E402

from atoll.core import DilocoConfig, plan_fragments  # noqa: E402
from atoll.core.weights import Counters  # noqa: E402
from atoll.storage import LearnerStore, RunCreator, RunReader, SynchronizerStore  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_servers():
    import logging

    for name in ("werkzeug", "gcp_storage_emulator", "gcp_storage_emulator.storage"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    import boto3
    from gcp_storage_emulator.server import create_server
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    s3_ep = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=s3_ep, aws_access_key_id="bench", aws_secret_access_key="bench",
                 region_name="us-east-1").create_bucket(Bucket="atoll-bench")
    gport = _free_port()
    gcs = create_server("127.0.0.1", gport, in_memory=True, default_bucket="atoll-bench")
    gcs.start()
    return moto, gcs, s3_ep, f"http://127.0.0.1:{gport}"


def _bench(name: str, url: str, options: dict, open_kwargs: dict, mb: int, repeats: int, commits: int) -> dict:
    numel = mb * 2**20 // 4
    params = {"w": torch.zeros(numel), "b": torch.zeros(16)}
    cfg = DilocoConfig(num_learners=1, num_fragments=1, inner_steps=1, overlap_steps=0)
    plan = plan_fragments({n: t.shape for n, t in params.items()}, num_fragments=1, inner_steps=1)
    rs = LearnerStore.open(url, options, max_payload_bytes=(mb + 8) * 2**20, **open_kwargs)
    RunCreator.beside(rs).init_run(cfg, plan, params, run_id="bench")
    reader = RunReader.open(url, options, max_payload_bytes=(mb + 8) * 2**20, **open_kwargs)
    puts, gets = [], []
    for i in range(repeats):
        delta = {"w": torch.randn(numel) * 1e-3, "b": torch.randn(16)}
        t0 = time.perf_counter()
        rec = rs.publish_contribution(f"l{i}", 0, 0, Counters(c_steps=1, c_tokens=1), delta)
        puts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        (r,) = [x for x in reader.list_contributions(0, 0).records if x.key == rec.key]
        reader.load_contribution(r)
        gets.append(time.perf_counter() - t0)
    nbytes = rec.payload.nbytes
    raw = os.urandom(nbytes)
    raw_put, raw_get = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        rs.store.put(f"scratch/raw-{i}", raw)
        raw_put.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        reader.store.get(f"scratch/raw-{i}")
        raw_get.append(time.perf_counter() - t0)
    small = {"w": torch.zeros(numel), "b": torch.zeros(16)}
    lat = []
    # Commit latency: records + a params payload of one tiny fragment would be fairer, but the run
    # has one 50 MB fragment; measure a no-update commit (record only) and one full commit.
    sync = SynchronizerStore.beside(rs)
    for r in range(1, commits + 1):
        t0 = time.perf_counter()
        assert sync.commit_round(r, 0, params=None, stats={"i": r}).won or name == "gcs-emulator"
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sync.commit_round(commits + 1, 0, params=small)
    full_commit = time.perf_counter() - t0
    return {
        "backend": name,
        "payload_mb": nbytes / 1e6,
        "put_mb_s": nbytes / 1e6 / statistics.median(puts),
        "get_mb_s": nbytes / 1e6 / statistics.median(gets),
        "raw_put_mb_s": nbytes / 1e6 / statistics.median(raw_put),
        "raw_get_mb_s": nbytes / 1e6 / statistics.median(raw_get),
        "commit_ms": 1e3 * statistics.median(lat),
        "commit_p_max_ms": 1e3 * max(lat),
        "full_commit_s": full_commit,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out", help="folder for the plot (default out/)")
    ap.add_argument("--mb", type=int, default=50, help="delta size in MB (fp32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--commits", type=int, default=10)
    args = ap.parse_args(argv)

    moto, gcs, s3_ep, gcs_ep = _start_servers()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tag = uuid.uuid4().hex[:8]
            backends = [
                ("local", f"{tmp}/run", {}, {}),
                ("s3-moto", f"s3://atoll-bench/{tag}", {"key": "bench", "secret": "bench",
                                                       "client_kwargs": {"endpoint_url": s3_ep,
                                                                         "region_name": "us-east-1"}}, {}),
                # The emulator ignores ifGenerationMatch=0: the capability probe would refuse it.
                ("gcs-emulator", f"gs://atoll-bench/{tag}", {"endpoint_url": gcs_ep, "token": "anon",
                                                             "project": "bench"}, {"unsafe_allow_overwrite": True}),
            ]
            for name, url, opts, kw in backends:
                print(f"... {name}", file=sys.stderr, flush=True)
                rows.append(_bench(name, url, opts, kw, args.mb, args.repeats, args.commits))
    finally:
        moto.stop()
        gcs.stop()

    head = (f"{'backend':<14}{'payload MB':>11}{'put MB/s':>10}{'get MB/s':>10}{'raw put':>9}{'raw get':>9}"
            f"{'commit ms':>11}{'max ms':>9}{'full commit s':>15}")
    print(f"Storage benchmark: {args.mb} MB fp32 delta (publish = encode + sha256 + PUT payload + create record;")
    print("get = LIST + GET record + GET payload + verify + decode), median of", args.repeats, "runs;")
    print("raw = ObjectStore put/get of the same number of bytes (transport only, MB/s);")
    print(f"commit = create-once record write (median of {args.commits}); full commit also writes {args.mb} MB params.")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['backend']:<14}{r['payload_mb']:>11.1f}{r['put_mb_s']:>10.0f}{r['get_mb_s']:>10.0f}"
              f"{r['raw_put_mb_s']:>9.0f}{r['raw_get_mb_s']:>9.0f}"
              f"{r['commit_ms']:>11.1f}{r['commit_p_max_ms']:>9.1f}{r['full_commit_s']:>15.2f}")
    print("NOTE: s3-moto and gcs-emulator are local Python emulators on loopback; their numbers are NOT")
    print("      cloud S3/GCS numbers. Compare rows only within one run on one machine.")

    os.makedirs(args.out, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["backend"] for r in rows]
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["put_mb_s"] for r in rows], width=0.4, label="put")
    axes[0].bar([i + 0.2 for i in x], [r["get_mb_s"] for r in rows], width=0.4, label="get")
    axes[0].set_xticks(list(x), names)
    axes[0].set_ylabel("MB/s")
    axes[0].set_title(f"{args.mb} MB delta throughput")
    axes[0].legend()
    axes[1].bar(list(x), [r["commit_ms"] for r in rows])
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("ms")
    axes[1].set_title("commit latency (create-once record)")
    fig.suptitle("atoll storage (emulators are not cloud numbers)")
    fig.tight_layout()
    path = os.path.join(args.out, "storage.png")
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
