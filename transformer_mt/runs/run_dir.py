"""A run directory's life cycle: claim it without clobbering anything, lock it for its one writer,
and check that a resume keeps the settings that define the run's weights."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from transformer_mt.config.loading import load_config, read_saved_config
from transformer_mt.config.schema import Config, config_changes, config_to_dict, frozen_prefixes
from transformer_mt.core.errors import CheckpointError, ConfigError, TmtError, UsageError
from transformer_mt.core.files import make_parent_dir, read_json, temp_file_target, write_error, write_new_dir
from transformer_mt.core.run_layout import RunDir, best_or_latest, checkpoint_steps
from transformer_mt.data.tokenization import TokenizerPair
from transformer_mt.runs.init_from import parent_paths

logger = logging.getLogger(__name__)

# Sections that define what a checkpoint's weights mean; they may not change on resume.
FROZEN_ON_RESUME = ("seed", "data", "tokenizer", "model")
CHANGEABLE_ON_RESUME = ("data.num_proc",)  # how fast the cache is filled, not what it holds
# Training settings a resume keeps: the optimizer state holds the trainable parameters train.freeze leaves.
FIXED_ON_RESUME = ("train.freeze",)

MARKER = RunDir.MARKER
# flock's answers on a filesystem that cannot lock (NFS without lockd, some FUSE and SMB mounts).
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunLock:
    """One writer per run directory: an exclusive `flock` on its lock file, which the kernel drops when
    the holder dies (kill -9 too); the file names the holder. `release` (or the process's end) lets it go."""

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self._fd = fd  # None: the filesystem could not lock, and the run goes on unlocked

    @classmethod
    def acquire(cls, run_dir: Path, purpose: str) -> RunLock:
        """Lock `run_dir` (which must exist) for `purpose` (`tmt train`, say), or raise a
        `UsageError` naming the process that holds it. Unlockable filesystems: a warning, no lock."""
        lock = cls._lock(run_dir)
        if lock.held:
            owner = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "purpose": purpose, "argv": sys.argv}
            try:
                os.ftruncate(lock._fd, 0)
                os.pwrite(lock._fd, (json.dumps(owner) + "\n").encode("utf-8"), 0)
            except OSError as err:  # a full disk, say
                lock.release()
                raise write_error(err, folder=lock.path) from None
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
        owner = read_json(lock_path)
        return f"{owner['purpose']} (PID {owner['pid']} on {owner['host']}, started {owner['started']})"
    except (KeyError, TypeError):
        return "another tmt process (its lock file names no owner yet)"


def _inside(run_dir: Path, output: Path) -> bool:
    return RunDir(run_dir).checkpoints.is_dir() and output.resolve().is_relative_to(run_dir.resolve())


def lock_if_inside(run_dir: Path, output: Path, purpose: str) -> RunLock:
    """`run_dir`'s lock, taken for `purpose` (`tmt average`, say), when `output` lies inside that run
    (a command writing into a run may not run beside its trainer); else a lock that holds nothing."""
    if _inside(run_dir, output):
        return RunLock.acquire(run_dir, purpose)
    return RunLock(RunDir(run_dir).lock, None)


def check_free_if_inside(run_dir: Path, output: Path) -> None:
    """Refuse at once, before the run is read, an `output` inside a run that another process writes:
    its trainer may delete the very checkpoint being read (`lock_if_inside` would refuse it later)."""
    if _inside(run_dir, output):
        RunLock.check_free(run_dir)


