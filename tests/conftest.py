"""Shared fixtures: one torch thread (the CI machine's two cores are shared), tiny configs."""

from __future__ import annotations

import io
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from transformer_mt.cli import main as cli
from transformer_mt.config.loading import config_from_dict
from transformer_mt.config.schema import Config

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
# For subprocesses: this checkout first (not an installed copy), then the caller's own path
# (on the GPU machine, the wheels carried for packages its image lacks).
PYTHONPATH = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

# A tiny parallel corpus the tests can overfit: short, repetitive, with accents and apostrophes.
TINY_PAIRS = [
    ("Good morning.", "Buongiorno."),
    ("Good evening.", "Buonasera."),
    ("Thank you very much.", "Grazie mille."),
    ("Where is the station?", "Dov'è la stazione?"),
    ("The coffee is hot.", "Il caffè è caldo."),
    ("The city is beautiful.", "La città è bella."),
    ("I am tired.", "Sono stanco."),
    ("Why are you here?", "Perché sei qui?"),
    ("We eat bread.", "Mangiamo il pane."),
    ("She reads a book.", "Lei legge un libro."),
    ("He drinks water.", "Lui beve acqua."),
    ("The man is tall.", "L'uomo è alto."),
]


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_corpus(directory: Path, pairs: dict[str, list[tuple[str, str]]], src: str = "en", tgt: str = "it") -> Path:
    """Write aligned `{split}.{lang}` files for each split and return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, split_pairs in pairs.items():
        (directory / f"{split}.{src}").write_text("".join(s + "\n" for s, _ in split_pairs), encoding="utf-8")
        (directory / f"{split}.{tgt}").write_text("".join(t + "\n" for _, t in split_pairs), encoding="utf-8")
    return directory


def tiny_config(data_dir: Path, **sections) -> Config:
    """A tiny seeded model config (d_model=16 unless overridden) over a local corpus."""
    raw = {
        "name": "tiny",
        "seed": 3,
        "data": {"format": "text", "path": str(data_dir), "valid_size": 2, "test_size": 2},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32, "dropout": 0.1, "max_len": 64},
        "train": {"max_steps": 6, "batch_tokens": 64, "lr": 1e-3, "warmup_steps": 2, "log_every_steps": 1,
                  "eval_every_steps": 3, "save_every_steps": 3, "eval_max_sentences": 0, "precision": "fp32",
                  "device": "cpu"},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return config_from_dict(raw)


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})


def run_cli(args: list[str], monkeypatch, capsys, cwd: Path, stdin: bytes | None = None) -> tuple[int, str, str]:
    """Run `tmt ARGS` in-process (what the console script calls) in `cwd`: (exit code, stdout, stderr)."""
    monkeypatch.chdir(cwd)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code = cli.main(args)
    finally:  # cli.main logs to this test's captured stderr, which is closed after the test
        root.handlers = handlers
        root.setLevel(level)  # not `root.level =`: that keeps the loggers' cached INFO-enabled answers
    out, err = capsys.readouterr()
    return code, out, err
