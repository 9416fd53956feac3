"""The learner and synchronizer loops with real OS processes on a bucket folder.

Each test starts real `python -m atoll.train.local` processes (one per learner, and a
synchronizer) on a tiny model, and kills them with SIGKILL where the scenario says so.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from atoll.core.compress import EncodedTensor
from atoll.core.config import synchronous_diloco
from atoll.core.rejection import RejectionKind
from atoll.storage import RunReader, paths
from atoll.storage.codec import dump_record, encoded_to_bytes, sha256_hex
from atoll.storage.integrity import seal
from atoll.storage.paths import to_url
from atoll.storage.records import KIND_CONTRIBUTION
from atoll.train.data import BatchStream
from atoll.train.local import LocalRun
from atoll.train.model import loss_fn
from atoll.train.recipe import Recipe, demo_recipe, lr_at_step, smoke_recipe
from atoll.train.run import create_run

pytestmark = pytest.mark.timeout(240)


def wait_for(cond, timeout_s: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs:
            assert p.poll() in (None, 0), f"a process died with {p.returncode} while waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def new_run(tmp_path: Path, *, rounds: int, learners: int = 3, config_changes: dict | None = None,
            **recipe_changes) -> tuple[str, Recipe]:
    config, recipe = smoke_recipe(learners, max_rounds=rounds)
    if config_changes:
        config = config.replace(**config_changes)
    if recipe_changes:
        recipe = recipe.replace(**recipe_changes)
    url = to_url(str(tmp_path / "run"))
    create_run(url, config, recipe)
    return url, recipe


def test_three_learner_processes_train_and_every_round_is_recorded(tmp_path: Path) -> None:
    # The demo's outer step, measured for sub-million-parameter models: with the paper's Nesterov
    # (0.7, 0.9) momentum over-amplifies the merged update at this size, and the global model, one
    # fragment newer than the other, can evaluate far above ln(256) for a round or two (11.1 nats
    # at round 20, 3.13 at round 30, has been seen). Nesterov runs in processes are covered by the
    # kill and rejoin tests below.
    demo, _ = demo_recipe()
    url, recipe = new_run(tmp_path, rounds=40, eval_every_rounds=10, config_changes={
        "outer_lr": demo.outer_lr, "outer_momentum": demo.outer_momentum})
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        run.start_learners(recipe)
        sync = run.start_synchronizer()
        assert sync.wait(timeout=180) == 0, (tmp_path / "logs" / "synchronizer.log").read_text()[-3000:]
    store = RunReader.open(url)
    history = store.history()
    assert [r.round for r in history] == list(range(1, 41))
    evals = store.read_evals(store.eval_rounds())  # the evaluator thread's records, rounds 10, 20, 30, 40
    losses = [rec.val_loss for rec in evals.values()]
    # It trains: every evaluation is below the untrained model's ln(256) = 5.55 nats, the best is far
    # below it, and a later one beats the first. How far the evaluations have come depends on how
    # many inner steps the free-running learners fit into the rounds, which a loaded 2-core machine
    # shrinks: at this outer step, 4.17 to 4.80 at round 10 and 3.38 to 3.83 at round 40 have been
    # seen, every curve smooth (no round more than 0.15 nats above the one before).
    # An evaluator that fell behind skips to the newest round, but the run's end waits for the last.
    assert 40 in evals and set(evals) <= {10, 20, 30, 40} and len(losses) >= 2, evals
    assert max(losses) < 5.3 and min(losses) < 4.2 and min(losses[1:]) < losses[0], losses
    # Every accepted contribution is a record a learner published, with the same counters, or
    # with fewer where the round names it in stats["steps_clipped"]: on a loaded machine a
    # learner's claim can exceed what the trust screen's observed step times allow.
    seen_learners = set()
    for rec in history:
        assert rec.fragment == (rec.round - 1) % store.plan.num_fragments
        listed = {r.key: r for base in {a.base_version for a in rec.accepted}
                  for r in store.list_contributions(rec.fragment, base).records}
        clipped = rec.stats.get("steps_clipped", {})
        for a in rec.accepted:
            published = listed[a.key]
            assert (published.learner_id, published.base_version) == (a.learner_id, a.base_version)
            if a.learner_id in clipped:
                assert clipped[a.learner_id] == {"claimed": published.c_steps, "weighed": a.c_steps}
                assert a.c_steps < published.c_steps and a.c_tokens <= published.c_tokens
            else:
                assert (published.c_steps, published.c_tokens) == (a.c_steps, a.c_tokens)
            seen_learners.add(a.learner_id)
        assert abs(sum(a.weight for a in rec.accepted) - 1.0) < 1e-9 or not rec.accepted
    assert seen_learners == {s.learner_id for s in recipe.learners}
    assert store.list_checkpoints() == [40]


def reference_synchronous_diloco(recipe: Recipe, config, rounds: int) -> dict[str, torch.Tensor]:
    """Synchronous DiLoCo written out in one process: M models, H AdamW steps each, mean, Nesterov.

    Learner i's data is every M-th window from window i (the default interleaved shards)."""
    M, H = config.num_learners, config.inner_steps
    make = recipe.model_factory()
    glob = {n: p.detach().clone() for n, p in make().named_parameters()}
    models = [make() for _ in range(M)]
    opts = [recipe.inner.make(m.parameters()) for m in models]
    corpus = recipe.data.corpus()
    streams = [BatchStream(corpus.train, context_tokens=m.config.context_tokens, learner_index=i, num_learners=M,
                           seed=recipe.data.seed) for i, m in enumerate(models)]
    buf: dict[str, torch.Tensor] = {}
    step = 0
    for r in range(rounds):
        # The inner lr's cosine follows the run's progress: rounds committed so far / max_rounds.
        progress = r / recipe.max_rounds if recipe.inner.schedule == "run" else None
        for _ in range(H):
            step += 1
            for m, opt, stream, spec in zip(models, opts, streams, recipe.learners, strict=True):
                for g in opt.param_groups:
                    g["lr"] = lr_at_step(recipe.inner, step, progress)
                x, y = stream.next_batch(spec.batch_size)
                loss = loss_fn(m, x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), recipe.inner.grad_clip)
                opt.step()
        for n in glob:
            delta = torch.zeros_like(glob[n])
            for m in models:
                delta.add_(glob[n] - dict(m.named_parameters())[n].detach(), alpha=1.0 / M)
            buf[n] = delta.clone() if n not in buf else buf[n].mul(config.outer_momentum).add_(delta)
            glob[n] = glob[n] - config.outer_lr * delta.add(buf[n], alpha=config.outer_momentum)
        with torch.no_grad():
            for m in models:
                for n, p in m.named_parameters():
                    p.copy_(glob[n])
    return glob