def write_export(run_dir: Path, output_dir: Path, target: Path, write, what: str) -> None:
    """`write(folder)` into the new folder `target` (`write_new_dir`) for `output_dir`, under the run's
    lock when it lies inside the run; a failed write is one `TmtError` naming `what` was written."""
    with lock_if_inside(run_dir, output_dir, "tmt export"):  # never beside the run's trainer
        make_parent_dir(output_dir, "--output")
        try:
            write_new_dir(target, write)
        except OSError as err:
            if err.filename and Path(err.filename).is_relative_to(target):  # named as the user gave --output
                err.filename = str(output_dir / Path(err.filename).relative_to(target))
            raise write_error(err, f"the {what}") from None


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, init_from: str | None = None) -> RunLock:
    """Create (or claim) the run directory, refusing to clobber a run or anything tmt did not
    write; return its lock (`RunLock`), held until released or until this process ends.

    Without `overwrite`, a non-empty directory is reused only when tmt marked it (`MARKER`) and its
    start ended before the first checkpoint (a finished run is kept even without checkpoints). With
    `overwrite`, it is emptied only when marked or holding checkpoints. `init_from` must name another run.
    """
    if resume and overwrite:
        raise UsageError("--resume and --overwrite contradict each other; pick one")
    if init_from and not resume:
        parent_dir = parent_paths(init_from)[0]  # a bad path: one line, before anything is created
        if run_dir.is_dir() and os.path.samefile(parent_dir, run_dir):
            raise UsageError(f"{run_dir} is the run train.init_from starts from; train the new run in another "
                             "--run-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"{run_dir} exists and is not a directory")
    RunLock.check_free(run_dir)  # a writer there first: name it rather than what it wrote
    _check_claimable(run_dir, resume=resume, overwrite=overwrite)  # before creating anything in it
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create the run directory {run_dir} ({err.strerror or err})") from None
    lock = RunLock.acquire(run_dir, "tmt train --resume" if resume else "tmt train")
    try:
        # Again under the lock: another start may have claimed the directory since the check above.
        entries = _check_claimable(run_dir, resume=resume, overwrite=overwrite)
        if not resume:
            _clear(run_dir, entries)
    except BaseException:
        lock.release()
        raise
    return lock


class NewRunDir:
    """What a start is about to add at `run_dir` (the folders it creates, the run directory's and its
    parents', or the files it writes into an empty folder given as --run-dir), so that a start that
    fails before training can take it back."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.created = []  # deepest first
        for folder in (run_dir, *run_dir.parents):
            if folder.exists() or folder.is_symlink():
                break
            self.created.append(folder)
        self.was_empty = run_dir.is_dir() and not any(run_dir.iterdir())

    def remove(self) -> None:
        """Take the start back, unless it trained (a checkpoint, a summary.json): a folder it created
        goes, a folder the user gave is emptied again. Call it while still holding the run's lock."""
        layout = RunDir(self.run_dir)
        if checkpoint_steps(layout.checkpoints) or layout.summary.exists():
            return
        if self.created:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            for parent in self.created[1:]:
                try:
                    parent.rmdir()
                except OSError:  # something else was put there meanwhile: kept
                    break
        elif self.was_empty:
            for path in self.run_dir.iterdir():
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _check_claimable(run_dir: Path, *, resume: bool, overwrite: bool) -> list[str]:
    """Refuse a run directory that `prepare_run_dir` may not claim; return its entries (less the lock file)."""
    checkpoints = RunDir(run_dir).checkpoints
    has_checkpoints = best_or_latest(checkpoints) is not None
    if resume:
        if not checkpoint_steps(checkpoints):
            raise CheckpointError(f"{run_dir}: no checkpoint to resume from (start without --resume)")
        return []
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != RunDir.LOCK) if run_dir.is_dir() else []
    # What tmt writes there, and the temp files a write killed midway leaves (`files.temp_file_target`).
    foreign = [name for name in entries if name not in RunDir.ENTRIES and temp_file_target(name) not in RunDir.ENTRIES]
    if foreign:
        raise UsageError(f"{run_dir} holds files that are not part of a tmt run ({_names(foreign)}), which "
                         "tmt never deletes: move them out of it, or pick another --run-dir")
    marked = MARKER in entries
    if entries and not marked and not has_checkpoints:
        raise UsageError(f"{run_dir} holds {_names(entries)}, which tmt did not write there (no {MARKER} marker); "
                         "pick another --run-dir or move them away")
    if has_checkpoints and not overwrite:
        raise UsageError(f"{run_dir} already holds a trained run: use --resume to continue it, "
                         "--overwrite to start over, or --run-dir to train elsewhere")
    results = _finished_run_results(run_dir, entries)
    if results and not overwrite:
        raise UsageError(f"{run_dir} holds a finished run ({_names(results)}) without checkpoints: use --overwrite "
                         "to delete it and start over, or --run-dir to train elsewhere")
    return entries


