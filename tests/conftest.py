"""Shared fixtures: one torch thread (the CI machine's two cores are shared), a tiny corpus, a tiny
trained run. Plain functions and constants are in helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_PAIRS, tiny_config, tmt, write_corpus
from transformer_mt.config.loading import save_config


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder holding a tiny trained run at runs/tiny (trained through `tmt train`) and its config."""
    workdir = tmp_path_factory.mktemp("terminal")
    corpus = write_corpus(workdir / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    save_config(tiny_config(corpus, train={"max_steps": 4, "eval_every_steps": 2, "save_every_steps": 2,
                                           "log_every_steps": 1}), workdir / "tiny.yaml")
    result = tmt("train", "--config", "tiny.yaml", cwd=workdir)
    assert result.returncode == 0, result.stderr
    return workdir