def test_lockstep_multiprocess_equals_in_process_synchronous_diloco(tmp_path: Path) -> None:
    rounds = 3
    config = synchronous_diloco(3, inner_steps=3)
    _, recipe = smoke_recipe(3, max_rounds=rounds)
    url = to_url(str(tmp_path / "run"))
    create_run(url, config, recipe)
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        run.start_learners(recipe)
        sync = run.start_synchronizer()
        assert sync.wait(timeout=180) == 0
        for p in run.learners.values():
            p.wait(timeout=60)
    store = RunReader.open(url)
    assert [len(r.accepted) for r in store.history()] == [3] * rounds
    got = store.read_global_state().params
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the learner processes ran with one thread each
    try:
        want = reference_synchronous_diloco(recipe, config, rounds)
    finally:
        torch.set_num_threads(threads)
    for n in want:
        # Same ops in the same order on one thread each: equal bit for bit.
        assert torch.equal(got[n], want[n]), (n, (got[n] - want[n]).abs().max())


def test_sigkilled_learner_rejoins_and_no_round_is_lost(tmp_path: Path) -> None:
    url, recipe = new_run(tmp_path, rounds=100_000)
    store = RunReader.open(url)
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        run.start_learners(recipe)
        sync = run.start_synchronizer()
        wait_for(lambda: store.latest_round() >= 8, 120, "8 rounds", [sync])
        # Kill it mid-run: after it has contributed and saved its inner state at least once.
        wait_for(lambda: any(a.learner_id == "learner-1" for r in store.history() for a in r.accepted)
                 and store.load_learner_state("learner-1") is not None, 120, "learner-1 to contribute", [sync])
        run.kill(run.learners["learner-1"])
        killed_at = store.latest_round()
        wait_for(lambda: store.latest_round() >= killed_at + 6, 60, "rounds without learner-1", [sync])
        run.start_learner("learner-1")
        restarted_at = store.latest_round()

        def learner_1_back() -> bool:
            return any(a.learner_id == "learner-1" for r in store.history(restarted_at + 1) for a in r.accepted)

        wait_for(learner_1_back, 120, "learner-1 to contribute again", [sync])
        last = store.latest_round()
    history = store.history(1, last)  # raises if any round is missing
    assert [r.round for r in history] == list(range(1, last + 1))
    log = (tmp_path / "logs" / "learner-1.log").read_text()
    assert "rejoined at round" in log


