"""BPE-dropout (`tokenizer.bpe_dropout`): cached dropout segmentations for training only, cycled
by epoch, exact on resume; plain BPE everywhere else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import TINY_PAIRS, tiny_config, write_corpus
from transformer_mt.config.loading import config_from_dict
from transformer_mt.core.errors import ConfigError
from transformer_mt.data.tokenization import TokenizerPair
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.preparation import prepare_data
from transformer_mt.train.trainer import Trainer, train

# Ten copies of the tiny corpus: a few hundred merges per segmentation, so that at 0.1 two
# segmentations (or one and plain BPE) are the same with a probability of about 0.9^300.
MANY_PAIRS = TINY_PAIRS * 10


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus", {"train": MANY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})


def dropout_config(corpus: Path, **train):
    return tiny_config(corpus, tokenizer={"bpe_dropout": 0.1, "bpe_dropout_variants": 2},
                       train={"batch_tokens": 256, **train})


def test_each_epoch_trains_on_a_dropout_segmentation_that_decodes_to_the_same_text(corpus: Path, tmp_path: Path):
    tokenizers, train_data, valid_data, report = prepare_data(dropout_config(corpus), tmp_path / "run")
    plan = train_data.epoch_rows
    assert len(train_data) == len(MANY_PAIRS) and len(train_data.src_len) == 3 * len(MANY_PAIRS)
    plain_src = tokenizers.encode_src([s for s, _ in MANY_PAIRS])
    plain_tgt = tokenizers.encode_tgt([t for _, t in MANY_PAIRS])
    seen = []
    for epoch in range(3):
        rows = plan(epoch)
        assert sorted(rows % len(MANY_PAIRS)) == list(range(len(MANY_PAIRS)))  # every pair once
        order = np.argsort(rows % len(MANY_PAIRS))
        src_ids, tgt_ids = train_data.ids(rows[order])
        assert tokenizers.decode_tgt(tgt_ids) == [t for _, t in MANY_PAIRS]
        assert tokenizers.src.decode_batch(src_ids) == [s for s, _ in MANY_PAIRS]
        assert src_ids != plain_src and tgt_ids != plain_tgt  # dropped merges: another segmentation
        assert sum(map(len, tgt_ids)) > sum(map(len, plain_tgt))  # smaller pieces, more of them
        seen.append((src_ids, tgt_ids))
    assert seen[0] != seen[1]  # epochs 0 and 1: variants 1 and 2
    assert seen[2] == seen[0]  # epoch 2 cycles back to variant 1
    # Validation keeps plain BPE, and the saved tokenizer never drops (translation uses it).
    assert valid_data.src_ids == tokenizers.encode_src([s for s, _ in TINY_PAIRS[:4]])
    saved = json.loads((tmp_path / "run" / "tokenizer.json").read_text(encoding="utf-8"))
    assert saved["model"]["dropout"] is None
    assert "BPE-dropout" in report.render() and report.bpe_dropout[:2] == (0.1, 2)
    assert report.bpe_dropout[2] > 1  # more target tokens than plain BPE
    assert report.pairs["train"] == len(MANY_PAIRS)


def test_the_sampler_cuts_each_epoch_by_the_lengths_of_its_own_segmentation(corpus: Path, tmp_path: Path):
    cfg = dropout_config(corpus)
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    for epoch in range(2):
        batches = trainer.sampler.epoch_batches(epoch)
        rows = np.concatenate(batches)
        variant = trainer.train_data.epoch_rows.variant(epoch)
        assert (rows // len(MANY_PAIRS) == variant).all()
        assert sorted(rows % len(MANY_PAIRS)) == list(range(len(MANY_PAIRS)))
        for batch in batches:  # within the budget by this segmentation's lengths
            assert len(batch) * trainer.train_data.lengths()[batch].max() <= cfg.train.batch_tokens
    # The report's tokens per epoch are those of the first epoch's segmentation, as trained.
    first = trainer.sampler.epoch_batches(0)
    assert sum(trainer.train_data.batch(b).n_tgt_tokens for b in first) == trainer.data_report.tgt_tokens_per_epoch


def test_epochs_before_the_start_epoch_train_on_plain_bpe(corpus: Path, tmp_path: Path):
    cfg = tiny_config(corpus, tokenizer={"bpe_dropout": 0.1, "bpe_dropout_variants": 2, "bpe_dropout_start_epoch": 2},
                      train={"batch_tokens": 256, "max_steps": 100})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    blocks = [set((np.concatenate(trainer.sampler.epoch_batches(epoch)) // len(MANY_PAIRS)).tolist())
              for epoch in range(5)]
    assert blocks == [{0}, {0}, {1}, {2}, {1}]  # plain BPE, then segmentation 1 + e mod 2 from epoch 2
    # The report: the first epoch is plain BPE; the dropout line names the start and its token ratio.
    plain_tokens = sum(len(ids) + 1 for ids in trainer.tokenizers.encode_tgt([t for _, t in MANY_PAIRS]))
    report = trainer.data_report
    assert report.tgt_tokens_per_epoch == plain_tokens
    rate, variants, ratio, start = report.bpe_dropout
    assert (rate, variants, start) == (0.1, 2, 2) and ratio > 1
    assert "cycled by epoch from epoch 2;" in report.render()
    assert report.to_dict()["bpe_dropout"]["start_epoch"] == 2
    # Until max_steps: the plain epochs' updates, then epochs of the dropout segmentations' batch count.
    dropout_batches = len(trainer.sampler.epoch_batches(2))
    assert report.batches_per_epoch < dropout_batches == report.dropout_batches_per_epoch
    plain_steps = 2 * report.steps_per_epoch
    assert report.epochs_to_max_steps == pytest.approx(2 + (cfg.train.max_steps - plain_steps) / dropout_batches)


def test_a_cached_segmentation_is_reused_not_drawn_again(corpus: Path, tmp_path: Path):
    # Encoding with dropout is not seeded: a second preparation (a resume) must read the cache.
    _, first, *_ = prepare_data(dropout_config(corpus), tmp_path / "run")
    _, again, *_ = prepare_data(dropout_config(corpus), tmp_path / "run")
    rows = np.arange(len(first.src_len))
    assert first.ids(rows) == again.ids(rows)


def test_training_with_bpe_dropout_resumes_exactly(corpus: Path, tmp_path: Path):
    # About two batches an epoch: step 3 stops in the second epoch, on the second segmentation.
    cfg = dropout_config(corpus, max_steps=8, eval_every_steps=4, save_every_steps=4, batch_tokens=1024)
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(cfg, straight, progress=False)
    prepare_run_dir(interrupted, resume=False, overwrite=False)
    # Dropout encoding is not seeded: the two runs share one draw of the segmentations, as a run
    # shares its own with its resume (its token cache).
    shutil.copytree(straight / "token_cache", interrupted / "token_cache")
    train(dropout_config(corpus, max_steps=3, eval_every_steps=4, save_every_steps=3, batch_tokens=1024), interrupted,
          progress=False)
    assert load_checkpoint(interrupted / "checkpoints" / "step_00000003.pt")["sampler"]["epoch"] >= 1  # past a variant
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    train(cfg, interrupted, resume=True, progress=False)
    final = load_checkpoint(straight / "checkpoints" / "step_00000008.pt")
    resumed = load_checkpoint(interrupted / "checkpoints" / "step_00000008.pt")
    assert final["sampler"] == resumed["sampler"] and final["sampler"]["epoch"] >= 2  # both variants trained on
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    assert TokenizerPair.load(interrupted).src.to_str() == TokenizerPair.load(straight).src.to_str()


@pytest.mark.parametrize("tokenizer, problem", [
    ({"bpe_dropout": 1.0}, "tokenizer.bpe_dropout: must be in [0, 1) (0 = off), got 1.0"),
    ({"bpe_dropout": -0.1}, "tokenizer.bpe_dropout: must be in [0, 1) (0 = off), got -0.1"),
    ({"bpe_dropout": "lots"}, "tokenizer.bpe_dropout: expected a number, got 'lots' (str)"),
    ({"bpe_dropout_variants": 0}, "tokenizer.bpe_dropout_variants: must be at least 1, got 0"),
    ({"bpe_dropout_start_epoch": -1}, "tokenizer.bpe_dropout_start_epoch: must be at least 0, got -1"),
])
def test_a_bad_bpe_dropout_setting_is_one_clear_line(tokenizer, problem):
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"data": {"path": "x"}, "tokenizer": tokenizer})
    assert caught.value.problems == [problem]


def test_tmt_data_draws_only_the_segmentation_its_report_describes(corpus: Path, tmp_path: Path, monkeypatch,
                                                                   capsys):
    """The report describes the first epoch: `tmt data` encodes its segmentation, not all K."""
    from tests.helpers import run_cli
    from transformer_mt.config.loading import save_config
    from transformer_mt.data import training_split

    config = tmp_path / "dropout.yaml"
    save_config(dropout_config(corpus), config)
    variants = []
    real = training_split.tokenize_split
    monkeypatch.setattr(training_split, "tokenize_split",
                        lambda *args, **kwargs: variants.append(kwargs["variant"]) or real(*args, **kwargs))
    code, out, err = run_cli(["data", "--config", str(config), "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert variants == [0, 1]
    assert "2 cached segmentations" in out


def test_tmt_data_on_a_dropout_run_reports_the_segmentation_the_run_trains_on(corpus: Path, tmp_path: Path,
                                                                             monkeypatch, capsys):
    """Dropout encoding is not seeded: `tmt data --run-dir` must read the run's cached first
    segmentation, not draw a new one, or its lengths and batches differ from the run's own report."""
    from tests.helpers import run_cli
    from transformer_mt.config.loading import save_config
    from transformer_mt.core.run_layout import RunDir

    cfg, run = dropout_config(corpus), tmp_path / "run"
    *_, report = prepare_data(cfg, run)
    save_config(cfg, RunDir(run).config)
    cached = sorted(path.name for path in (run / "token_cache").iterdir())
    code, out, err = run_cli(["data", "--config", str(RunDir(run).config), "--run-dir", str(run), "--quiet"],
                             monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert f"with the tokenizers of {run}" in err
    assert out.strip() == report.render().strip()
    assert sorted(path.name for path in (run / "token_cache").iterdir()) == cached  # nothing written there
