"""Processes of the local stack: free loopback ports, a process's descendants, signalling a group.

Shared by :mod:`atoll.ops.stack` and :mod:`atoll.ops.postgres` (Linux /proc where it is read).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from pathlib import Path

__all__ = ["free_port", "descendants", "signal_group", "kill_quietly"]

def free_port(preferred: int | None = None) -> int:
    if preferred:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

def signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)

def kill_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)

def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; elsewhere: none)."""
    parent: dict[int, int] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out: list[int] = []
    frontier = [pid]
    while frontier:
        cur = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == cur]
        out += kids
        frontier += kids
    return out
