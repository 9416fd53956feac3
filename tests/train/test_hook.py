"""Bring your own training loop (atoll.join): a user's plain PyTorch loop as a learner, with real
processes on a bucket folder, next to a learner running atoll's own loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atoll.storage import RunReader, SynchronizerStore
from atoll.storage.paths import to_url
from atoll.train.learner import LearnerOptions
from atoll.train.local import LocalRun

from .test_loops import wait_for

pytestmark = pytest.mark.timeout(300)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def env() -> dict[str, str]:
    path = os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def user_loop(url: str, learner_id: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, str(EXAMPLES / "plain_loop.py")], stdout=out,
                                stderr=subprocess.STDOUT, env={**env(), "ATOLL_RUN_URL": url,
                                                               "ATOLL_LEARNER_ID": learner_id})


def merged(store: RunReader, learner_id: str, after: int = 0) -> bool:
    return any(a.learner_id == learner_id for r in store.history(after + 1) for a in r.accepted)


def test_user_loop_and_atoll_loop_learners_are_both_merged_and_a_killed_user_loop_rejoins(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    subprocess.run([sys.executable, str(EXAMPLES / "plain_loop.py"), "--create", url, "--learners", "2",
                    "--rounds", "100000"], check=True, env=env())
    store = RunReader.open(url)
    logs = tmp_path / "logs"
    logs.mkdir()
    with LocalRun(url, log_dir=logs, extra_env={"PYTHONPATH": env()["PYTHONPATH"]}) as run:
        run.start_learner("learner-0")  # atoll's own loop, on the model the recipe names
        user = user_loop(url, "learner-1", logs / "user.log")
        try:
            sync = run.start_synchronizer()
            wait_for(lambda: merged(store, "learner-0") and merged(store, "learner-1")
                     and store.load_learner_state("learner-1") is not None, 150, "both learners merged", [sync, user])
            saved = store.load_learner_state("learner-1")
            assert saved is not None and saved.meta["user"]["step"] >= 10  # the loop's own position
            assert any(k.endswith(".exp_avg") for k in saved.tensors)  # the user's AdamW state
            # SIGKILL the user's loop: a lost spot instance. Its next process rejoins.
            user.kill()
            user.wait(timeout=30)
            user = user_loop(url, "learner-1", logs / "user.log")
            # The killed copy's last contributions may still be merged: count merges only from
            # rounds after the new incarnation rejoined.
            wait_for(lambda: "learner-1: rejoined at round" in (logs / "user.log").read_text(), 120,
                     "learner-1 to rejoin", [sync, user])
            rejoined_at = store.latest_round()
            wait_for(lambda: merged(store, "learner-1", rejoined_at + 1), 150, "learner-1 merged again", [sync, user])
            assert "user loop" in (logs / "user.log").read_text()
        finally:
            if user.poll() is None:
                user.terminate()  # SIGTERM: saves and exits cleanly
                assert user.wait(timeout=60) == 0
    log = (logs / "user.log").read_text()
    assert "exit: sigterm" in log
    history = store.history()
    assert [r.round for r in history] == list(range(1, len(history) + 1))


def test_join_in_process_publishes_adopts_and_stops_when_the_run_is_finished(tmp_path: Path) -> None:
    """No processes: a user loop in this thread, the synchronizer stepped by hand between steps."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import plain_loop
    finally:
        sys.path.remove(str(EXAMPLES))
    import atoll
    from atoll.train.synchronizer import Synchronizer, SynchronizerOptions

    url = to_url(str(tmp_path / "run"))
    plain_loop.create(url, 1, rounds=3)
    store = RunReader.open(url)
    sync = Synchronizer(SynchronizerStore.open(url), options=SynchronizerOptions(poll_interval_s=0.01))
    model = plain_loop.char_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = plain_loop.corpus(1 << 16)
    steps = 0
    options = LearnerOptions(poll_interval_s=0.01, handle_sigterm=False, lockstep=False)  # the synchronizer runs in this thread
    with atoll.join(url, "learner-0", model, opt, tokens_per_step=8 * 32, options=options, log=lambda _: None) as hook:
        for steps in range(1, 10_000):
            x = data[:8 * 32].view(8, 32)
            y = data[1:8 * 32 + 1].view(8, 32)
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()  # raises LearnerExit (caught by the with block) once round 3 is committed
            opt.zero_grad()
            if steps % 4 == 0:
                sync.tick()  # the synchronizer, between two steps
    assert hook.exit_reason == "finished", hook.exit_reason
    assert hook.run_progress == 1.0
    assert store.latest_round() == 3 and hook.summary.published >= 3 and hook.summary.aligned >= 2
    assert not opt._optimizer_step_post_hooks  # the hook is removed with the block


