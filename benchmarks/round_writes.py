"""What a round writes: the bytes the synchronizer's own store uploads per committed round, per
parameter of the round's fragment, at the demo preset and at the paper's setting.

    python benchmarks/round_writes.py [--rounds 240] [--snapshot-every 8] [--master-every 1,preset]

Each row is a real virtual run (``atoll.train.virtual.run_virtual``: the real learners, the real
synchronizer and a real local-folder bucket, on a virtual clock), the synchronizer on a store of
its own whose :class:`~atoll.storage.wire.WireMeter` counts every byte it uploads. ``metered`` is
that count over the run divided by the sum, over the committed rounds, of the round's fragment's
parameter count n (so 4.0 is one fp32 copy of the fragment per round); the runs write no
checkpoint. The other columns split the payloads each round's commit record names anew by kind
(fp32 master, outer momentum, fp32 view, int4 update); ``records`` is what is left: the commit
record and the head hint. ``amortized`` counts the view as one fp32 copy (the master's size)
every S = ``downlink_snapshot_every`` versions, and the master (and momentum) on 2 versions out
of M = ``master_snapshot_every`` (every one at M <= 2), as a run long enough to hold many of
them writes them (a short run holds a snapshot or none).

Presets: ``demo`` (H = P = 8, outer Nesterov 0.8 / mu 0, int4 up and down, 4 learners, the tiny GPT)
and ``paper`` (the same with H = P = 24 and Nesterov 0.7 / 0.9, the paper's values). The script
runs against whichever atoll is importable, so the same command measures an older tree
(``PYTHONPATH=<old tree>/src``) for a before/after table.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections import Counter
from pathlib import Path

from atoll.storage import SynchronizerStore
from atoll.storage.paths import to_url
from atoll.train.recipe import demo_recipe
from atoll.train.run import create_run
from atoll.train.virtual import run_virtual

KINDS = ("master", "momentum", "view", "update")


def new_run(root: Path, preset: str, snapshot_every: int | None, master_every: int | None) -> SynchronizerStore:
    config, recipe = demo_recipe()
    if preset == "paper":
        config = config.replace(num_fragments=24, inner_steps=24, outer_lr=0.7, outer_momentum=0.9)
        if hasattr(config, "master_snapshot_every"):
            config = config.replace(master_snapshot_every=24)  # the gpu preset's, for mu > 0
    if snapshot_every is not None and hasattr(config, "downlink_snapshot_every"):
        config = config.replace(downlink_snapshot_every=snapshot_every)
    if master_every is not None and hasattr(config, "master_snapshot_every"):
        config = config.replace(master_snapshot_every=master_every)
    recipe = dataclasses.replace(recipe, max_rounds=10**6, checkpoint_every_rounds=0, eval_every_rounds=0)
    return create_run(to_url(str(root / f"{preset}-{snapshot_every}-{master_every}")), config, recipe)


def payload_bytes(store: SynchronizerStore, rounds: int) -> tuple[Counter[str], int]:
    """(bytes of the payloads each round writes anew, by kind, and of the masters it names,
    written or not, as 'named'; sum of the rounds' fragment sizes)."""
    by_kind: Counter[str] = Counter()
    numel = 0
    seen = {b.sha256 for b in store.manifest.initial}
    for r in range(1, rounds + 1):
        rec = store.read_commit(r)
        assert rec is not None
        numel += store.plan.fragment_numel(rec.fragment)
        st = rec.state[rec.fragment]
        dl = st.downlink
        by_kind["named"] += st.params.nbytes
        written = getattr(st, "master_written", True)
        named = {"master": st.params if written else None, "momentum": st.momentum,
                 "view": getattr(dl, "view", None), "update": getattr(dl, "update", None)}
        for kind, ref in named.items():
            if ref is not None and ref.sha256 not in seen:
                seen.add(ref.sha256)
                by_kind[kind] += ref.nbytes
    return by_kind, numel


def measure(root: Path, preset: str, rounds: int, snapshot_every: int | None,
            master_every: int | None) -> dict[str, float]:
    store = new_run(root, preset, snapshot_every, master_every)
    recipe_tokens = 4 * 8 * 128  # 4 learners x batch 8 x context 128: one step of each
    result = run_virtual(store, token_budget=rounds * recipe_tokens, own_stores=True)
    sent = result.wire["synchronizer"]
    by_kind, numel = payload_bytes(store, result.rounds)
    row = {"rounds": result.rounds, "metered": sent.bytes_up / numel}
    row.update({k: by_kind[k] / numel for k in KINDS})
    row["records"] = row["metered"] - sum(row[k] for k in KINDS)
    # A short run holds few snapshots: amortize the view as one (the master's size) every S versions,
    # and the master and momentum as written on 2 versions out of M (M > 2), else on every one.
    every = getattr(store.config, "downlink_snapshot_every", 1)
    masters = getattr(store.config, "master_snapshot_every", 1)
    named = by_kind["named"] / numel
    share = 2 / masters if masters > 2 else 1.0
    state = named * (2 if store.config.outer_momentum else 1) * share
    row["amortized"] = row["metered"] - row["view"] - row["master"] - row["momentum"] + named / every + state
    row["every"], row["masters"] = every, masters
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=240, help="about this many rounds per run")
    ap.add_argument("--snapshot-every", type=int, default=None, help="DilocoConfig.downlink_snapshot_every "
                    "(default: the config's; ignored by a tree without it)")
    ap.add_argument("--master-every", default="1,preset", help="DilocoConfig.master_snapshot_every values "
                    "('preset': the preset's; ignored by a tree without it)")
    ap.add_argument("--presets", default="demo,paper")
    args = ap.parse_args()
    print(f"{'preset':<8}{'S':>4}{'M':>4}{'rounds':>8}{'metered':>10}{'master':>9}{'momentum':>10}{'view':>8}"
          f"{'update':>8}{'records':>9}{'amortized':>11}   (bytes per round / n)")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            for m in args.master_every.split(","):
                row = measure(Path(tmp), preset, args.rounds, args.snapshot_every, None if m == "preset" else int(m))
                print(f"{preset:<8}{row['every']:>4}{row['masters']:>4}{row['rounds']:>8}{row['metered']:>10.3f}"
                      f"{row['master']:>9.3f}{row['momentum']:>10.3f}{row['view']:>8.3f}{row['update']:>8.3f}"
                      f"{row['records']:>9.3f}{row['amortized']:>11.3f}")


if __name__ == "__main__":
    main()
