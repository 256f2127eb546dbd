"""Files written atomically (a reader, or a run killed mid-write, sees the old file or the new one),
the folders outputs go in, and write errors as one line naming the file."""

from __future__ import annotations

import contextlib
import errno
import json
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from transformer_mt.core.errors import TmtError, UsageError, WriteError

T = TypeVar("T")

# `.<name>.<8 hex digits>.tmp`: the temp file `write_atomic` writes `name` through.
_TEMP_FILE = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{8}\.tmp")


def read_json(path: Path) -> Any:
    """`path`'s JSON, or None when it is missing or unreadable (a write cut short, say)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically (`write_atomic`)."""
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write` on a new, uniquely named temp file beside `path` (`.<name>.<8 hex digits>.tmp`,
    usual permissions, never someone else's), fsync it, then rename it over `path`. On any failure,
    Ctrl-C included, it is removed and the error propagates, `path` untouched."""
    fd, tmp = _create_beside(path, lambda tmp: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        with naming(path), os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """While inside, an OSError that names no file (a write, an fsync, pyarrow's) names `path`."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        raise


# Write failures the user can act on (free space, a file-size limit, a quota, permissions, a failing
# disk), and how each is worded: the system's words, or these.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                          errno.EIO})
_WORDING = {errno.EFBIG: "File too large (a file-size limit)"}  # `ulimit -f`, a FAT or quota'd filesystem


def os_error_reason(err: OSError, path: Path | str | None = None) -> str:
    """Why `err` failed, in the same words wherever it was raised (pyarrow's "Error writing bytes to
    file. Detail: ..." included), with the free space at `path` (else its own file) for ENOSPC and
    EDQUOT: `No space left on device; 0 bytes free there`."""
    path = path if path is not None else err.filename
    number = os_errno(err)
    if number in WRITE_ERRNOS:
        reason = _WORDING.get(number, os.strerror(number))
    else:
        reason = (err.strerror if err.errno is not None and err.strerror
                  else os.strerror(number) if number else str(err))
    if number in (errno.ENOSPC, errno.EDQUOT) and path is not None:
        free = _free_bytes(Path(path))
        if free is not None:
            reason += f"; {free:,} bytes free there"
    return reason


def describe_os_error(err: OSError, path: Path | str | None = None) -> str:
    """`err` as one line naming its file (`path`, else the error's own) and `os_error_reason`:
    `runs/x/summary.json: No space left on device; 0 bytes free there`."""
    path = path if path is not None else err.filename
    reason = os_error_reason(err, path)
    return f"{path}: {reason}" if path is not None else reason


def write_error(err: OSError, what: str = "", folder: Path | str | None = None) -> WriteError:
    """The one-line error of a failed write: its file (else `folder`) and the reason, after
    `cannot write {what}: ` when given: `cannot write the corpus cache: runs/x/...: File too large (...)`."""
    prefix = f"cannot write {what}: " if what else ""
    return WriteError(prefix + describe_os_error(err, err.filename or folder))


@contextlib.contextmanager
def os_errors_named(what: str = "", folder: Path | None = None) -> Iterator[None]:
    """While inside, an OSError the user can act on (`WRITE_ERRNOS`) becomes `write_error`'s `WriteError`."""
    try:
        yield
    except OSError as err:
        if os_errno(err) in WRITE_ERRNOS:
            raise write_error(err, what, folder) from None
        raise


@contextlib.contextmanager
def removed_on_failure(folder: Path, what: str) -> Iterator[None]:
    """While inside, the temp folder `folder` is written: on any failure, Ctrl-C included, it is
    removed, and a write error the user can act on is named (`os_errors_named`)."""
    try:
        with os_errors_named(what, folder):
            yield
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def os_errno(err: OSError) -> int | None:
    """`err`'s errno; pyarrow's OSErrors carry none, and say `[errno 28]` in their text instead."""
    if err.errno is not None:
        return err.errno
    match = re.search(r"\[errno (\d+)\]", str(err))
    return int(match[1]) if match else None


def _free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the filesystem of `path` (or of its nearest existing folder)."""
    for folder in (path, *path.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


def check_parent_dir(path: Path, option: str | None = None) -> None:
    """Refuse, without creating anything, an output `path` under a file: a `UsageError` naming
    `option` (if any), `path` and the file in the way, `--output in.txt/sub: in.txt is not a directory`."""
    for folder in reversed(path.parents):  # outermost first
        if os.path.lexists(folder) and not folder.is_dir():
            raise UsageError(f"{f'{option} {path}' if option else path}: {folder} is not a directory")


def make_parent_dir(path: Path, option: str | None = None) -> None:
    """Create the folder that the output `path` goes in; or raise `check_parent_dir`'s error, else a `TmtError`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        check_parent_dir(path, option)  # mkdir names no file when one is in the way: find it
        raise TmtError(f"{f'{option} {path}' if option else path}: cannot create the folder {path.parent} "
                       f"({err.strerror or err})") from None


def check_new_dir(path: Path, option: str) -> Path:
    """`path` resolved, where a new folder will go: refused (a `UsageError` naming `option`) under a
    file, when it is a file or a non-empty folder (nothing the user has is replaced), or when it is
    the current directory (replacing it would pull the folder from under the shell)."""
    check_parent_dir(path, option)
    target = path.resolve()  # `.` or `..` has no name to write a temp folder beside
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{path} already exists and is not an empty directory; choose another {option}")
    if Path.cwd().is_relative_to(target):
        raise UsageError(f"{option} {path} is the current directory; choose a new directory")
    return target


def write_new_dir(target: Path, write: Callable[[Path], object]) -> None:
    """`write(folder)` into a new folder of our own beside `target`, then rename it onto `target`
    (absent or empty): never half-written; on any failure (Ctrl-C too) the folder is removed."""
    tmp = make_temp_dir_beside(target)
    try:
        write(tmp)
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        tmp.rename(target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):  # named as the file it was to become (or the folder), not the temp one
            written = Path(err.filename) if err.filename else None
            err.filename = str(target / written.relative_to(tmp) if written and written.is_relative_to(tmp) else
                               err.filename or target)
        raise


def make_temp_dir_beside(path: Path) -> Path:
    """A new empty folder `.<name>.<8 hex digits>.tmp` beside `path` (usual permissions, never
    someone else's), to be renamed onto `path` once written."""
    return _create_beside(path, Path.mkdir)[1]


def _create_beside(path: Path, create: Callable[[Path], T]) -> tuple[T, Path]:
    """`create(tmp)` for a new name `.<name>.<8 hex digits>.tmp` beside `path` (another while taken)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return create(tmp), tmp
        except FileExistsError:  # another writer's, or anyone's, file or folder: draw another name
            continue


def temp_file_target(name: str) -> str | None:
    """The file that `name` was `write_atomic`'s temp file for (left by a killed write), else None."""
    match = _TEMP_FILE.fullmatch(name)
    return match["name"] if match else None


def lines_to_text(lines: list[str]) -> str:
    """One line each, newline-terminated (the format of every hypotheses file)."""
    return "".join(line + "\n" for line in lines)


def write_lines(path: Path, lines: list[str]) -> None:
    """Write one line each (its folder made first), atomically: a failure never leaves a half-written
    file, and is one `WriteError` naming it."""
    make_parent_dir(path)
    try:
        write_text_atomic(path, lines_to_text(lines))
    except OSError as err:
        raise write_error(err) from None


def sha256_of(path: Path) -> str:
    """The file's SHA-256 (hex), read a block at a time: a model's weights never whole in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
