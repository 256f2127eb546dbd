"""`summary.json`: where a run came from and how it went, rewritten at every checkpoint and at the
end; `tmt runs` lists them, noticing a `running` one whose process is gone."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import platform
import socket
import subprocess
import textwrap
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from transformer_mt.config.loading import read_saved_config
from transformer_mt.config.schema import Config
from transformer_mt.core.files import read_json, sha256_of, write_text_atomic
from transformer_mt.core.run_layout import RunDir, run_folders

if TYPE_CHECKING:
    import torch

PACKAGES = ("transformer-mt", "torch", "tokenizers", "datasets", "sacrebleu")


def provenance(cfg: Config, run_dir: Path, device: torch.device, config_dir: Path | None) -> dict:
    """What the run was made from: data, split seed, tokenizers, software, device, config's git commit."""
    from transformer_mt.core.runtime import device_description  # imports torch: listing runs does without it

    return {
        "data": {"format": cfg.data.format, "path": cfg.data.path, "hub_config": cfg.data.hub_config,
                 "revision": cfg.data.revision, "src_lang": cfg.data.src_lang, "tgt_lang": cfg.data.tgt_lang,
                 **({"corpora": [dataclasses.asdict(entry) for entry in cfg.data.corpora]} if cfg.data.corpora else {})},
        "split_seed": cfg.seed,
        "tokenizers_sha256": {path.name: sha256_of(path)
                              for path in sorted(run_dir.glob("tokenizer*.json"))},
        "versions": {**{name: _version(name) for name in PACKAGES}, "python": platform.python_version()},
        "device": device_description(device),
        "config_git_commit": git_commit(config_dir) if config_dir else None,
        "host": socket.gethostname(),
    }


def git_commit(directory: Path) -> str | None:
    """HEAD of the git repository holding `directory` (with `-dirty` if it has changes), else None."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):  # no git installed, or it hung
        return None


def write_summary(run_dir: Path, summary: dict) -> None:
    """Write `summary.json` atomically, stamped with the writing process and time."""
    summary = {**summary, "pid": os.getpid(), "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_text_atomic(RunDir(run_dir).summary, json.dumps(summary, indent=2) + "\n")


def read_summaries(runs_dir: Path) -> list[dict]:
    """The summaries of the runs in `run_folders(runs_dir)`, most recently updated first."""
    rows = []
    for folder in run_folders(runs_dir):
        path = RunDir(folder).summary
        if not path.is_file():
            rows.extend(_before_training(folder, runs_dir))
            continue
        summary = read_json(path)
        if not isinstance(summary, dict):
            summary = {"status": "unreadable summary.json"}
        summary.update(_row_names(folder, runs_dir), mtime=path.stat().st_mtime)
        provenance = summary.get("provenance")
        host = provenance.get("host") if isinstance(provenance, dict) else None
        if summary.get("status") == "running" and _alive_here(host, summary.get("pid")) is False:
            summary["status"] = "died (process gone)"
        rows.append(summary)
    return sorted(rows, key=lambda row: row["mtime"], reverse=True)


def training_now(run_dir: Path) -> dict | None:
    """`run_dir`'s summary (`{}` before it has one) while a process trains the run: the summary says
    `running` and its writer is not known to be gone (as `tmt runs` shows it), or a live `tmt train`
    holds its lock (a resume preparing its data). None when nothing trains it."""
    layout = RunDir(run_dir)
    summary = read_json(layout.summary)
    summary = summary if isinstance(summary, dict) else {}
    provenance = summary.get("provenance")
    host = provenance.get("host") if isinstance(provenance, dict) else None
    if summary.get("status") == "running" and _alive_here(host, summary.get("pid")) is not False:
        return summary
    owner = read_json(layout.lock)  # the lock file outlives its holder: it names the last one
    if (isinstance(owner, dict) and str(owner.get("purpose", "")).startswith("tmt train")
            and _alive_here(owner.get("host"), owner.get("pid")) and _locked(layout.lock)):
        return summary
    return None


def _locked(path: Path) -> bool:
    """Whether a process holds `path`'s flock (`run_dir.RunLock`); true where the filesystem cannot tell."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken and dropped at once: a probe
        return False
    except BlockingIOError:
        return True
    except OSError:  # no locks on this filesystem: its holder's process alone tells
        return True
    finally:
        os.close(fd)


def _row_names(folder: Path, runs_dir: Path) -> dict:
    """A row's `run_dir`, and its `run`: the folder relative to `runs_dir`, or its own name."""
    return {"run_dir": str(folder), "run": folder.relative_to(runs_dir).as_posix() if folder != runs_dir
            else folder.resolve().name}  # `--dir .` inside a run: its folder's name


def _before_training(folder: Path, runs_dir: Path) -> list[dict]:
    """The row of a run claimed by tmt (its marker and config.yaml) that has no summary.json yet:
    its data being prepared, or its start stopped before training."""
    layout = RunDir(folder)
    if not (layout.marker.is_file() and layout.config.is_file()):
        return []
    saved = read_saved_config(layout.config) or {}
    train = saved.get("train") if isinstance(saved.get("train"), dict) else {}
    owner = read_json(layout.lock)  # who took the run, for as long as it lives
    alive = _alive_here(owner.get("host"), owner.get("pid")) if isinstance(owner, dict) else None
    status = {None: "no summary yet", True: "preparing data", False: "stopped before training"}[alive]
    log = layout.train_log if layout.train_log.is_file() else layout.config
    return [{**_row_names(folder, runs_dir), "status": status, "step": 0, "max_steps": train.get("max_steps", "?"),
             "mtime": log.stat().st_mtime}]


def runs_table(rows: list[dict]) -> str:
    """A plain-text table: run, status, steps, best validation BLEU, test BLEU, last update. A failed
    run's status is `failed`; `failure_notes` gives why."""
    header = ("run", "status", "steps", "valid BLEU", "test BLEU", "updated")
    lines = [header]
    for row in rows:
        best = row.get("best_bleu")
        test = row["test"].get("bleu") if isinstance(row.get("test"), dict) else None
        lines.append((row["run"], str(row.get("status", "?")).split(":")[0],
                      f"{row.get('step', '?')}/{row.get('max_steps', '?')}",
                      f"{best:.2f}" if isinstance(best, (int, float)) and best >= 0 else "-",
                      f"{test:.2f}" if isinstance(test, (int, float)) else "-",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(row["mtime"]))))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def failure_notes(rows: list[dict], width: int) -> list[str]:
    """Why each failed run of `rows` failed, `tmt: RUN failed: REASON` wrapped to `width` columns."""
    notes = []
    for row in rows:
        status = str(row.get("status", ""))
        if status.startswith("failed: "):
            notes.append(textwrap.fill(f"tmt: {row['run']} {status}", width, subsequent_indent="  ",
                                       break_long_words=False, break_on_hyphens=False))
    return notes


def _alive_here(host: object, pid: object) -> bool | None:
    """Whether process `pid` of `host` still runs; None when this machine cannot tell."""
    if host != socket.gethostname() or not pid:
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it runs
        return True
    except (ValueError, TypeError, OverflowError):  # a pid not tmt's
        return None
    return True


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
