"""The WAN lab: sites on shaped links around a cloud, in network namespaces on this one machine.

Used by ``benchmarks/wan.py`` and ``tests/lab/test_wan_lab.py``. Linux, as root (``ip netns``,
veth pairs, a bridge, ``tc`` with ``tbf``); :func:`unavailable` says why a machine cannot host it.

Topology (every address is private to the lab; nothing here routes off the machine)::

    root namespace (the driver: creates runs, reads the bucket, reads Prefect's API)
        | ctl veth (unshaped)
    cloud namespace  br0 10.X.Y.1/24 (+ 10.X.Y.2/32, the bucket's address for the sites)
        |  moto's S3 server (the bucket), the Prefect server, the synchronizer / training run
        |
        +-- veth, tbf both ways -- site s0 namespace: wan0 10.X.Y.10 (worker, learners, a DDP rank)
        +-- veth, tbf both ways -- site s1 namespace: wan0 10.X.Y.11
        ...

* **Bandwidth**: a ``tbf`` qdisc on both ends of a site's veth (the site end shapes its uplink, the
  cloud end its downlink): :meth:`Lab.shape`. Traffic between two sites (DDP's all-reduce) crosses
  both sites' links, like two regions talking through the WAN.
* **Latency**: this kernel has no ``netem``, so the lab adds none on the wire. Atoll's processes
  can get a per-call storage delay from atoll's own fault hook (``ATOLL_FAULT_STORAGE`` with
  ``latency_s``: uniform in [0, latency_s] per object-store call): :func:`storage_latency_env`.
  DDP gets no added latency, which only flatters DDP.
* **Bytes on the wire** per site: the kernel's counters of the site's ``wan0`` (:meth:`Lab.counters`).
* **Partitions**: :meth:`Lab.link_down` takes the cloud end of a site's veth down (the site sees
  no carrier; its connections fail or time out). **Bucket outage**: :meth:`Lab.bucket_down`
  removes the bucket's address (sites reach the bucket only there; the cloud's own processes use
  the loopback and keep it). **Prefect outage**: stop the server process and start it again.
* **Clocks**: :meth:`Lab.popen` with ``clock_skew="+10m"`` runs a process under libfaketime
  (every process it starts inherits it), shifting its wall clock; monotonic clocks stay true.

Cleanup: :meth:`Lab.stop` (also on ``with`` exit, ``atexit``, SIGTERM and SIGHUP when
``trap_signals``) kills every process inside the lab's namespaces by pid, then deletes the
namespaces and the ctl veth. A driver that was SIGKILLed leaves them behind: every new lab first
removes the leftovers of labs whose driver process is gone (:func:`clean_leftovers`; names carry
the driver's pid), and never touches a live lab's.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Lab",
    "SiteSpec",
    "Moto",
    "LabStack",
    "unavailable",
    "faketime_library",
    "clean_leftovers",
    "storage_latency_env",
    "s3_env",
    "s3_options",
    "BUCKET",
]

NS_PREFIX = "awl"
"""Namespaces are ``awl-<driver pid>-<n>-cloud`` and ``awl-<driver pid>-<n>-<site>``; the root
namespace's end of the ctl veth is ``aw<pid>n<n>``."""
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-(\d+)-")
_LINK_RE = re.compile(r"^aw(\d+)n(\d+)$")
SITE_DEV = "wan0"
"""A site's interface (inside its namespace); DDP's ``GLOO_SOCKET_IFNAME``."""
BUCKET = "atoll-wan"
MOTO_PORT = 9000
MOTO_S3 = Path(__file__).resolve().parents[1] / "tests" / "moto_s3.py"
"""moto's S3 server with atomic create-once (plain moto lets two racing creates of a key both win)."""
PREFECT_PORT = 4200
LOCK_FILE = Path("/run/lock/atoll-wanlab.lock")
FAKETIME_LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/faketime/libfaketimeMT.so.1")