def reference_lockstep(rounds: int, learners: int, h: int, outer_lr: float, outer_mu: float) -> dict[str, torch.Tensor]:
    """Synchronous DiLoCo over the example's own loop, in one process: each learner takes ``h``
    steps of plain_loop's AdamW on its own seeded windows, the mean delta takes one Nesterov step,
    every learner continues from the result (its AdamW moments and lr schedule carry on)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import plain_loop
    finally:
        sys.path.remove(str(EXAMPLES))
    steps = rounds * h
    models = [plain_loop.char_lm() for _ in range(learners)]
    glob = {n: p.detach().clone() for n, p in plain_loop.char_lm().named_parameters()}
    opts = [plain_loop.make_optimizer(m, steps) for m in models]
    gens = [torch.Generator().manual_seed(i) for i in range(learners)]
    data = plain_loop.corpus()
    buf: dict[str, torch.Tensor] = {}
    for _ in range(rounds):
        for _ in range(h):
            for m, (opt, schedule), g in zip(models, opts, gens, strict=True):
                x, y = plain_loop.next_batch(data, g)
                torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                schedule.step()
        for n in glob:
            delta = torch.zeros_like(glob[n])
            for m in models:
                delta.add_(glob[n] - dict(m.named_parameters())[n].detach(), alpha=1.0 / learners)
            buf[n] = delta.clone() if n not in buf else buf[n].mul(outer_mu).add_(delta)
            glob[n] = glob[n] - outer_lr * delta.add(buf[n], alpha=outer_mu)
        with torch.no_grad():
            for m in models:
                for n, p in m.named_parameters():
                    p.copy_(glob[n])
    return glob


def test_lockstep_user_loops_equal_synchronous_diloco_bit_for_bit(tmp_path: Path) -> None:
    rounds, learners = 3, 2
    url = to_url(str(tmp_path / "run"))
    subprocess.run([sys.executable, str(EXAMPLES / "plain_loop.py"), "--create", url, "--learners", str(learners),
                    "--rounds", str(rounds), "--lockstep"], check=True, env=env())
    store = RunReader.open(url)
    h = store.config.inner_steps
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []
    with LocalRun(url, log_dir=logs, extra_env={"PYTHONPATH": env()["PYTHONPATH"]}) as run:
        for i in range(learners):
            with open(logs / f"user-{i}.log", "ab") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, str(EXAMPLES / "plain_loop.py"), "--seed", str(i), "--max-steps", str(rounds * h)],
                    stdout=out, stderr=subprocess.STDOUT,
                    env={**env(), "ATOLL_RUN_URL": url, "ATOLL_LEARNER_ID": f"learner-{i}"}))
        sync = run.start_synchronizer()
        assert sync.wait(timeout=180) == 0, (logs / "synchronizer.log").read_text()[-3000:]
        for i, p in enumerate(procs):
            assert p.wait(timeout=60) == 0, (logs / f"user-{i}.log").read_text()[-3000:]
    assert [len(r.accepted) for r in store.history()] == [learners] * rounds
    got = store.read_global_state().params
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the learner processes ran with one thread each
    try:
        want = reference_lockstep(rounds, learners, h, store.config.outer_lr, store.config.outer_momentum)
    finally:
        torch.set_num_threads(threads)
    for n in want:
        assert torch.equal(got[n], want[n]), (n, (got[n] - want[n]).abs().max())


def test_a_torchrun_ddp_user_loop_is_one_island_rank_0_does_the_io(tmp_path: Path) -> None:
    """examples/ddp_loop.py under torchrun (2 gloo ranks) next to a 1-rank user loop: both merged,
    the island counted with both ranks' tokens, every rank ends with the same weights."""
    url = to_url(str(tmp_path / "run"))
    subprocess.run([sys.executable, str(EXAMPLES / "ddp_loop.py"), "--create", url, "--ranks", "2",
                    "--rounds", "30"], check=True, env=env())
    store = RunReader.open(url)
    logs = tmp_path / "logs"
    logs.mkdir()
    with LocalRun(url, log_dir=logs, extra_env={"PYTHONPATH": env()["PYTHONPATH"]}) as run:
        with open(logs / "island.log", "ab") as out:
            island = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(EXAMPLES / "ddp_loop.py")],
                stdout=out, stderr=subprocess.STDOUT,
                env={**env(), "ATOLL_RUN_URL": url, "ATOLL_LEARNER_ID": "learner-0"})
        wait_for(lambda: "learner-0: joined" in (logs / "island.log").read_text(), 120, "the island to join", [island])
        user = user_loop(url, "learner-1", logs / "user.log")
        try:
            # Both training before the first round: 30 rounds pass in seconds once they start.
            wait_for(lambda: "learner-1: joined" in (logs / "user.log").read_text(), 120, "the user loop to join",
                     [island, user])
            sync = run.start_synchronizer()
            assert sync.wait(timeout=240) == 0, (logs / "synchronizer.log").read_text()[-3000:]
            assert island.wait(timeout=120) == 0, (logs / "island.log").read_text()[-3000:]
            assert user.wait(timeout=120) == 0, (logs / "user.log").read_text()[-3000:]
        finally:
            for p in (island, user):
                if p.poll() is None:
                    p.kill()
    out = (logs / "island.log").read_text()
    assert "rank 0: exit finished" in out and "rank 1: exit finished" in out, out[-2000:]
    assert out.count("ranks identical: True") == 2, out[-2000:]
    island_merges = [a for r in store.history() for a in r.accepted if a.learner_id == "learner-0"]
    assert len(island_merges) >= 2
    assert "aligned 0" not in out  # both ranks took rank 0's adopted fragments
    assert all(a.c_tokens == a.c_steps * 2 * 8 * 32 for a in island_merges)  # both ranks' tokens
    assert any(a.learner_id == "learner-1" for r in store.history() for a in r.accepted)


