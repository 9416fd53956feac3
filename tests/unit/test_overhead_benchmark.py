"""benchmarks/overhead.py without a run: the CPU attribution by role (a real child process burns a
known amount of CPU) and its table. The benchmark itself runs a Prefect stack for ~10 minutes."""

from __future__ import annotations

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