@dataclass(frozen=True, kw_only=True)
class SiteSpec:
    """One site: a namespace with its own link to the cloud."""

    name: str
    """Short name (letters and digits, at most 6): names its namespace and its Prefect pool."""
    rate_mbit: float | None = None
    """Bandwidth of the site's link in each direction, Mbit/s (None: unshaped)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", self.name):
            raise ValueError(f"site name {self.name!r}: 1-6 lowercase letters or digits, a letter first")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable() -> str | None:
    """Why this machine cannot host the lab (None: it can)."""
    if not sys.platform.startswith("linux"):
        return "the WAN lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the WAN lab needs root (ip netns, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN lab needs `{tool}` (iproute2)"
    probe = f"{NS_PREFIX}-{os.getpid()}-probe-x"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        # tbf is what shapes the links: a kernel without sch_tbf cannot run the lab.
        _run("ip", "-n", probe, "link", "add", "d0", "type", "veth", "peer", "name", "d1", check=False)
        tbf = _run("tc", "-n", probe, "qdisc", "add", "dev", "d0", "root", "tbf", "rate", "1mbit", "burst", "32kb",
                   "latency", "50ms", check=False)
        if tbf.returncode != 0:
            return f"tc tbf does not work here: {tbf.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def faketime_library() -> str | None:
    """libfaketime's multi-threaded preload library (Debian's ``faketime`` package), or None."""
    return next((p for p in FAKETIME_LIBS if Path(p).exists()), None)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _netns_names() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_processes(ns: str, grace_s: float) -> None:
    """SIGTERM every process inside ``ns`` (by pid), wait up to ``grace_s``, then SIGKILL the rest."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)


def clean_leftovers(log: Any = None) -> list[str]:
    """Remove what labs whose driver process is gone left behind (their processes, namespaces and
    ctl veths); a live lab's are never touched. Returns the names removed."""
    removed = []
    for ns in _netns_names():
        m = _NS_RE.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_netns_processes(ns, 2.0)
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    links = json.loads(_run("ip", "-j", "link", "show", check=False).stdout or "[]")
    for link in links:
        name = str(link.get("ifname", ""))
        m = _LINK_RE.match(name)
        if m and not _alive(int(m.group(1))):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    if removed and log:
        log(f"wan lab: removed leftovers of dead labs: {', '.join(removed)}")
    return removed


def _used_subnets() -> set[str]:
    routes = json.loads(_run("ip", "-j", "route", "show", check=False).stdout or "[]")
    return {str(r.get("dst", "")) for r in routes}


def storage_latency_env(latency_ms: float) -> dict[str, str]:
    """Atoll's storage fault hook as the lab's latency: every object-store call of the process
    first sleeps uniformly in [0, 2 x latency_ms] (mean ``latency_ms``); no injected errors."""
    if latency_ms <= 0:
        return {}
    return {"ATOLL_FAULT_STORAGE": f"latency_s={2 * latency_ms / 1000:.4f}"}


def s3_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1"}


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


@dataclass
class _Proc:
    where: str
    name: str
    popen: subprocess.Popen[bytes]


