"""Suite-wide settings, and the tier every test lands in.

One torch thread per test process: CI has 2 cores, and several tests start learner processes
(each with one thread) beside the test process; oversubscribed OpenMP threads spin and make the
suite many times slower without making any single test faster.

Tiers
-----
Each test gets its tier markers here, at collection, from what it uses (its fixtures, its
parameters, its folder, the IN_BODY table below), never from its body:

``server``
    It needs a server. A Prefect server: the ``prefect_harness`` fixture and every fixture built
    on it, and all of tests/integration (whole local stacks). An S3 or GCS endpoint: the
    ``moto_endpoint``, ``gcs_endpoint``, ``hostile_moto_endpoint`` and ``s3`` fixtures, the "s3"
    and "gcs" parameters of the ``backend`` and ``hostile_backend`` fixtures, and the modules that
    start one in their tests' bodies (IN_BODY).
``processes``
    It starts OS processes: learners, a local run, an island's ranks, the CLI or an example in a
    subprocess (IN_BODY, by module or by test).
``slow``
    Marked so in its own file (long single cases).
``fast``
    None of the above: the unit tests, the pure core and policies, storage on the memory and local
    backends, the data and model code, the CLI's in-process handlers. ``make test-fast`` runs
    ``pytest -m fast``, the inner loop. While it runs, a test that starts a process although its
    tier says fast fails the run, naming the test to add to IN_BODY (an audit hook watches).

``make test`` runs every tier with every assertion, on pytest-xdist workers with ``--dist
loadgroup``. What several tests share and is dear to build stays on one worker through an
``xdist_group`` marker given here: the Prefect harness and the smoke run built on it (group
``prefect``), and each module with a module-scoped fixture (a group of its own: the chaos and
PostgreSQL integration tests, a module that trains a run once for all its tests). moto and the GCS
emulator are cheap: each worker that needs one starts its own. The long groups are queued first
(``GROUP_ORDER``), then the other groups, the tests that start servers or processes, and the fast
ones last, so the long ones run beside the rest instead of after it.
"""

from __future__ import annotations

import inspect
import os
import resource
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent

SERVER_FIXTURES = frozenset({"prefect_harness", "moto_endpoint", "gcs_endpoint", "hostile_moto_endpoint", "s3"})
"""Fixtures that start (or are) a Prefect server or an S3/GCS endpoint; a fixture that depends on
one (``smoke_run``, ``deployed``) puts it in the test's fixture closure too."""

REMOTE_BACKENDS = frozenset({"s3", "gcs"})
BACKEND_FIXTURES = ("backend", "hostile_backend", "readers")

SERVER_FOLDERS = ("integration",)
"""Folders (under tests/) all of whose tests run against a real stack."""

IN_BODY: dict[str, str] = {
    "cli/test_hostile_run_dirs.py::test_fifo_named_run_json_does_not_hang_status": "processes",
    "cli/test_hostile_run_dirs.py::test_fifo_named_run_json_does_not_hang_resume": "processes",
    "cli/test_hostile_run_dirs.py::test_fifo_as_a_commit_record": "processes",
    "cli/test_hostile_run_dirs.py::test_missing_run_through_a_real_process": "processes",
    "cli/test_stop.py": "processes",
    "cli/test_shutdown.py": "processes",
    # A fake client stands in for the launches, but the fleet still reaches Prefect's API.
    "flows/test_fleet_clock.py": "prefect",
    # Network namespaces with moto, a synchronizer and learners in them (benchmarks/wanlab.py).
    "lab/test_wan_lab.py": "server",
    "storage/test_contract.py::test_checkpoint_loads_with_plain_safetensors": "processes",
    "storage/test_real_errors.py": "server",
    "train/test_hook.py": "processes",
    "train/test_island.py": "processes",
    "train/test_lease.py::test_learner_processes_fencing_sigkill_staleness_and_sigterm": "processes",
    "train/test_local_run.py::test_a_dead_learner_is_restarted_and_merged_again_and_sigterm_stops_everything":
        "processes",
    "train/test_loops.py": "processes",
    "train/test_rejoin.py::test_sigkilled_learner_process_restarts_from_exactly_what_it_saved": "processes",
    "unit/test_overhead_benchmark.py::test_the_sampler_charges_a_child_s_cpu_to_its_role_even_after_it_exits":
        "processes",
    "unit/test_overhead_benchmark.py::test_pinning_moves_every_thread_of_a_learner_to_cpu_0_and_the_rest_off_it":
        "processes",
}
"""Tests that start a server or processes in their own bodies, where no fixture says so: a path
under tests/ (a module, or ``module::test`` for one test and all its parameters) -> "server",
"processes", or "prefect" (a server: Prefect's API, reached without asking for ``prefect_harness``;
such a test joins the ``prefect`` group, where the harness is up)."""

