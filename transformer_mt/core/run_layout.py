"""`RunDir`: every path inside a run directory, named in this one place.

A run directory is self-contained: `tmt translate` needs nothing else (README, "Training").
The tokenizer files' names are here too: `data.tokenization` writes them into other folders as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

JOINT_FILE = "tokenizer.json"  # one tokenizer for both languages
SRC_FILE = "tokenizer.src.json"
TGT_FILE = "tokenizer.tgt.json"


@dataclass(frozen=True)
class RunDir:
    """The paths of the run directory `root`. Nothing is created or checked here."""

    root: Path

    # Written into every run directory tmt creates or claims: it tells tmt's own leftovers (a
    # `config.yaml`, tokenizers, caches) from a user's files of the same names.
    MARKER = ".tmt-run"
    # Locked (`runs.lock`) by the one process that writes the run: `tmt train`, `tmt average`, ...
    LOCK = ".tmt-lock"
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

    def keeps(self, path: Path) -> bool:
        """Whether `path` is, or lies in, what tmt keeps of the run (the directory itself, its
        checkpoints, tokenizers, config, caches, logs, validation hypotheses, the final test's
        scores): never a place for another output. `tmt evaluate`'s hypotheses in `evaluation/` are
        outputs, not kept."""
        try:
            parts = path.resolve().relative_to(self.root.resolve()).parts
        except ValueError:  # outside the run directory
            return False
        if parts[:1] == (self.EVALUATION,):
            return path.resolve() in (self.evaluation.resolve(), self.test_scores.resolve())
        return not parts or parts[0] in self.ENTRIES

    @property
    def marker(self) -> Path:
        return self.root / self.MARKER

    @property
    def ctranslate2(self) -> Path:
        return self.root / self.CTRANSLATE2

    @property
    def lock(self) -> Path:
        return self.root / self.LOCK

    @property
    def config(self) -> Path:
        return self.root / self.CONFIG

    @property
    def splits(self) -> Path:
        return self.root / self.SPLITS

    @property
    def corpus_cache(self) -> Path:
        return self.root / self.CORPUS_CACHE

    @property
    def corpus_build(self) -> Path:
        return self.root / self.CORPUS_BUILD

    @property
    def corpus_old(self) -> Path:
        return self.root / self.CORPUS_OLD

    @property
    def token_cache(self) -> Path:
        return self.root / self.TOKEN_CACHE

    @property
    def checkpoints(self) -> Path:
        return self.root / self.CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.root / self.TENSORBOARD

    @property
    def validation(self) -> Path:
        return self.root / self.VALIDATION

    def validation_hypotheses(self, step: int) -> Path:
        return self.validation / f"step_{step:08d}.txt"

    @property
    def evaluation(self) -> Path:
        return self.root / self.EVALUATION

    @property
    def test_scores(self) -> Path:
        """The final test's scores (BLEU, chrF, signatures, checkpoint, hypotheses file)."""
        return self.evaluation / "test_scores.json"

    @property
    def summary(self) -> Path:
        return self.root / self.SUMMARY

    @property
    def train_log(self) -> Path:
        return self.root / self.TRAIN_LOG

    def tokenizer_file(self, joint: bool) -> Path:
        """The tokenizer file a run writes first: its joint one, else the source one."""
        return self.root / (JOINT_FILE if joint else SRC_FILE)
