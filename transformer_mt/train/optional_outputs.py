"""Outputs a training run can lose without losing the run, TensorBoard events and `train.log`: a
write that fails (a full disk, a quota) warns once and training goes on."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator

from transformer_mt.core.files import os_error_reason

logger = logging.getLogger(__name__)


class OptionalWriter:
    """A TensorBoard `SummaryWriter` whose failures warn once, then turn it off. `make` builds the
    writer (which may fail too), or returns None: no writer (ranks other than 0). TensorBoard writes
    on a thread of its own and raises its error at a later call, so every call is guarded."""

    def __init__(self, make: Callable[[], object], where: str):
        self.where = where
        self._writer = None
        self._call(lambda: setattr(self, "_writer", make()))

    def __getattr__(self, name: str):
        if self._writer is None or not callable(getattr(self._writer, name, None)):
            return lambda *args, **kwargs: None
        method = getattr(self._writer, name)
        return lambda *args, **kwargs: self._call(lambda: method(*args, **kwargs))

    def add_summary(self, summary: object, global_step: int | None = None) -> None:
        """Write a ready-made summary (the HParams plugin's) into the run's own event file."""
        if self._writer is not None:
            self._call(lambda: self._writer.file_writer.add_summary(summary, global_step))

    def _call(self, action: Callable[[], object]) -> None:
        try:
            action()
        except OSError as err:
            self._writer = None  # its thread has stopped: nothing more can be written
            logger.warning("TensorBoard: cannot write %s (%s); training goes on without TensorBoard logs",
                           err.filename or self.where, os_error_reason(err, err.filename or self.where))


@contextlib.contextmanager
def quiet_tensorboard_thread() -> Iterator[None]:
    """While inside, an OSError that ends TensorBoard's writer thread prints no traceback: `OptionalWriter`
    warns about it at the next call."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


class OptionalFileHandler(logging.FileHandler):
    """A log file (`train.log`) that stops, with one warning on the console, when a write fails,
    instead of printing logging's `--- Logging error ---` traceback at every line."""

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
            return
        self._give_up(err)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as err:  # buffered lines that the disk will not take
            self._give_up(err)

    def close(self) -> None:
        try:
            super().close()
        except OSError as err:  # closing flushes: the error that ended a run must not be replaced by this
            self._give_up(err)

    def _give_up(self, err: OSError) -> None:
        if self.level > logging.CRITICAL:
            return  # warned already
        self.setLevel(logging.CRITICAL + 1)
        logger.warning("cannot write the log file %s (%s); logging goes on on the console only",
                       self.baseFilename, os_error_reason(err))