@dataclass
class Lab:
    """A cloud namespace and one namespace per site, linked by shaped veths (see the module docstring).

    ``with Lab([SiteSpec(name="s0", rate_mbit=20), ...]) as lab:`` builds it and tears it all down."""

    sites: Sequence[SiteSpec]
    log_dir: Path | None = None
    trap_signals: bool = False
    """Install SIGTERM/SIGHUP handlers that unwind (and so tear down) while the lab is up: for
    scripts; a test's finalizer does that instead."""
    log: Any = None
    """A callable taking a line, or None."""
    tag: str = ""
    procs: list[_Proc] = field(default_factory=list)
    subnet: str = ""
    _started: bool = False
    _previous_handlers: dict[int, Any] = field(default_factory=dict)

    _counter = 0

    def __post_init__(self) -> None:
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names) or "cloud" in names:
            raise ValueError(f"site names must be unique and not 'cloud': {names}")
        Lab._counter += 1
        self.tag = f"{os.getpid()}-{Lab._counter}"
        self.rates: dict[str, float | None] = {s.name: s.rate_mbit for s in self.sites}

    # -- names and addresses ---------------------------------------------------------------------
    def ns(self, where: str) -> str:
        """The namespace of ``"cloud"`` or of a site."""
        return f"{NS_PREFIX}-{self.tag}-{where}"

    @property
    def ctl_link(self) -> str:
        pid, n = self.tag.split("-")
        return f"aw{pid}n{n}"

    def _ip(self, host: int) -> str:
        return self.subnet.rsplit(".", 1)[0] + f".{host}"

    @property
    def cloud_ip(self) -> str:
        """The cloud's address: the Prefect server, and the bucket for the driver."""
        return self._ip(1)

    @property
    def bucket_ip(self) -> str:
        """The bucket's address as the sites reach it (removed by :meth:`bucket_down`)."""
        return self._ip(2)

    def site_ip(self, site: str) -> str:
        return self._ip(10 + self._index(site))

    def _index(self, site: str) -> int:
        return [s.name for s in self.sites].index(site)

    def _peer(self, site: str) -> str:
        """The cloud end of ``site``'s veth (inside the cloud namespace)."""
        return f"to-{site}"

    def _say(self, text: str) -> None:
        if self.log:
            self.log(text)

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> Lab:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        clean_leftovers(self._say)
        self._started = True
        atexit.register(self.stop)
        if self.trap_signals:
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._previous_handlers[sig] = signal.signal(sig, _unwind)
        try:
            LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
            with open(LOCK_FILE, "w") as lock:  # two labs starting at once pick different subnets
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.subnet = self._free_subnet()
                self._build()
        except BaseException:
            self.stop()
            raise
        self._say(f"wan lab {self.tag}: cloud {self.cloud_ip}, sites "
                  + ", ".join(f"{s.name} {self.site_ip(s.name)} {_rate(s.rate_mbit)}" for s in self.sites))
        return self

    def _free_subnet(self) -> str:
        used = _used_subnets()
        pid, n = (int(x) for x in self.tag.split("-"))
        for k in range(4096):
            h = (pid * 31 + n * 7 + k) % 4096
            candidate = f"10.{200 + h // 256}.{h % 256}.0/24"
            if candidate not in used:
                return candidate
        raise RuntimeError("no free 10.200-215.x.0/24 subnet for the lab")

    def _build(self) -> None:
        cloud = self.ns("cloud")
        _run("ip", "netns", "add", cloud)
        _run("ip", "-n", cloud, "link", "set", "lo", "up")
        _run("ip", "-n", cloud, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", cloud, "addr", "add", f"{self.cloud_ip}/24", "dev", "br0")
        _run("ip", "-n", cloud, "addr", "add", f"{self.bucket_ip}/32", "dev", "br0")
        _run("ip", "-n", cloud, "link", "set", "br0", "up")
        pid, n = self.tag.split("-")
        for i, site in enumerate(self.sites):
            ns = self.ns(site.name)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            a, b = f"aw{pid}{n}a{i}", f"aw{pid}{n}b{i}"
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _run("ip", "link", "set", a, "netns", ns)
            _run("ip", "link", "set", b, "netns", cloud)
            _run("ip", "-n", ns, "link", "set", a, "name", SITE_DEV)
            _run("ip", "-n", cloud, "link", "set", b, "name", self._peer(site.name))
            _run("ip", "-n", ns, "addr", "add", f"{self.site_ip(site.name)}/24", "dev", SITE_DEV)
            _run("ip", "-n", cloud, "link", "set", self._peer(site.name), "master", "br0")
            _run("ip", "-n", ns, "link", "set", SITE_DEV, "up")
            _run("ip", "-n", cloud, "link", "set", self._peer(site.name), "up")
            self.shape(site.name, site.rate_mbit)
        # The driver's own, unshaped way in (root namespace <-> the cloud's bridge).
        _run("ip", "link", "add", self.ctl_link, "type", "veth", "peer", "name", f"aw{pid}{n}c")
        _run("ip", "link", "set", f"aw{pid}{n}c", "netns", cloud)
        _run("ip", "-n", cloud, "link", "set", f"aw{pid}{n}c", "name", "ctl")
        _run("ip", "-n", cloud, "link", "set", "ctl", "master", "br0")
        _run("ip", "-n", cloud, "link", "set", "ctl", "up")
        _run("ip", "addr", "add", f"{self._ip(254)}/24", "dev", self.ctl_link)
        _run("ip", "link", "set", self.ctl_link, "up")

    def stop(self, grace_s: float = 10.0) -> None:
        """Every process in the lab's namespaces (by pid), then the namespaces and the ctl veth.
        Safe to call twice, and on a lab that failed half way through starting."""
        if not self._started:
            return
        self._started = False
        for p in self.procs:  # ours first, as a group (a process may have left a child behind)
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
        wheres = [*(s.name for s in self.sites), "cloud"]
        for where in wheres:
            _kill_netns_processes(self.ns(where), grace_s)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)
        for where in wheres:
            _run("ip", "netns", "del", self.ns(where), check=False)
        _run("ip", "link", "del", self.ctl_link, check=False)  # its peer went with the cloud (eventually)
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        self._say(f"wan lab {self.tag}: torn down")

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def leftovers(self) -> list[str]:
        """This lab's namespaces and links that still exist (empty once it is torn down)."""
        mine = [ns for ns in _netns_names() if ns.startswith(f"{NS_PREFIX}-{self.tag}-")]
        link = _run("ip", "link", "show", self.ctl_link, check=False)
        return mine + ([self.ctl_link] if link.returncode == 0 else [])

    # -- the links ------------------------------------------------------------------------------------
    def shape(self, site: str, rate_mbit: float | None) -> None:
        """Both directions of ``site``'s link to ``rate_mbit`` Mbit/s (None: unshaped)."""
        ends = ((self.ns(site), SITE_DEV), (self.ns("cloud"), self._peer(site)))
        for ns, dev in ends:
            if rate_mbit is None:
                _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
                continue
            rate_bytes = rate_mbit * 1e6 / 8
            # Burst: 4 ms at the rate, at least 64 KiB (a GSO super-packet must fit in the bucket).
            burst = max(64 << 10, int(rate_bytes * 0.004))
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                 "burst", str(burst), "latency", "100ms")
        self.rates[site] = rate_mbit

    def qdisc(self, site: str) -> list[str]:
        """The root qdiscs of both ends of ``site``'s link, as ``tc`` prints them (site end first)."""
        out = []
        for ns, dev in ((self.ns(site), SITE_DEV), (self.ns("cloud"), self._peer(site))):
            out.append(_run("tc", "-n", ns, "qdisc", "show", "dev", dev, "root").stdout.strip())
        return out

    def link_down(self, site: str) -> None:
        """Cut ``site`` off: the cloud end of its veth goes down (the site sees no carrier)."""
        _run("ip", "-n", self.ns("cloud"), "link", "set", self._peer(site), "down")

    def link_up(self, site: str) -> None:
        _run("ip", "-n", self.ns("cloud"), "link", "set", self._peer(site), "up")

    def bucket_down(self) -> None:
        """No site reaches the bucket (its address is gone); the cloud's processes still do."""
        _run("ip", "-n", self.ns("cloud"), "addr", "del", f"{self.bucket_ip}/32", "dev", "br0")

    def bucket_up(self) -> None:
        _run("ip", "-n", self.ns("cloud"), "addr", "add", f"{self.bucket_ip}/32", "dev", "br0")

    def counters(self, site: str) -> tuple[int, int]:
        """(bytes sent, bytes received) by ``site``'s interface so far (the kernel's counters)."""
        info = json.loads(_run("ip", "-n", self.ns(site), "-j", "-s", "link", "show", SITE_DEV).stdout)[0]
        stats = info.get("stats64", info.get("stats", {}))
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    # -- processes --------------------------------------------------------------------------------------
    def popen(self, where: str, argv: Sequence[str], *, name: str, env: Mapping[str, str] | None = None,
              clock_skew: str | None = None, cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``where`` (``"cloud"`` or a site), in a session of its own, with
        ``os.environ`` plus ``env``; its output goes to ``<log_dir>/<name>.log``. ``clock_skew``
        (libfaketime's syntax, e.g. ``"+10m"``, ``"-600s"``) shifts its wall clock and its children's."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(env or {})}
        if clock_skew:
            lib = faketime_library()
            if lib is None:
                raise RuntimeError("clock skew needs libfaketime (apt-get install faketime)")
            full_env.update({"LD_PRELOAD": lib, "FAKETIME": clock_skew, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                             "FAKETIME_NO_CACHE": "1"})
        out: Any = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps its own copy
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(where), *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=full_env, start_new_session=True, cwd=cwd)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        self.procs.append(_Proc(where, name, proc))
        return proc

    def pids(self, where: str) -> list[int]:
        """Processes inside ``where``'s namespace right now."""
        return [int(p) for p in _run("ip", "netns", "pids", self.ns(where), check=False).stdout.split() if p.isdigit()]

    def log_tail(self, chars: int = 3000, skip: Sequence[str] = ("moto",)) -> str:
        """The end of every process's log (moto's request lines left out)."""
        if self.log_dir is None:
            return ""
        parts = []
        for f in sorted(self.log_dir.glob("*.log")):
            if f.stem not in skip:
                parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)


