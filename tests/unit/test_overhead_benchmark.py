"""benchmarks/overhead.py without a run: the CPU attribution by role (a real child process burns a
known amount of CPU) and its table. The benchmark itself runs a Prefect stack for ~10 minutes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def overhead(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import overhead

    yield overhead
    sys.modules.pop("overhead", None)


def test_roles_come_from_the_command_line(overhead) -> None:
    assert overhead._role(1, "python -m prefect server start --port 4200") == "Prefect server"
    assert overhead._role(1, "python -m prefect worker start --pool cpu-fast") == "workers"
    assert overhead._role(1, "postgres: atoll prefect 127.0.0.1 idle") == "database"
    assert overhead._role(1, "python -m atoll.train.local learner run --learner-id learner-0") == "learners"
    assert overhead._role(1, "sleep 5") == "other"
    # Flow runs all look alike: the bucket's leases say which are learners.
    assert overhead._role(7, "python -m prefect.engine", {7: "learners"}) == "learners"
    assert overhead._role(8, "python -m prefect.engine", {7: "learners"}) == "synchronizer"


def test_the_sampler_charges_a_child_s_cpu_to_its_role_even_after_it_exits(overhead) -> None:
    with overhead.CpuSampler(every_s=0.05) as cpu:
        t0 = time.time()
        time.sleep(0.2)
        burn = subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                               "while time.process_time() - t < 0.5: pass"], check=True)
        assert burn.returncode == 0
        time.sleep(0.2)
        t1 = time.time()
    cores = cpu.cores(t0, t1)
    assert set(cores) == set(overhead.ROLES)
    # The child burned 0.5 s of CPU (less the last sampling interval before it exited).
    assert 0.3 <= cores["other"] * (t1 - t0) <= 0.8, cores  # + its interpreter start-up


def test_the_cpu_table_has_a_row_per_runner_and_a_total(overhead) -> None:
    r = overhead.Result("plain (atoll.train)", 10, 60.0, 1000.0, 0.3, 0.2, 0.05, 8, 4.4,
                        cores={"learners": 1.5, "synchronizer": 0.25})
    text = overhead.cpu_table([r])
    assert "Prefect server" in text.splitlines()[0]
    assert text.splitlines()[1].split()[-1] == "1.75"


def test_the_wire_table_puts_the_plan_beside_what_crossed_the_wire(overhead) -> None:
    from atoll.core.config import DilocoConfig
    from atoll.sim.planner import plan_wire
    from atoll.storage.wire import WireCounts

    plan = plan_wire(DilocoConfig(num_learners=2, num_fragments=2, inner_steps=4), params=1000, tokens_per_step=10,
                     tensors=2)
    wire = overhead.WireFigures(rounds=4, learners=WireCounts(puts=16, gets=20, bytes_up=8000, bytes_down=12000),
                                synchronizer=WireCounts(gets=40, lists=8, bytes_up=4000, bytes_down=16000),
                                learner_tokens=160, planned=plan)
    r = overhead.Result("plain (atoll.train)", 10, 60.0, 1000.0, 0.3, 0.2, 0.05, 8, 4.4, wire=wire)
    rows = [line.split() for line in overhead.wire_table([r]).splitlines()[1:]]
    # Per round: 36 requests / 4, 8000 B / 4 up, 12000 B / 4 down; (8000 + 12000) / 160 tokens.
    assert rows[0][2:] == ["learners", "9.0", "2,000", "3,000", "125.0",
                           f"{plan.up_bytes_per_token + plan.down_bytes_per_token:.1f}"]
    sync_planned = (plan.sync_up_bytes_per_round + plan.sync_down_bytes_per_round) / (2 * 2 * 10)
    assert rows[1][2:] == ["synchronizer", "12.0", "1,000", "4,000", "125.0", f"{sync_planned:.1f}"]


def test_the_summary_takes_each_ratio_against_its_own_plain_run(overhead) -> None:
    def run(name: str, tok: float, learners: float, eff_h: float):
        return overhead.Result(name, 10, 60.0, tok, 0.3, 0.2, 0.05, 8, eff_h, cores={"learners": learners})

    reps = [[run("plain", 1000.0, 1.0, 5.0), run("prefect", 900.0, 0.9, 4.0)],
            [run("plain", 2000.0, 1.0, 5.0), run("prefect", 1960.0, 1.0, 4.4)],
            [run("plain", 1000.0, 1.0, 5.0), run("prefect", 950.0, 1.0, 4.2)]]
    line = overhead.summary_table(reps).splitlines()[-1].split()
    # Ratios 0.9, 0.98, 0.95 (never against another repetition's plain run); median 0.95.
    assert line[:5] == ["prefect", "0.900,", "0.980,", "0.950", "0.950x"]
    assert line[5:9] == ["4.0,", "4.4,", "4.2", "4.2"]
    # Per learner core: 0.9 / 0.9 = 1.0, 0.98, 0.95 -> median 0.98.
    assert line[-1] == "0.980x"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux CPU affinity and two CPUs")
def test_pinning_moves_every_thread_of_a_learner_to_cpu_0_and_the_rest_off_it(overhead) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
                              "time.sleep(30)"])
    try:
        time.sleep(0.5)
        sampler = overhead.CpuSampler(pin=True)
        sampler._pin(child.pid, "learners")
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) == 2 and all(os.sched_getaffinity(t) == {0} for t in tids)
        sampler._pin(child.pid, "Prefect server")
        assert all(0 not in os.sched_getaffinity(t) for t in tids)
    finally:
        child.kill()
        child.wait()