CRASHING_SYNCHRONIZER = textwrap.dedent(
    """
    import os, signal, sys
    from atoll.storage import paths
    from atoll.storage.store import ObjectStore
    from atoll.train import local
    target = paths.commit_key(int(sys.argv[2]))
    original = ObjectStore.create
    def create(self, key, data, *args, **kwargs):
        if key == target:  # payloads of this round are written; its commit record is not
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, key, data, *args, **kwargs)
    ObjectStore.create = create
    local.main(["synchronizer", sys.argv[1]])
    """
)


def test_synchronizer_killed_between_payload_and_commit_resumes_exactly(tmp_path: Path) -> None:
    url, recipe = new_run(tmp_path, rounds=14)
    store = RunReader.open(url)
    crash_round = 6
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        run.start_learners(recipe)
        crashing = subprocess.Popen([sys.executable, "-c", CRASHING_SYNCHRONIZER, url, str(crash_round)])
        assert crashing.wait(timeout=120) == -9
        assert store.latest_round() == crash_round - 1
        blobs_before = set(store.store.list("sync/blobs/sha256/"))
        assert store.read_commit(crash_round) is None
        sync = run.start_synchronizer()
        assert sync.wait(timeout=120) == 0
    assert set(store.store.list("sync/blobs/sha256/")) >= blobs_before
    history = store.history()
    assert [r.round for r in history] == list(range(1, 15))
    assert len({r.nonce for r in history}) == 14


def plant_garbage(store: RunReader, fragment: int, kind: str) -> str:
    """A rogue learner writes a contribution behind the protocol's back (no client-side checks)."""
    version = store.read_global_state().versions[fragment]
    shapes = store.manifest.fragment_shapes(fragment)
    enc = {}
    for i, (name, shape) in enumerate(shapes.items()):
        t = torch.zeros(shape)
        if kind == "nan" and i == 0:
            t.view(-1)[0] = float("nan")
        if kind == "shape" and i == 0:
            t = torch.zeros(tuple(shape) + (2,))
        enc[name] = EncodedTensor("fp32", tuple(t.shape), {"data": t})
    payload, meta = encoded_to_bytes(enc)
    sha = sha256_hex(payload)
    store.store.put(paths.blob_key(sha, f"rogue-{kind}"), payload)
    key = paths.contribution_key(fragment, version, f"rogue-{kind}", 5, sha)
    body = {"learner_id": f"rogue-{kind}", "fragment": fragment, "base_version": version, "c_steps": 5,
            "c_tokens": 200, "payload": {"sha256": sha, "nbytes": len(payload)}, "tensors": meta,
            "created_at": time.time(), "info": {}}
    store.store.create(key, dump_record(KIND_CONTRIBUTION, seal(KIND_CONTRIBUTION, body)))  # a rogue can seal
    return key


def test_garbage_contributions_are_rejected_with_reasons_and_training_goes_on(tmp_path: Path) -> None:
    url, recipe = new_run(tmp_path, rounds=100_000)
    store = RunReader.open(url)
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        run.start_learners(recipe)
        sync = run.start_synchronizer()
        wait_for(lambda: store.latest_round() >= 4, 120, "4 rounds", [sync])
        planted = {plant_garbage(store, 0, "nan"): RejectionKind.NON_FINITE,
                   plant_garbage(store, 1, "shape"): RejectionKind.LAYOUT}

        def all_rejected() -> bool:
            rejected = {k: v for r in store.history() for k, v in r.rejected.items()}
            # 'late' is not final: a late contribution is considered again by the next round.
            return all(k in rejected and rejected[k].final for k in planted)

        wait_for(all_rejected, 60, "the garbage to be rejected", [sync])
        start = store.latest_round()
        wait_for(lambda: store.latest_round() >= start + 4, 60, "4 more rounds", [sync])
    history = store.history()
    rejected = {k: v for r in history for k, v in r.rejected.items()}
    for key, kind in planted.items():
        assert rejected[key].kind is kind, rejected[key]
    assert not any(a.learner_id.startswith("rogue") for r in history for a in r.accepted)
    params = store.read_global_state().params
    assert all(torch.isfinite(t).all() for t in params.values())