def _rate(rate_mbit: float | None) -> str:
    return "unshaped" if rate_mbit is None else f"{rate_mbit:g} Mbit/s"


def _unwind(signum: int, frame: Any) -> None:
    print(f"wan lab: got signal {signum} (from outside); tearing the lab down", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()  # noqa: S310 - the lab's own address
            return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"nothing answers at {url}") from None
            time.sleep(0.3)


class Moto:
    """moto's S3 server inside the cloud namespace: the bucket. The cloud's processes reach it on
    its loopback (:attr:`cloud_endpoint`), the sites at the bucket's address (:attr:`site_endpoint`),
    the driver at the cloud's address (:attr:`driver_endpoint`)."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.proc = lab.popen("cloud", [sys.executable, str(MOTO_S3), "-H", "0.0.0.0", "-p", str(MOTO_PORT)],
                              name="moto")
        self.cloud_endpoint = f"http://127.0.0.1:{MOTO_PORT}"
        self.site_endpoint = f"http://{lab.bucket_ip}:{MOTO_PORT}"
        self.driver_endpoint = f"http://{lab.cloud_ip}:{MOTO_PORT}"
        wait_http(self.driver_endpoint, 90.0, self.proc)
        import boto3

        boto3.client("s3", endpoint_url=self.driver_endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=BUCKET)

    def env(self, where: str) -> dict[str, str]:
        """S3 settings for a process in ``where`` (``"cloud"``, ``"driver"`` or a site)."""
        endpoint = {"cloud": self.cloud_endpoint, "driver": self.driver_endpoint}.get(where, self.site_endpoint)
        return s3_env(endpoint)

    def options(self) -> dict[str, Any]:
        """fsspec storage options for the driver."""
        return s3_options(self.driver_endpoint)


def _stack_class() -> Any:
    from atoll.ops.stack import LocalStack

    class _LabStack(LocalStack):
        """atoll's local stack with its server in the lab's cloud and each pool's worker in a
        namespace of the lab (``placement[pool]``): a site's worker, and the flow runs it starts
        (its learners), live and talk over that site's link."""

        def __init__(self, lab: Lab, placement: Mapping[str, str], *, clock_skew: Mapping[str, str] | None = None,
                     site_env: Mapping[str, Mapping[str, str]] | None = None, **kwargs: Any) -> None:
            super().__init__(host=lab.cloud_ip, port=PREFECT_PORT, pools=list(placement), **kwargs)
            self.lab, self.placement = lab, dict(placement)
            self.clock_skew = dict(clock_skew or {})
            self.site_env = {k: dict(v) for k, v in (site_env or {}).items()}

        def _popen(self, args: list[str], name: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
            where = "cloud"
            if name.startswith("worker-"):
                where = self.placement[name.removeprefix("worker-")]
            env = {**dict(env), **self.site_env.get(where, {})}
            if name == "server":  # it listens on the cloud's address; the driver reaches it over ctl
                return self.lab.popen("cloud", args, name=name, env=env)
            return self.lab.popen(where, args, name=name, env=env, clock_skew=self.clock_skew.get(where))

        def stop_server(self, timeout_s: float = 30.0) -> None:
            """Stop only the Prefect server (an outage); :meth:`start_server` brings it back."""
            if self.server is not None and self.server.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.server.pid, signal.SIGTERM)
                try:
                    self.server.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.server.pid, signal.SIGKILL)
                    self.server.wait(timeout=10)

    return _LabStack