def _clear(run_dir: Path, entries: list[str]) -> None:
    """Delete `entries` (an earlier run, or a failed start's leftovers) and mark the directory as tmt's."""
    for name in entries:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    try:
        RunDir(run_dir).marker.write_text("a run directory made by tmt train\n", encoding="utf-8")
    except OSError as err:
        raise write_error(err, folder=RunDir(run_dir).marker) from None


def _finished_run_results(run_dir: Path, entries: list[str]) -> list[str]:
    """The entries that show a run trained to its end: its test scores, a summary that says so."""
    found = [RunDir.EVALUATION] if RunDir.EVALUATION in entries else []
    if RunDir.SUMMARY in entries:
        summary = read_json(RunDir(run_dir).summary)  # unreadable: a write cut short, so not a finished run
        if isinstance(summary, dict) and summary.get("status") in ("finished", "stopped early"):
            found.append(RunDir.SUMMARY)
    return found


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_saved_config(cfg: Config, run_dir: Path) -> list[str]:
    """Refuse a resume whose model, vocabulary or data settings differ from the run's `config.yaml`,
    before a large corpus is prepared (the checkpoint's own config is checked again on resume); the
    settings that may change and do, as `key: old -> new` lines."""
    path = RunDir(run_dir).config
    if (saved := read_saved_config(path)) is not None:
        return resume_config_changes(saved, config_to_dict(cfg), path)
    return []


def resume_config_changes(saved: dict, current: dict, path: Path) -> list[str]:
    """The settings that differ from the saved ones, as `key: old -> new` lines; a `ConfigError`
    listing them when any is in `FROZEN_ON_RESUME` (less `CHANGEABLE_ON_RESUME`) or `FIXED_ON_RESUME`."""
    frozen, allowed = [], []
    for key, old, new in config_changes(saved, current):
        if key == "train.freeze" and set(frozen_prefixes(tuple(old or ()))) == set(frozen_prefixes(tuple(new or ()))):
            continue  # the same parameters, named in another order or way
        is_frozen = (key.partition(".")[0] in FROZEN_ON_RESUME and key not in CHANGEABLE_ON_RESUME
                     or key in FIXED_ON_RESUME)
        (frozen if is_frozen else allowed).append(f"{key}: {old!r} -> {new!r}")
    if frozen:
        raise ConfigError([f"cannot resume from {path.name}: these settings differ from the run's "
                           "(only train.* but train.freeze, decode.* and data.num_proc may change; to train "
                           "other parts, start a new run with train.init_from)"] + frozen)
    return allowed


def data_settings_problem(cfg: Config, run_dir: Path) -> str | None:
    """Why `run_dir`'s tokenizers and split cannot stand for `cfg`'s, or None when they can."""
    if not RunDir(run_dir).config.is_file() or not TokenizerPair.exists_in(run_dir):
        return "it holds no run's config.yaml and tokenizers"
    try:
        saved = config_to_dict(load_config(RunDir(run_dir).config))
    except TmtError:
        return "its config.yaml cannot be read"  # train fresh tokenizers rather than guess
    differ = [key for key, _, _ in config_changes(saved, config_to_dict(cfg))
              if key == "seed" or key.partition(".")[0] in ("data", "tokenizer")]
    return f"its settings differ ({', '.join(differ)})" if differ else None