@pytest.mark.parametrize("example,package", [("hf_trainer.py", "transformers"), ("lightning_loop.py", "lightning")])
def test_framework_callbacks_make_a_trainer_a_learner(tmp_path: Path, example: str, package: str) -> None:
    """examples/hf_trainer.py (transformers.Trainer + AtollCallback) and examples/lightning_loop.py
    (Lightning Trainer + AtollCallback): the trainer's steps are merged, and it stops when the run
    is finished (the callback asks the trainer to stop, then saves)."""
    pytest.importorskip(package)
    url = to_url(str(tmp_path / "run"))
    subprocess.run([sys.executable, str(EXAMPLES / example), "--create", url, "--learners", "2", "--rounds", "10"],
                   check=True, env=env(), capture_output=True)
    store = RunReader.open(url)
    logs = tmp_path / "logs"
    logs.mkdir()
    with LocalRun(url, log_dir=logs, extra_env={"PYTHONPATH": env()["PYTHONPATH"]}) as run:
        with open(logs / "trainer.log", "ab") as out:
            trainer = subprocess.Popen([sys.executable, str(EXAMPLES / example), "--out", str(tmp_path / "out")]
                                       if example == "hf_trainer.py" else [sys.executable, str(EXAMPLES / example)],
                                       stdout=out, stderr=subprocess.STDOUT,
                                       env={**env(), "ATOLL_RUN_URL": url, "ATOLL_LEARNER_ID": "learner-0"})
        try:
            wait_for(lambda: "learner-0: joined" in (logs / "trainer.log").read_text(), 120, "the trainer to join",
                     [trainer])
            sync = run.start_synchronizer()
            assert sync.wait(timeout=180) == 0, (logs / "synchronizer.log").read_text()[-3000:]
            assert trainer.wait(timeout=120) == 0, (logs / "trainer.log").read_text()[-3000:]
        finally:
            if trainer.poll() is None:
                trainer.kill()
    log = (logs / "trainer.log").read_text()
    assert "exit: finished" in log, log[-2000:]
    assert sum(a.learner_id == "learner-0" for r in store.history() for a in r.accepted) == 10
    saved = store.load_learner_state("learner-0")
    assert saved is not None and any(k.endswith(".exp_avg") for k in saved.tensors)