CHEAP_SHARED = frozenset({"moto_endpoint", "gcs_endpoint", "hostile_moto_endpoint"})
"""Fixtures of this suite wider than a test that cost too little to keep their tests on one worker:
each worker that needs one starts its own (in milliseconds)."""

SHARED_GROUPS = {"chaos": "stack", "postgres": "stack", "wan_lab": "lab"}
"""Modules whose tests run on one worker one after the other though they share no fixture: each
brings up a whole stack of its own (a Prefect server, workers, learner processes, network
namespaces), and two of them at once on 2 cores starve each other (the eight-learner PostgreSQL run
timed out beside the chaos run)."""

GROUP_ORDER = ("stack", "prefect", "lab")
"""Groups known to be long, queued first in this order; other groups follow, then single tests."""


def rel_nodeid(item: pytest.Item) -> str:
    """The test's node id relative to tests/ (pytest's is relative to where it was started)."""
    path = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
    return path + item.nodeid[item.nodeid.index("::"):] if "::" in item.nodeid else path


def _in_body(nodeid: str) -> str | None:
    for key, marker in IN_BODY.items():
        if nodeid == key or nodeid.startswith(key + "::") or nodeid.startswith(key + "["):
            return marker
    return None


def _tiers(item: pytest.Item, rel: str) -> set[str]:
    tiers: set[str] = set()
    names = set(getattr(item, "fixturenames", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    if names & SERVER_FIXTURES or rel.split("/", 1)[0] in SERVER_FOLDERS:
        tiers.add("server")
    if any(params.get(name) in REMOTE_BACKENDS for name in BACKEND_FIXTURES):
        tiers.add("server")
    in_body = _in_body(rel_nodeid(item))
    if in_body:
        tiers.add("server" if in_body == "prefect" else in_body)
    if item.get_closest_marker("slow"):
        tiers.add("slow")
    return tiers


def _group(item: pytest.Item, rel: str) -> str | None:
    """The xdist group of a test that shares a dear fixture wider than itself, else None."""
    stem = Path(rel).stem.removeprefix("test_")
    if stem in SHARED_GROUPS:
        return SHARED_GROUPS[stem]
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    if "prefect_harness" in item.fixturenames or _in_body(rel_nodeid(item)) == "prefect":
        return "prefect"
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        if not defs or name in CHEAP_SHARED or defs[-1].scope == "function":
            continue
        if TESTS in Path(inspect.getfile(defs[-1].func)).resolve().parents:  # not pytest's own
            return stem
    return None


CUDA_SKIP = ("needs CUDA: torch.cuda.is_available() is False here (torch {}, built with CUDA {}); "
             "`pytest -m cuda` or `make gpu-check` on a GPU machine runs it")
"""Why a test marked ``cuda`` is skipped on a machine without a CUDA device."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: runs on a CUDA device; skipped with the reason where there is none")
    if _selects_fast_only(config):
        config.pluginmanager.register(_ProcessGuard(), "atoll-process-guard")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups: dict[str, str] = {}
    cuda_skip = None if torch.cuda.is_available() else pytest.mark.skip(
        reason=CUDA_SKIP.format(torch.__version__, torch.version.cuda or "none"))
    for item in items:
        if cuda_skip is not None and item.get_closest_marker("cuda"):
            item.add_marker(cuda_skip)
        rel = rel_nodeid(item).split("::", 1)[0]
        tiers = _tiers(item, rel)
        for tier in sorted(tiers - {"slow"}):  # slow is marked in the test file already
            item.add_marker(tier)
        if not tiers:
            item.add_marker("fast")
        group = _group(item, rel)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            groups[item.nodeid] = group
            if group in SHARED_GROUPS.values():
                _pin_to_one_worker(config, item, group)
    if getattr(config.option, "dist", "no") != "no":
        # xdist hands out work units in this order (with --no-loadscope-reorder), one or two per
        # worker at a time: the long groups first, then other groups, then single tests that start
        # servers or processes, then the fast ones, so that no long test is left for the end.
        def rank(item: pytest.Item) -> int:
            group = groups.get(item.nodeid)
            if group in GROUP_ORDER:
                return GROUP_ORDER.index(group)
            if group is not None:
                return len(GROUP_ORDER)
            return len(GROUP_ORDER) + (2 if item.get_closest_marker("fast") else 1)

        items.sort(key=rank)


def _pin_to_one_worker(config: pytest.Config, item: pytest.Item, group: str) -> None:
    """pytest-xdist's loadgroup sends a group to one worker by a ``@group`` suffix of the node id,
    which it writes to ``item._nodeid``; pytest 9 keeps the node id in ``item._id``, so that suffix
    is lost and a group's tests spread over every worker. For the groups that must never run beside
    each other (SHARED_GROUPS) the suffix is written where pytest reads it."""
    if not getattr(config.option, "loadgroup", False) or not hasattr(item, "_id"):
        return
    if item.nodeid.rfind("@") > item.nodeid.rfind("]"):
        return  # xdist's own suffix took
    from _pytest.nodeid import coerce_node_id

    item._id = coerce_node_id(f"{item.nodeid}@{group}")


def _selects_fast_only(config: pytest.Config) -> bool:
    return (config.getoption("markexpr", "") or "").strip() == "fast"


class _ProcessGuard:
    """Fails a fast-tier test that started a process (then it belongs in IN_BODY): seen through the
    interpreter's audit events (subprocess, fork, exec, spawn), the CPU time of reaped children
    (torch.multiprocessing's spawn raises no audit event) and children still alive at its end."""

    EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
                        "os.system"})

    def __init__(self) -> None:
        # matplotlib runs fc-list to list the system fonts the first time it is imported on a
        # machine (then it keeps a cache): do that now, so the first plotting test is not blamed.
        try:
            import matplotlib.font_manager  # noqa: F401
        except ImportError:
            pass
        self.current: str | None = None
        self.seen: dict[str, str] = {}
        self.before: tuple[float, set[int]] = (0.0, set())
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple[object, ...]) -> None:
        if self.current is not None and event in self.EVENTS and self.current not in self.seen:
            what = args[1] if event == "subprocess.Popen" and len(args) > 1 else args
            self.seen[self.current] = f"{event} {str(what)[:160]}"

    @staticmethod
    def _children() -> tuple[float, set[int]]:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime, _children_of(os.getpid())

    @pytest.hookimpl(tryfirst=True)  # before its fixtures are set up
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.current, self.before = item.nodeid, self._children()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome = yield
        if call.when != "teardown":
            return
        self.current = None
        cpu_s, alive = self._children()
        started = self.seen.get(item.nodeid)
        if started is None and cpu_s > self.before[0]:
            started = f"a child process used {cpu_s - self.before[0]:.2f} s of CPU"
        if started is None and alive - self.before[1]:
            started = f"child processes still alive: {sorted(alive - self.before[1])}"
        report = outcome.get_result()  # type: ignore[attr-defined]
        if started is not None and item.get_closest_marker("fast") and report.passed:
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} is in the fast tier but started a process ({started}): "
                               f"list it in IN_BODY in tests/conftest.py")


def _children_of(pid: int) -> set[int]:
    """Live child processes of ``pid`` (Linux /proc; elsewhere none)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out