def LabStack(lab: Lab, placement: Mapping[str, str], **kwargs: Any) -> Any:  # noqa: N802 - a class, built lazily
    """A :class:`atoll.ops.stack.LocalStack` whose server runs in the lab's cloud and whose pool
    ``p``'s worker runs in ``placement[p]`` (the cloud or a site). Imported lazily: Prefect is slow
    to import and the lab's plumbing does not need it."""
    return _stack_class()(lab, placement, **kwargs)


class LabRun:
    """An atoll run in the lab without Prefect (``python -m atoll.train.local``): the synchronizer
    in the cloud, learner ``l`` at site ``placement[l]``, each a process of its own.

    ``learners`` and :meth:`start_learner` are what :class:`atoll.train.local.LearnerRestarts`
    drives, so :meth:`restart_dead` relaunches a learner that exited (it rejoins from the bucket)."""

    def __init__(self, lab: Lab, moto: Moto, url: str, placement: Mapping[str, str], *,
                 env: Mapping[str, str] | None = None, clock_skew: Mapping[str, str] | None = None,
                 learner_args: Sequence[str] = (), synchronizer_args: Sequence[str] = ()) -> None:
        from atoll.train.local import LearnerRestarts

        self.lab, self.moto, self.url = lab, moto, url
        self.placement = dict(placement)
        self.env = dict(env or {})
        self.clock_skew = dict(clock_skew or {})
        self.learner_args, self.synchronizer_args = list(learner_args), list(synchronizer_args)
        self.learners: dict[str, subprocess.Popen[bytes]] = {}
        self.starts: dict[str, int] = {}
        self.synchronizer: subprocess.Popen[bytes] | None = None
        self.restarts = LearnerRestarts(self, log=lab._say)  # type: ignore[arg-type]

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "atoll.train.local", *args]

    def start_synchronizer(self) -> subprocess.Popen[bytes]:
        self.synchronizer = self.lab.popen(
            "cloud", self._cmd("synchronizer", self.url, "--threads", "1", *self.synchronizer_args),
            name="synchronizer", env={**self.env, **self.moto.env("cloud"), "OMP_NUM_THREADS": "1"})
        return self.synchronizer

    def start_learner(self, learner_id: str, *extra: str) -> subprocess.Popen[bytes]:
        site = self.placement[learner_id]
        n = self.starts[learner_id] = self.starts.get(learner_id, 0) + 1
        proc = self.lab.popen(
            site, self._cmd("learner", self.url, "--learner-id", learner_id, "--threads", "1",
                            *self.learner_args, *extra),
            name=f"{learner_id}-{n}", env={**self.env, **self.moto.env(site), "OMP_NUM_THREADS": "1"},
            clock_skew=self.clock_skew.get(site))
        self.learners[learner_id] = proc
        return proc

    def start(self) -> LabRun:
        self.start_synchronizer()
        for lid in self.placement:
            self.start_learner(lid)
        return self

    def restart_dead(self) -> list[str]:
        """Relaunch every learner whose process exited (with :class:`LearnerRestarts`' back-off)."""
        return self.restarts.dead_learners()

    def kill(self, learner_id: str) -> int:
        """SIGKILL the learner's process (a lost machine); returns its pid."""
        proc = self.learners[learner_id]
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=30)
        return proc.pid

    def stop(self, timeout_s: float = 30.0) -> None:
        procs = [*self.learners.values(), *([self.synchronizer] if self.synchronizer else [])]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


