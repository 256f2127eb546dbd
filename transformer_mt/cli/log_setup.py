"""Logging to the terminal: records written around tqdm's live bars, and a run's train.log beside."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from transformer_mt.train.optional_outputs import OptionalFileHandler


class _BarAwareHandler(logging.StreamHandler):
    """Writes each record through `tqdm.write`: it clears the live bars, writes the record on lines of
    its own and draws the bars again (a StreamHandler writes on the bar's line, which the bar's next
    refresh draws over). With no bar live it writes as a StreamHandler."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # as StreamHandler: a failing handler reports, never raises into the caller
            self.handleError(record)


class _CommandFormatter(logging.Formatter):
    """A short command's records as its other lines read: `tmt: message`, `tmt: warning: message`."""

    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"tmt: {level}{record.getMessage()}"


def setup_logging(level: int, log_path: Path | None = None, timestamps: bool = False) -> logging.Handler | None:
    """Log to stderr at `level` (with `timestamps`, as a long run's log; else as `tmt:` lines), and
    everything at INFO and above to `log_path` if given."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = _BarAwareHandler(sys.stderr)
    console.setLevel(level)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S") if timestamps
                         else _CommandFormatter())
    root.handlers = [console]
    for noisy in ("datasets", "urllib3", "filelock", "fsspec", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if log_path is None:
        return None
    file_handler = OptionalFileHandler(log_path, encoding="utf-8")  # a full disk stops the log, not the run
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)
    return file_handler
