"""Finding runs and their checkpoint files on disk: which folders may be runs, the step files'
names, and the checkpoint `tmt translate` uses. Torch-free, so that translating with the
CTranslate2 engine (`ct2_engine`) finds its checkpoint without importing torch."""

from __future__ import annotations

import re
from pathlib import Path

from transformer_mt.core.errors import CheckpointError
from transformer_mt.core.run_layout import RunDir

BEST_NAME = "best.pt"
STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def step_file_name(step: int) -> str:
    """The name of step `step`'s checkpoint file."""
    return f"step_{step:08d}.pt"


def checkpoint_steps(directory: Path) -> list[int]:
    """Steps of the step checkpoints in `directory`, ascending (none if it is not a folder)."""
    if not directory.is_dir():
        return []
    found = (STEP_FILE.match(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def run_folders(folder: Path) -> list[Path]:
    """The folders under `folder` that may be runs, as `tmt runs` and `tmt translate` without
    --run look for them: `folder` itself, its subfolders (`runs/<name>`) and theirs
    (`runs/<group>/<name>`, an ablation's runs, say)."""
    if not folder.is_dir():
        return []
    children = sorted(p for p in folder.iterdir() if p.is_dir())
    return [folder, *children, *sorted(p for child in children for p in child.iterdir() if p.is_dir())]


def run_dir_problem(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be a run directory (missing, or a file), or None."""
    if run_dir.is_dir():
        return None
    return "not a run directory (a file)" if run_dir.exists() else "no such run directory"


def find_checkpoint(run_dir: Path) -> Path:
    """`best.pt` if the run has one, else its newest step checkpoint."""
    if problem := run_dir_problem(run_dir):
        raise CheckpointError(f"{run_dir}: {problem}")
    directory = RunDir(run_dir).checkpoints
    if (directory / BEST_NAME).is_file():
        return directory / BEST_NAME
    steps = checkpoint_steps(directory)
    if not steps:
        raise CheckpointError(f"{run_dir}: no checkpoint found in {directory}")
    return directory / step_file_name(steps[-1])


def latest_run(runs_dir: Path) -> Path:
    """The run under `runs_dir` (`runs/<name>` or `runs/<group>/<name>`) whose checkpoints were
    written most recently."""
    candidates = []
    for run in run_folders(runs_dir)[1:]:  # not `runs/` itself
        files = list(RunDir(run).checkpoints.glob("*.pt"))
        if files:
            candidates.append((max(f.stat().st_mtime for f in files), run))
    if not candidates:
        raise CheckpointError(f"no trained run found under {runs_dir} (train one with `tmt train`, "
                              "or pass --run DIR)")
    return max(candidates)[1]
