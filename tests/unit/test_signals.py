"""atoll.ops.signals in this process: SIGTERM unwinds like Ctrl-C, once; handlers come back after."""

from __future__ import annotations

import os
import signal
import time

import pytest

from atoll.ops.signals import Interrupted, deferred_stop, exit_status, stop_on_signals


def _deliver(sig: int) -> None:
    """Send ``sig`` to this process and give the interpreter a moment to run its handler."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.001)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_raises_keyboard_interrupt_with_its_number(sig: int) -> None:
    # A process started with SIGINT or SIGHUP ignored (nohup, a background job) keeps them
    # ignored (the test below): this one starts with the default, whatever pytest was started with.
    started_with = signal.signal(sig, signal.SIG_DFL)
    try:
        with pytest.raises(KeyboardInterrupt) as info, stop_on_signals():
            _deliver(sig)
        assert isinstance(info.value, Interrupted) and info.value.signum == sig
        assert exit_status(info.value) == 128 + sig
        assert signal.getsignal(sig) is signal.SIG_DFL
    finally:
        signal.signal(sig, started_with)


def test_a_second_signal_does_not_interrupt_the_cleanup(capsys: pytest.CaptureFixture[str]) -> None:
    cleaned = []
    with pytest.raises(Interrupted) as info, stop_on_signals():
        try:
            _deliver(signal.SIGTERM)
        finally:
            _deliver(signal.SIGINT)  # Ctrl-C while the children are being stopped
            _deliver(signal.SIGTERM)
            cleaned.append(True)
    assert info.value.signum == signal.SIGTERM and cleaned == [True]
    assert capsys.readouterr().err.count("already stopping") == 1


def test_a_signal_inside_deferred_stop_is_raised_at_its_end() -> None:
    steps = []
    with pytest.raises(Interrupted), stop_on_signals():
        with deferred_stop():
            _deliver(signal.SIGTERM)
            steps.append("started")
            steps.append("recorded")
        steps.append("after")  # not reached
    assert steps == ["started", "recorded"]


def test_sigint_ignored_at_start_stays_ignored_sigterm_does_not() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_on_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
            _deliver(signal.SIGINT)  # nohup-style: ignored
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_each_block_starts_afresh() -> None:
    for _ in range(2):
        with pytest.raises(Interrupted), stop_on_signals():
            _deliver(signal.SIGTERM)


def test_ctrl_c_without_a_signal_number_exits_130() -> None:
    assert exit_status(KeyboardInterrupt()) == 130
