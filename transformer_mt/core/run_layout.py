"""A run directory's paths (`RunDir`, every file name in this one place) and finding runs and
their checkpoints on disk. Torch-free: the CTranslate2 engine finds its checkpoint without torch."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.core.errors import CheckpointError

JOINT_FILE = "tokenizer.json"  # one tokenizer for both languages (`data.tokenization` writes it elsewhere too)
SRC_FILE = "tokenizer.src.json"
TGT_FILE = "tokenizer.tgt.json"
BEST_NAME = "best.pt"
STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def _entry(name: str) -> property:
    return property(lambda self: self.root / name)


@dataclass(frozen=True)
class RunDir:
    """The paths of the run directory `root`. Nothing is created or checked here."""

    root: Path

    MARKER = ".tmt-run"  # in every run directory tmt claims: tells its leftovers from a user's files
    LOCK = ".tmt-lock"  # locked (`runs.run_dir`) by the one process that writes the run
    CONFIG = "config.yaml"
    SPLITS = "splits.json"  # which rows were carved into valid/test, when the corpus had no such splits
    CORPUS_CACHE = "corpus_cache"  # the filtered text of each split (`data`)
    CORPUS_BUILD = ".corpus_cache.tmp"  # the next corpus_cache/ while it is written
    CORPUS_OLD = ".corpus_cache.old"  # the previous corpus_cache/ while it is replaced
    TOKEN_CACHE = "token_cache"  # token ids as Arrow files (`token_cache`)
    CHECKPOINTS = "checkpoints"
    TENSORBOARD = "tensorboard"
    VALIDATION = "validation"  # the hypotheses of every validation
    EVALUATION = "evaluation"  # the final test's hypotheses and scores, `tmt evaluate`'s outputs
    CTRANSLATE2 = "ctranslate2"  # checkpoints converted for the CTranslate2 engine (`ct2_engine`)
    SUMMARY = "summary.json"
    TRAIN_LOG = "train.log"
    # Everything tmt writes at the top of a run directory; nothing else is ever deleted there.
    ENTRIES = frozenset({MARKER, LOCK, CONFIG, JOINT_FILE, SRC_FILE, TGT_FILE, SPLITS, CORPUS_CACHE, CORPUS_BUILD,
                         CORPUS_OLD, TOKEN_CACHE, CHECKPOINTS, TENSORBOARD, VALIDATION, EVALUATION, CTRANSLATE2, SUMMARY,
                         TRAIN_LOG})

    marker = _entry(MARKER)
    lock = _entry(LOCK)
    config = _entry(CONFIG)
    splits = _entry(SPLITS)
    corpus_cache = _entry(CORPUS_CACHE)
    corpus_build = _entry(CORPUS_BUILD)
    corpus_old = _entry(CORPUS_OLD)
    token_cache = _entry(TOKEN_CACHE)
    checkpoints = _entry(CHECKPOINTS)
    tensorboard = _entry(TENSORBOARD)
    validation = _entry(VALIDATION)
    evaluation = _entry(EVALUATION)
    ctranslate2 = _entry(CTRANSLATE2)
    summary = _entry(SUMMARY)
    train_log = _entry(TRAIN_LOG)

    @property
    def test_scores(self) -> Path:
        """The final test's scores (BLEU, chrF, signatures, checkpoint, hypotheses file)."""
        return self.evaluation / "test_scores.json"

    def validation_hypotheses(self, step: int) -> Path:
        return self.validation / f"step_{step:08d}.txt"

    def hypotheses(self, name: str, checkpoint_stem: str, beam: int, alpha: float | None = None,
                   quantized: str | None = None, glossary: Path | None = None) -> Path:
        """A test-set evaluation's hypotheses (training's final test: `name` "test"; `tmt evaluate`: a
        split or `source_file_name`):
        `{name}.{checkpoint_stem}.beam{beam}[.lp{alpha}][.{quantized}][.glossary-{file}-{digest}].txt`.
        Named after the checkpoint and decoding, so scoring another checkpoint or setting never
        overwrites the hypotheses behind test_scores.json. `alpha`, a length penalty chosen for this
        evaluation, is named only with a beam (greedy decoding has none); `quantized` ("int8") never
        replaces the fp32 hypotheses, nor translations with a `glossary`'s terms those without."""
        settings = f"beam{beam}" + (f".lp{alpha:g}" if alpha is not None and beam > 1 else "")
        settings += f".{quantized}" if quantized else ""
        settings += f".glossary-{self.source_file_name(glossary).removeprefix('file-')}" if glossary else ""
        return self.evaluation / f"{name}.{checkpoint_stem}.{settings}.txt"

    @staticmethod
    def source_file_name(source: Path) -> str:
        """The `name` of a file of sentences' hypotheses: `file-{its name}-{digest of where it is}`, never
        a split's name (the final test's are test.*), nor another folder's file of the same name."""
        where = hashlib.blake2b(str(source.resolve()).encode("utf-8", "surrogateescape"), digest_size=4).hexdigest()
        return f"file-{source.name}-{where}"

    def tokenizer_file(self, joint: bool) -> Path:
        """The tokenizer file a run writes first: its joint one, else the source one."""
        return self.root / (JOINT_FILE if joint else SRC_FILE)

    def keeps(self, path: Path) -> bool:
        """Whether `path` is, or lies in, what tmt keeps of the run: never a place for another
        output. `tmt evaluate`'s hypotheses in `evaluation/` are outputs, not kept."""
        try:
            parts = path.resolve().relative_to(self.root.resolve()).parts
        except ValueError:  # outside the run directory
            return False
        if parts[:1] == (self.EVALUATION,):
            return path.resolve() in (self.evaluation.resolve(), self.test_scores.resolve())
        return not parts or parts[0] in self.ENTRIES


def step_file_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def checkpoint_steps(directory: Path) -> list[int]:
    """Steps of the step checkpoints in `directory`, ascending (none if it is not a folder)."""
    if not directory.is_dir():
        return []
    found = (STEP_FILE.match(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def best_or_latest(directory: Path) -> Path | None:
    """The checkpoint a run translates with: `best.pt` if there is one, else the newest step file."""
    if (directory / BEST_NAME).is_file():
        return directory / BEST_NAME
    steps = checkpoint_steps(directory)
    return directory / step_file_name(steps[-1]) if steps else None


def run_folders(folder: Path) -> list[Path]:
    """The folders that may be runs: `folder`, its subfolders (`runs/<name>`) and theirs (`runs/<group>/<name>`)."""
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
    if (found := best_or_latest(RunDir(run_dir).checkpoints)) is None:
        raise CheckpointError(f"{run_dir}: no checkpoint found in {RunDir(run_dir).checkpoints}")
    return found


def latest_run(runs_dir: Path) -> Path:
    """The run under `runs_dir` whose checkpoints were written most recently."""
    candidates = []
    for run in run_folders(runs_dir)[1:]:  # not `runs/` itself
        files = list(RunDir(run).checkpoints.glob("*.pt"))
        if files:
            candidates.append((max(f.stat().st_mtime for f in files), run))
    if not candidates:
        raise CheckpointError(f"no trained run found under {runs_dir} (train one with `tmt train`, "
                              "or pass --run DIR)")
    return max(candidates)[1]
