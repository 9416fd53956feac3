"""Launching a training run and following it from a terminal (``atoll train``, ``atoll resume``,
``make demo``). Progress lines come from the bucket; the flow run's state from the Prefect API."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_UI_URL

from atoll.flows.training import training_run
from atoll.ops.defaults import DEFAULT_PORT, DEMO_DIR
from atoll.ops.deploy import deploy_all, start_training
from atoll.ops.procs import free_port
from atoll.ops.stack import LocalStack
from atoll.runs.manage import new_run_url
from atoll.runs.names import plural
from atoll.runs.options import TrainingRunOptions
from atoll.runs.report import last_val_loss
from atoll.storage.reader import RunReader

__all__ = ["launch_training", "follow", "run_demo"]


def follow(flow_run_id: Any, run_url: str | None, storage_options: Mapping[str, Any] | None = None,
           every_s: float = 10.0, poll_s: float = 2.0) -> tuple[str, float | None]:
    """Print progress from the bucket until the flow run ends; returns (state name, last val loss)."""
    last_print, shown = 0.0, 0
    state = "?"
    with get_client(sync_client=True) as client:
        while True:
            fr = client.read_flow_run(flow_run_id)
            state = (fr.state.name or "?") if fr.state else "?"
            final = fr.state is not None and fr.state.is_final()
            if run_url and (final or time.monotonic() - last_print >= every_s):
                store = RunReader.open(run_url, storage_options, read_only=True)
                if store.exists():
                    latest = store.latest_round()
                    if latest > shown:
                        rec = store.read_commit(latest)
                        loss = last_val_loss(store, store.history(max(1, latest - 20), latest))
                        print(f"  [{state}] round {latest}: {plural(len(rec.accepted) if rec else 0, 'learner')} merged"
                              + (f", validation loss {loss:.4f}" if loss is not None else ""), flush=True)
                        shown = latest
                last_print = time.monotonic()
            if final:
                break
            time.sleep(poll_s)
    loss = None
    if run_url:
        store = RunReader.open(run_url, storage_options, read_only=True)
        if store.exists() and store.latest_round():
            latest = store.latest_round()
            loss = last_val_loss(store, store.history(max(1, latest - 64), latest))
    return state, loss


def launch_training(options: TrainingRunOptions, *, in_process: bool = False, wait: bool = True) -> int:
    """Run the training run here, or launch it on its deployment and (optionally) follow it."""
    if in_process:
        out = training_run(options)
        print(f"run {out['run_id']} finished at round {out['rounds']}; validation loss {out['val_loss']}; "
              f"bucket {out['run_url']}")
        return 0
    fr = start_training(options)
    ui = PREFECT_UI_URL.value()
    run_url = options.target_url
    print(f"launched training run {fr.name} ({fr.id})" + (f": {ui}/runs/flow-run/{fr.id}" if ui else ""), flush=True)
    if run_url:
        print(f"bucket: {run_url}", flush=True)
    if not wait:
        return 0
    try:
        state, loss = follow(fr.id, run_url, options.storage_options)
    except KeyboardInterrupt:  # only the following stops: the training run is not this process's child
        print(f"stopped following; the training run goes on on its worker (`atoll stop {run_url}` stops it)",
              flush=True)
        raise
    print(f"training run {state}; final validation loss {loss}; bucket {run_url}", flush=True)
    return 0 if state == "Completed" else 1


def run_demo(directory: str | Path = DEMO_DIR, *, learners: int = 0, rounds: int = 0, port: int = DEFAULT_PORT,
             keep_up: bool = False) -> int:
    """``make demo``: local stack, deploy, train the demo preset on the two pools, print where to look.
    ``learners`` and ``rounds``: 0 takes the preset's (as in :class:`TrainingRunOptions`)."""
    root = Path(directory).resolve()
    stack = LocalStack(home=root / "prefect", port=free_port(port), log_dir=root / "logs")
    run_url = new_run_url(str(root / "bucket"), time.strftime("demo-%Y%m%d-%H%M%S"))
    print(f"starting the local stack: Prefect server on {stack.ui_url}, process workers for "
          f"{', '.join(stack.pools)} (logs in {stack.log_dir})", flush=True)
    t0 = time.monotonic()
    try:
        stack.start()
        print(f"Prefect UI: {stack.ui_url}  (up after {time.monotonic() - t0:.0f}s)", flush=True)
        with stack.settings():
            deploy_all(stack.pools)
            print("deployed atoll-training-run/default, atoll-supervisor/default, atoll-prune/default and "
                  "atoll-learner/{" + ",".join(stack.pools) + "}", flush=True)
            # Recorded rounds: at the demo's H = P = 8 a round per learner step is due, faster than a
            # Prefect flow run per round can be run on a laptop (docs/prefect.md, "What a round costs").
            options = TrainingRunOptions(run_url=run_url, preset="demo", learners=learners, rounds=rounds,
                                         record_rounds=True)
            fr = start_training(options, flow_run_name=run_url.rsplit("/", 1)[-1])
            print(f"training run: {stack.ui_url}/runs/flow-run/{fr.id}\nbucket: {run_url}", flush=True)
            state, loss = follow(fr.id, run_url)
        store = RunReader.open(run_url, read_only=True)
        print("\n".join([
            "",
            f"demo finished: training run {state} in {time.monotonic() - t0:.0f}s",
            f"  Prefect UI:            {stack.ui_url}",
            f"  final validation loss: {loss:.4f}" if loss is not None else "  final validation loss: -",
            f"  bucket:                {run_url}",
            f"  rounds committed:      {store.latest_round() if store.exists() else 0}",
            f"  round history:         atoll status {run_url}",
        ]), flush=True)
        if keep_up:
            print(f"the stack stays up at {stack.ui_url}; Ctrl-C (or SIGTERM) stops it", flush=True)
            with contextlib.suppress(KeyboardInterrupt):  # the way a kept-up demo ends: not a failure
                while not (gone := stack.exited()):
                    time.sleep(1)
                print(f"{gone} exited", flush=True)
        print(f"(the Prefect database stays in {root / 'prefect'}: `atoll up --home {root / 'prefect'}` "
              "shows these runs again)", flush=True)
        return 0 if state == "Completed" else 1
    finally:
        # Also on Ctrl-C or SIGTERM during training (atoll.ops.signals): the KeyboardInterrupt goes on up.
        print("stopping the local stack ...", flush=True)
        stack.stop()
