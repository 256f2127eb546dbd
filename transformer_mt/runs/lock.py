"""One writer per run directory: an exclusive OS lock (`flock`) on the run's lock file.

The kernel drops the lock when its holder dies, however it dies (kill -9 included), so a lock
never outlives its process and there is nothing to clean by hand. The lock file holds who took
it (PID, host, start time, command), for the message that refuses a second writer. Readers
(`translate`, `evaluate`, `runs`, `data`, TensorBoard) never take it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from transformer_mt.core.errors import UsageError
from transformer_mt.core.run_layout import RunDir

logger = logging.getLogger(__name__)

# flock's answers on a filesystem that cannot lock (an NFS mount without lockd, some FUSE and
# SMB mounts): the run then goes on unlocked, with a warning.
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunLock:
    """The held lock of one run directory; `release` (or the process's end) lets it go."""

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self._fd = fd  # None: the filesystem could not lock, and the run goes on unlocked

    @classmethod
    def acquire(cls, run_dir: Path, purpose: str) -> RunLock:
        """Lock `run_dir` (which must exist) for `purpose` (`tmt train`, say), or raise a
        `UsageError` naming the process that holds it and what to do."""
        lock = cls._lock(run_dir)
        if lock.held:
            owner = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "purpose": purpose, "argv": sys.argv}
            os.ftruncate(lock._fd, 0)
            os.pwrite(lock._fd, (json.dumps(owner) + "\n").encode("utf-8"), 0)
        return lock

    @classmethod
    def check_free(cls, run_dir: Path) -> None:
        """Raise `acquire`'s `UsageError` when another process holds `run_dir`'s lock; take nothing."""
        if RunDir(run_dir).lock.exists():
            cls._lock(run_dir, warn=False).release()

    @classmethod
    def _lock(cls, run_dir: Path, warn: bool = True) -> RunLock:
        path = RunDir(run_dir).lock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as err:
            raise UsageError(f"cannot create the lock file {path} ({err.strerror or err})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{run_dir} is in use by {describe_owner(path)}; only one process may write a run "
                             "directory: wait for it to end, or stop it (Ctrl-C saves a checkpoint), then retry; "
                             "translate, evaluate and runs may read it meanwhile") from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_LOCKING:
                raise
            if warn:
                logger.warning("cannot lock %s: its filesystem does not support locks (%s); make sure no other "
                               "tmt process writes %s while this one does", path, err.strerror or err, run_dir)
            return cls(path, None)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let the lock go (closing the file drops the flock). Safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def describe_owner(lock_path: Path) -> str:
    """Who holds the lock, as its lock file says: `tmt train (PID 123 on host, started ...)`."""
    try:
        owner = json.loads(lock_path.read_text(encoding="utf-8"))
        return (f"{owner['purpose']} (PID {owner['pid']} on {owner['host']}, started {owner['started']})")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return "another tmt process (its lock file names no owner yet)"


def lock_if_inside(run_dir: Path, output: Path, purpose: str) -> RunLock:
    """`run_dir`'s lock, taken for `purpose` (`tmt average`, say), when `output` lies inside that
    run directory: a command that writes into a run may not run beside the run's trainer. Else
    (`output` elsewhere, or `run_dir` no run: the command's own checks name that) a lock that holds nothing."""
    if RunDir(run_dir).checkpoints.is_dir() and output.resolve().is_relative_to(run_dir.resolve()):
        return RunLock.acquire(run_dir, purpose)
    return RunLock(RunDir(run_dir).lock, None)
