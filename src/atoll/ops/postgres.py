"""A private PostgreSQL cluster for the local stack (``atoll up --database postgres``).

SQLite serializes writes: with many workers and learners creating flow runs, task runs, artifacts
and events at once, Prefect's server waits on "database is locked". :class:`LocalPostgres` runs a
cluster of its own for one stack: ``initdb`` into ``<stack home>/postgres`` (once; later starts
reuse it), ``pg_ctl start`` on a free loopback port (no Unix socket, password authentication),
creates the ``prefect`` database and hands out a ``postgresql+asyncpg://`` URL for the server;
:meth:`LocalPostgres.stop` stops it.

PostgreSQL refuses to run as root. As root, every server command runs as an unprivileged user
(``ATOLL_POSTGRES_USER``, else ``postgres`` when that user exists, else ``nobody``), set by
:class:`subprocess.Popen` itself (no ``su``/``sudo``). The cluster's folder is owned by that user,
mode 0700. When that user cannot reach the stack home (a home under ``/root`` or pytest's
``/tmp/pytest-of-root``, both 0700), the cluster lives in ``$TMPDIR/atoll-postgres-<hash of the
home>`` and ``<home>/postgres`` is a symlink to it.

The server binaries (``initdb``, ``pg_ctl``, ``postgres``) are found in ``ATOLL_POSTGRES_BIN`` (a
folder), next to ``pg_ctl`` on ``PATH``, in ``/usr/lib/postgresql/<version>/bin`` (newest first,
Debian/Ubuntu) or ``/usr/local/pgsql/bin``; install them with ``apt-get install postgresql``.

``python -m atoll.ops.postgres`` prints the folder found (exit 0) or why none was (exit 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from atoll.ops.procs import descendants, free_port

__all__ = ["LocalPostgres", "PostgresError", "PostgresNotFound", "find_postgres_bin", "normalize_database_url",
           "run_as_user"]

BINARIES = ("initdb", "pg_ctl", "postgres")
INSTALL_HINT = ("install the PostgreSQL server binaries (Debian/Ubuntu: `apt-get install postgresql`) or point "
                "ATOLL_POSTGRES_BIN at the folder that holds initdb, pg_ctl and postgres; or give the server a "
                "database you run yourself with --database-url postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB")


class PostgresError(RuntimeError):
    """The private cluster cannot be set up or started (the message says why and what to do)."""


class PostgresNotFound(PostgresError):
    """No PostgreSQL server binaries on this machine."""


def _has_binaries(folder: Path) -> bool:
    return all(os.access(folder / b, os.X_OK) for b in BINARIES)


def _version_key(p: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", p.parent.name)) or (0,)


def find_postgres_bin(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``, or :class:`PostgresNotFound`."""
    tried: list[str] = []
    given = explicit or os.environ.get("ATOLL_POSTGRES_BIN")
    if given:
        folder = Path(given).expanduser()
        if _has_binaries(folder):
            return folder
        raise PostgresNotFound(f"ATOLL_POSTGRES_BIN={folder} does not hold {', '.join(BINARIES)}; {INSTALL_HINT}")
    candidates: list[Path] = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)  # /usr/local/bin/pg_ctl -> /usr/lib/postgresql/15/bin
        candidates.append(Path(on_path).parent)
    candidates += sorted((p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")),
                         key=lambda b: _version_key(b / "x"), reverse=True)
    candidates += [Path("/usr/local/pgsql/bin"), Path("/opt/homebrew/bin"), Path("/usr/local/bin")]
    for folder in candidates:
        tried.append(str(folder))
        if _has_binaries(folder):
            return folder
    raise PostgresNotFound(f"no PostgreSQL server binaries ({', '.join(BINARIES)}) found "
                           f"(looked in ATOLL_POSTGRES_BIN, PATH, /usr/lib/postgresql/*/bin, "
                           f"/usr/local/pgsql/bin); {INSTALL_HINT}")


def normalize_database_url(url: str) -> str:
    """Prefect's server needs an async driver: ``postgresql://`` and ``postgres://`` become
    ``postgresql+asyncpg://``; SQLite URLs must be ``sqlite+aiosqlite://``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"--database-url: not a URL: {url!r} (expected postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB)")
    scheme = scheme.lower()
    if scheme in ("postgres", "postgresql", "postgresql+asyncpg"):
        return f"postgresql+asyncpg://{rest}"
    if scheme == "sqlite+aiosqlite":
        return url
    raise ValueError(f"--database-url: Prefect's server supports postgresql+asyncpg:// and sqlite+aiosqlite:// "
                     f"URLs, not {scheme}://")


def run_as_user() -> pwd.struct_passwd | None:
    """Who runs the server commands: nobody else when not root; as root an unprivileged user."""
    if os.geteuid() != 0:
        return None
    wanted = os.environ.get("ATOLL_POSTGRES_USER")
    names = [wanted] if wanted else ["postgres", "nobody"]
    for name in names:
        try:
            user = pwd.getpwnam(name)
        except KeyError:
            continue
        if user.pw_uid == 0:
            raise PostgresError(f"ATOLL_POSTGRES_USER={name} is root; PostgreSQL refuses to run as root")
        return user
    raise PostgresError(f"running as root and no unprivileged user {' or '.join(names)} to run PostgreSQL as: "
                       "create one (`useradd --system postgres`) or set ATOLL_POSTGRES_USER")


class LocalPostgres:
    """One private PostgreSQL cluster under ``root`` (``root/data``, ``root/postgres.log``)."""

    def __init__(self, root: str | os.PathLike[str], *, port: int | None = None,
                 bin_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                 database: str = "prefect", user: str = "atoll") -> None:
        self.requested_root = Path(root)
        self.root = self.requested_root
        self.port = port
        self.bin_dir = Path(bin_dir) if bin_dir else None
        self.base_env = dict(env if env is not None else os.environ)
        self.database = database
        self.user = user
        self.password = ""
        self.running = False
        self.run_as: pwd.struct_passwd | None = None

    # -- paths and URLs ------------------------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "postgres.log"

    @property
    def url(self) -> str:
        """The server's connection URL (``postgresql+asyncpg://``); valid after :meth:`start`."""
        return f"postgresql+asyncpg://{self.user}:{self.password}@127.0.0.1:{self.port}/{self.database}"

    # -- running commands as the cluster's owner ----------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in self.base_env.items() if not k.startswith("PG")}
        env["HOME"] = str(self.root)
        env.setdefault("LC_ALL", "C")
        return env

    def _run(self, args: Sequence[str], *, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, Any] = {}
        if self.run_as is not None:
            kwargs.update(user=self.run_as.pw_uid, group=self.run_as.pw_gid, extra_groups=[])
        proc = subprocess.run(list(args), env=self._env(), cwd=self.root, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True, check=False, **kwargs)
        if check and proc.returncode != 0:
            raise PostgresError(f"{' '.join(args[:2])} failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-2000:]} (log: {self.log_file})")
        return proc

    def _bin(self, name: str) -> str:
        assert self.bin_dir is not None
        return str(self.bin_dir / name)

    def _own(self, path: Path, mode: int) -> None:
        if self.run_as is not None:
            os.chown(path, self.run_as.pw_uid, self.run_as.pw_gid)
        os.chmod(path, mode)

    def _reachable(self, path: Path) -> bool:
        if self.run_as is None:
            return os.access(path, os.R_OK | os.W_OK | os.X_OK)
        return subprocess.run(["/bin/sh", "-c", 'test -r "$1" -a -w "$1" -a -x "$1"', "sh", str(path)],
                              user=self.run_as.pw_uid, group=self.run_as.pw_gid, extra_groups=[], cwd="/",
                              check=False).returncode == 0

    def _prepare_root(self) -> Path:
        """The cluster's folder, owned by the user that runs it (see the module's docstring)."""
        want = self.requested_root
        if want.is_symlink():  # a previous start redirected it (the target may be gone after a reboot)
            target = Path(os.readlink(want))
        else:
            want.mkdir(parents=True, exist_ok=True)
            self._own(want, 0o700)
            if self._reachable(want):
                return want
            if any(want.iterdir()):
                raise PostgresError(f"{want} is not reachable by user {self.run_as.pw_name if self.run_as else '?'} "
                                   "that runs PostgreSQL (an ancestor folder is private); move the stack home")
            want.rmdir()
            digest = hashlib.sha256(str(want.resolve()).encode()).hexdigest()[:12]
            target = Path(tempfile.gettempdir()) / f"atoll-postgres-{digest}"
        target.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(target)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, self.run_as.pw_uid if self.run_as else os.getuid()):
            raise PostgresError(f"{target} exists and is not a folder of ours; remove it")
        self._own(target, 0o700)
        if not self._reachable(target):
            raise PostgresError(f"{target} is not reachable by the user that runs PostgreSQL")
        if not want.is_symlink():
            want.symlink_to(target, target_is_directory=True)
        return target

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> LocalPostgres:

        self.bin_dir = self.bin_dir or find_postgres_bin()
        self.run_as = run_as_user()
        self.root = self._prepare_root()
        creds_file = self.root / "atoll.json"
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(creds_file)
        creds = json.loads(creds_file.read_text())
        self.user, self.password, self.database = creds["user"], creds["password"], creds["database"]
        if self._status_running():  # left running by a stack that died: it is ours (same folder)
            self._run([self._bin("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast", "-w", "-t", "30"],
                      check=False)
        self.port = self.port or free_port()
        self._run([self._bin("pg_ctl"), "start", "-D", str(self.data_dir), "-l", str(self.log_file), "-w",
                   "-t", str(int(timeout_s)), "-o", f"-p {self.port}"], timeout=timeout_s + 10)
        self.running = True
        try:
            self._create_database()
        except BaseException:
            self.stop()
            raise
        return self

    def _initdb(self, creds_file: Path) -> None:
        if self.data_dir.exists():
            shutil.rmtree(self.data_dir)  # a half-made cluster (no PG_VERSION): start over
        password = secrets.token_hex(16)
        pwfile = self.root / ".pwfile"
        pwfile.write_text(password + "\n")
        self._own(pwfile, 0o600)
        try:
            self._run([self._bin("initdb"), "-D", str(self.data_dir), "-U", self.user, f"--pwfile={pwfile}",
                       "--auth=scram-sha-256", "-E", "UTF8", "--no-locale", "--no-instructions"])
        finally:
            pwfile.unlink(missing_ok=True)
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write("\n# atoll: a private cluster for one local stack, loopback only, no Unix socket\n"
                       "listen_addresses = '127.0.0.1'\nunix_socket_directories = ''\n"
                       "max_connections = 200\n")
        creds_file.write_text(json.dumps({"user": self.user, "password": password, "database": self.database}))
        self._own(creds_file, 0o600)

    def _status_running(self) -> bool:
        return self._run([self._bin("pg_ctl"), "status", "-D", str(self.data_dir)], check=False).returncode == 0

    def _create_database(self) -> None:
        import asyncio

        import asyncpg

        async def create() -> None:
            conn = await asyncpg.connect(host="127.0.0.1", port=self.port, user=self.user, password=self.password,
                                         database="postgres", timeout=30)
            try:
                if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", self.database):
                    await conn.execute(f'CREATE DATABASE "{self.database}"')
            finally:
                await conn.close()

        asyncio.run(create())

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fast shutdown (``pg_ctl stop -m fast``); if that fails, immediate, then SIGKILL."""
        if not self.running or self.bin_dir is None:
            return
        pid = self.postmaster_pid()
        pg_ctl = [self._bin("pg_ctl"), "stop", "-D", str(self.data_dir), "-w", "-t", str(int(timeout_s))]
        try:
            done = self._run([*pg_ctl, "-m", "fast"], check=False, timeout=timeout_s + 10).returncode == 0
            if not done:
                done = self._run([*pg_ctl, "-m", "immediate"], check=False, timeout=timeout_s + 10).returncode == 0
        except subprocess.TimeoutExpired:
            done = False
        if not done and pid is not None:

            for p in [pid, *descendants(pid)]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.5)
        self.running = False

    def destroy(self) -> None:
        """Stop the cluster and delete it (its folder, and the symlink to it if it was redirected)."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        if self.requested_root.is_symlink():
            self.requested_root.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        print(find_postgres_bin())
    except PostgresNotFound as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
