"""Stopping cleanly: Ctrl-C or SIGTERM ask a training run for a checkpoint, then a stop; neither is
lost while processes start."""

from __future__ import annotations

import contextlib
import signal
import threading

from transformer_mt.core.errors import Terminated


class StopRequest:
    """Turns the first SIGINT/SIGTERM into a request to save and stop after the current step; a
    second signal interrupts at once, unsaved, unless `second_signal_interrupts` is False (torchrun
    sends one after Ctrl-C, and its SIGKILL is the hard stop there)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, second_signal_interrupts: bool = True):
        self.signal_number: int | None = None
        self.second_signal_interrupts = second_signal_interrupts
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signal_number: int, frame) -> None:
        if self.signal_number is not None:
            if self.second_signal_interrupts:
                raise KeyboardInterrupt  # asked twice: stop now, without a checkpoint
            return
        self.signal_number = signal_number  # no logging here: a handler may interrupt a log write


@contextlib.contextmanager
def sigterm_interrupts():
    """While inside, SIGTERM raises `Terminated` where the program is, as SIGINT raises
    KeyboardInterrupt, instead of killing the process (the training loop's `StopRequest` overrides it)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def handle(signal_number: int, frame) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred():
    """While inside, SIGINT and SIGTERM are only noted, then raised again on leaving, where their handlers run as
    usual. For `os.fork`: a handler that raises in its at-fork callbacks is reported as "Exception ignored" and
    the signal is lost (the command goes on as if Ctrl-C had not been pressed)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signal_number, frame: received.append(signal_number))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signal_number in received:
            signal.raise_signal(signal_number)
