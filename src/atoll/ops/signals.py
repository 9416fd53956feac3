"""SIGTERM stops a command the way Ctrl-C does: one place for every long-running ``atoll`` command.

``atoll demo``, ``up``, ``learner`` and ``train`` own children (a Prefect server, workers and the
flow processes they start, an ephemeral Prefect server, a user's training script). Each already
stops them while unwinding from :class:`KeyboardInterrupt` (``finally`` blocks, context managers,
``atexit``). A process manager, ``docker stop``, ``kill`` or a CI runner sends SIGTERM instead, whose
default action ends the process at once and runs none of that, leaving the children running.
:func:`stop_on_signals` makes SIGTERM (and SIGINT, SIGHUP) raise :class:`Interrupted`, a
:class:`KeyboardInterrupt`, so every command unwinds the same way whichever signal stopped it.
``atoll.cli.main`` wraps every command in it.

A second signal while the first one unwinds is not raised again (it is reported once): cleanup
that stops servers and waits for them must not itself be interrupted half way. Code that must not
be interrupted between two statements (a process started and not yet recorded for cleanup) runs
under :func:`deferred_stop`: a signal that arrives inside is raised at its end.

Standard library only.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["STOP_SIGNALS", "Interrupted", "stop_on_signals", "deferred_stop", "exit_status"]

STOP_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a command: Ctrl-C, a process manager's stop, the terminal closing."""

ALWAYS_HANDLED = frozenset({signal.SIGTERM})
"""Handled even when ignored at start. SIGINT and SIGHUP stay ignored where the process was started
with them ignored (``nohup``, a background job of a non-interactive shell), as Python itself does
for SIGINT."""


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread for a stop signal; ``signum`` says which one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        """The signal that stopped the command."""


class _State:
    def __init__(self) -> None:
        self.active = 0
        """Nesting depth of :func:`stop_on_signals` blocks in effect."""
        self.deferred = 0
        """Nesting depth of :func:`deferred_stop` blocks."""
        self.reset()

    def reset(self) -> None:
        self.stopping: int | None = None
        """The signal being unwound from, once one has been raised."""
        self.pending: int | None = None
        """A signal that arrived inside :func:`deferred_stop`, raised at its end."""
        self.repeated = False
        """Whether the 'already stopping' line was printed."""


_state = _State()


def _handler(signum: int, frame: Any) -> None:
    if _state.stopping is not None or _state.pending is not None:
        if not _state.repeated:  # a second Ctrl-C or SIGTERM: the first one's cleanup is running
            _state.repeated = True
            print(f"atoll: {signal.Signals(signum).name} again: already stopping, please wait", file=sys.stderr,
                  flush=True)
        return
    if _state.deferred:
        _state.pending = signum
        return
    _state.stopping = signum
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals(signums: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, the first of ``signums`` raises :class:`Interrupted` in the main thread; the
    previous handlers come back at its end. Elsewhere than in the main thread it does nothing (only
    the main thread can handle signals). Handlers installed inside the block (Prefect's flow engine,
    a learner's save-and-exit on SIGTERM) take precedence while they are in effect."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}
    try:
        for s in signums:
            if signal.getsignal(s) == signal.SIG_IGN and s not in ALWAYS_HANDLED:
                continue
            previous[s] = signal.signal(s, _handler)
    except ValueError:  # not the main interpreter
        pass
    if not _state.active:
        _state.reset()
    _state.active += 1
    try:
        yield
    finally:
        _state.active -= 1
        if not _state.active:
            _state.reset()
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def deferred_stop() -> Iterator[None]:
    """A stop signal that arrives inside the block is raised when the block ends (e.g. between
    starting a process and recording it for cleanup). Has effect only inside :func:`stop_on_signals`."""
    _state.deferred += 1
    try:
        yield
    finally:
        _state.deferred -= 1
        if not _state.deferred and _state.pending is not None and _state.stopping is None:
            signum, _state.pending = _state.pending, None
            _state.stopping = signum
            raise Interrupted(signum)


def exit_status(exc: KeyboardInterrupt) -> int:
    """The shell's exit status for a command stopped by ``exc``: 128 + the signal (130 for Ctrl-C)."""
    return 128 + getattr(exc, "signum", signal.SIGINT)
