"""What masters by replay cost a restart: seconds for a new synchronizer to load a run's state.

    python benchmarks/replay_restart.py                      # 86 M, P = 8, masters every version and M = 16: ~6 min
    python benchmarks/replay_restart.py --size 10M --masters 1,4,16

For each ``master_snapshot_every`` value, one run on a local folder: the sync-throughput
benchmark's replay fleet (``benchmarks/sync_throughput.py``: M = 4 learners publishing int4
contributions of the model's exact shapes, the real ``Synchronizer`` merging and committing) runs
rounds until every fragment stands at the deepest depth M - 1 (its master rebuilt by replaying
M - 2 rounds: the worst case; on average a restart replays half that), then a new
``Synchronizer`` opens the run as a restart does, and the seconds it takes are the row. With a
master on every version the restart only reads and verifies the masters.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sync_throughput as fleet  # noqa: E402 - the replay fleet lives beside this script
from atoll.storage import SynchronizerStore, paths  # noqa: E402
from atoll.train.run import create_run  # noqa: E402
from atoll.train.synchronizer import Synchronizer, SynchronizerOptions  # noqa: E402


def restart_s(setup: fleet.Setup, root: Path) -> dict[str, object]:
    """Rounds until every fragment is at its deepest depth, then the seconds a restart takes."""
    url = paths.to_url(str(root / f"run-{uuid.uuid4().hex[:6]}"))
    config, recipe = fleet.run_config(setup)
    create_run(url, config, recipe, model=fleet.random_model(fleet.SIZES[setup.size]))
    deepest = max(setup.masters, 2) - 1
    rounds = setup.fragments * (deepest if setup.masters > 2 else 1)
    progress = fleet.Progress()
    try:
        with progress.phase(f"{setup.name}: {rounds} rounds"), contextlib.redirect_stdout(io.StringIO()):
            fleet.measure_rounds(url, None, setup, rounds, 0.06, progress)
    finally:
        progress.close()
    store = SynchronizerStore.open(url)
    depths = [st.master_depth for st in store.read_commit(store.latest_round()).state]  # type: ignore[union-attr]
    t0 = time.perf_counter()
    sync = Synchronizer(store, options=SynchronizerOptions(poll_interval_s=0.1))
    seconds = time.perf_counter() - t0
    return {"masters": setup.masters, "round": sync.round, "depths": depths, "restart_s": round(seconds, 2),
            "replayed": sum(max(0, d - 1) for d in depths)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="86M", help=f"of {','.join(fleet.SIZES)}")
    ap.add_argument("--fragments", type=int, default=8)
    ap.add_argument("--masters", default="1,16", help="master_snapshot_every values")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="atoll-replay-restart-"))
    rows = []
    try:
        for m in args.masters.split(","):
            rows.append(restart_s(fleet.Setup(args.size, args.fragments, 4, "int4", int(m)), root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.size}, P = {args.fragments}, 4 learners, int4; a restart at the deepest depth")
    print(f"{'M':>4}{'round':>8}{'rounds replayed':>17}{'restart s':>11}")
    for r in rows:
        print(f"{r['masters']:>4}{r['round']:>8}{r['replayed']:>17}{r['restart_s']:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