RDZV_PORT = 29400


class DDPRun:
    """The baseline: ``benchmarks/wan_ddp.py`` under torchrun, one rank per site (gloo over the
    site's ``wan0``), rendezvous (c10d) on a TCP store in the cloud. ``max_restarts > 0`` is
    torchrun's elastic restart: when a rank dies, every rank's agent restarts its worker and the
    group resumes from the newest checkpoint."""

    def __init__(self, lab: Lab, sites: Sequence[str], recipe: Any, out: Path, *, steps: int, eval_every: int = 0,
                 checkpoint_every: int = 0, max_restarts: int = 0) -> None:
        self.lab, self.sites, self.out = lab, list(sites), Path(out)
        self.steps, self.eval_every, self.checkpoint_every = steps, eval_every, checkpoint_every
        self.max_restarts = max_restarts
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "recipe.json").write_text(json.dumps(recipe.to_dict()))
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.store: subprocess.Popen[bytes] | None = None
        self.run_id = f"wan-{time.time_ns() % 10**9}"

    def start(self) -> DDPRun:
        self.store = self.lab.popen("cloud", [sys.executable, "-c", (
            "import time, torch.distributed as d\n"
            f"s = d.TCPStore('0.0.0.0', {RDZV_PORT}, is_master=True, wait_for_workers=False)\n"
            "time.sleep(10**9)")], name=f"rdzv-{self.run_id}")
        script = str(Path(__file__).resolve().parent / "wan_ddp.py")
        n = len(self.sites)
        for site in self.sites:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.lab.cloud_ip}:{RDZV_PORT}",
                    "--rdzv-id", self.run_id, "--rdzv-conf", "is_host=false,join_timeout=300",
                    "--local-addr", self.lab.site_ip(site), "--max-restarts", str(self.max_restarts),
                    "--monitor-interval", "0.5", script, "--recipe", str(self.out / "recipe.json"),
                    "--out", str(self.out), "--steps", str(self.steps), "--eval-every", str(self.eval_every),
                    "--checkpoint-every", str(self.checkpoint_every)]
            self.agents[site] = self.lab.popen(site, argv, name=f"ddp-{self.run_id}-{site}", env={
                "GLOO_SOCKET_IFNAME": SITE_DEV, "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": "",
                "LOGLEVEL": "WARNING"})
        return self

    def worker_pid(self, site: str) -> int | None:
        """The rank's worker process at ``site`` (torchrun's child), if one runs now."""
        from atoll.ops.procs import descendants

        agent = self.agents[site]
        for pid in descendants(agent.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"wan_ddp.py" in cmd:
                return pid
        return None

    def kill_rank(self, site: str) -> bool:
        """SIGKILL the rank at ``site`` (torchrun's agent survives, as on a machine whose job dies)."""
        pid = self.worker_pid(site)
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return True

    def done(self) -> bool:
        return all(a.poll() is not None for a in self.agents.values())

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.done() and time.monotonic() < deadline:
            time.sleep(1.0)
        return self.done()

    def timeline(self) -> list[dict[str, Any]]:
        path = self.out / "timeline.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        for p in [*self.agents.values(), *([self.store] if self.store else [])]:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in [*self.agents.values(), *([self.store] if self.store else [])]:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
