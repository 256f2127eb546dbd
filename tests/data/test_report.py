"""The preflight data report: numbers on a corpus small enough to count by hand, and `tmt data`."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.helpers import DEMO_CONFIG, TINY_PAIRS, run_cli, tiny_config, write_corpus
from transformer_mt.config.loading import save_config
from transformer_mt.data.report import CorpusShare, estimated_time, format_duration, length_stats
from transformer_mt.data.tokenization import SPECIAL_TOKENS
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.preparation import prepare_data
from transformer_mt.train.trainer import Trainer, train

# One token per whitespace word (a word-level tokenizer saved as the run's tokenizer.json), so
# every length below is a word count. `e` and `v` are in the vocabulary but only in a pair that
# is filtered out; `q` and `ω` are not in it at all (<unk>).
VOCABULARY = ["a", "b", "c", "d", "e", "x", "y", "z", "w", "v"]
TRAIN = [
    ("a", "x"),                   # 1/1 tokens
    ("a b", "x y"),               # 2/2
    ("a b c", "x y z"),           # 3/3
    ("a b c", "x y"),             # 3/2
    ("", "x"),                    # empty
    ("a b c d e", "x y z w v"),   # 5 words > data.max_words=4: too_long
    ("a", "x y z"),               # ratio 3 > data.max_length_ratio=2: length_ratio
    ("a b c d", "x y z w"),       # 4 tokens > model.max_len - 1 = 3: too_many_tokens
    ("b", "y"),                   # 1/1
    ("c a", "z"),                 # 2/1, ratio exactly 2: kept
]
VALID = [("a b", "x y"), ("e q", "x ω"), ("b c d a", "y z w x"), ("", "")]
TEST = [("a", "x"), ("b", "")]


def word_level_tokenizer() -> Tokenizer:
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *VOCABULARY])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


@pytest.fixture
def counted(tmp_path: Path):
    """(config, run directory holding the word-level tokenizer) over the hand-counted corpus."""
    corpus = write_corpus(tmp_path / "corpus", {"train": TRAIN, "valid": VALID, "test": TEST})
    cfg = tiny_config(corpus, data={"max_words": 4, "max_length_ratio": 2.0}, model={"max_len": 4},
                      train={"batch_tokens": 8, "max_steps": 6})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    word_level_tokenizer().save(str(run_dir / "tokenizer.json"))
    return cfg, run_dir


def test_report_counts_pairs_filters_lengths_unknowns_and_steps_by_hand(counted):
    cfg, run_dir = counted
    *_, report = prepare_data(cfg, run_dir)
    # Train keeps pairs 1, 2, 3, 4, 9, 10; valid and test lose their empty pair.
    assert report.pairs == {"train": 6, "valid": 3, "test": 1}
    assert report.carved == ()  # the corpus has its own valid and test files
    # One empty pair in each split; one pair for each of the other filters.
    assert report.removed == {"empty": 3, "too_long": 1, "length_ratio": 1, "too_many_tokens": 1}
    # Nearest rank over n values: p50 is the ceil(n/2)-th smallest, p90 and p99 the ceil(0.9n)-th
    # and ceil(0.99n)-th. Train src [1,1,2,2,3,3]: 2, 3, 3; tgt [1,1,1,2,2,3]: 1, 3, 3.
    # Valid (untruncated) src and tgt [2,2,4]: 2, 4, 4.
    lengths = {key: (*stats.percentiles.values(), stats.max) for key, stats in report.lengths.items()}
    assert lengths == {("train", "src"): (2, 3, 3, 3), ("train", "tgt"): (1, 3, 3, 3),
                       ("valid", "src"): (2, 4, 4, 4), ("valid", "tgt"): (2, 4, 4, 4)}
    assert report.valid_truncated == {"src": 1, "tgt": 1}  # "b c d a" and "y z w x": 4 tokens > 3
    # Valid has 8 tokens a side; one <unk> each (q, ω).
    assert report.unk_rate == {"src": 1 / 8, "tgt": 1 / 8}
    # Training words after the data.* filters: a b c d / x y z w. Valid src words a b e q b c d a:
    # 6 of 8 seen (not e, q); tgt x y x ω y z w x: 7 of 8 (not ω).
    assert report.word_coverage == {"src": 6 / 8, "tgt": 7 / 8}
    # Tokens + EOS: src 1+2+3+3+1+2 + 6 = 18, tgt 1+2+3+2+1+1 + 6 = 16.
    assert (report.src_tokens_per_epoch, report.tgt_tokens_per_epoch) == (18, 16)
    # Padded lengths max(src, tgt) + 1 sorted: 2 2 3 3 4 4; with 8 tokens a batch that is
    # [2 2] (2·2=4; adding a 3 gives 3·3=9), [3 3] (6; adding a 4 gives 12), [4 4] (8).
    assert report.batches_per_epoch == report.steps_per_epoch == 3
    assert report.epochs_to_max_steps == 2.0


def test_steps_count_accumulated_batches_and_processes(counted):
    cfg, run_dir = counted
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, accum_steps=2))
    *_, report = prepare_data(cfg, run_dir, world_size=2)
    # 3 batches per epoch (as above), the last group of 2 filled up with a batch again, as the
    # training sampler does under torchrun (it used to be counted as 3); 2 accumulated x 2
    # processes = 4 batches per update.
    assert (report.batches_per_epoch, report.steps_per_epoch) == (4, 1.0)
    assert report.epochs_to_max_steps == 6.0  # 6 steps x 4 batches / 4
    assert "4 batches of at most 8 padded tokens = 1.0 steps of 4 batches" in report.render()


def test_report_renders_a_table_with_every_number(counted):
    cfg, run_dir = counted
    *_, report = prepare_data(cfg, run_dir)
    text = report.render()
    for expected in ("train 6   valid 3   test 1", "too_many_tokens 1", "12.50%", "75.0%", "87.5%",
                     "16 target tokens (18 source), 3 batches of at most 8 padded tokens", "6 steps = 2.0 epochs",
                     "1 validation source, cut when translated; 1 reference, cut in the validation loss only"):
        assert expected in text, expected
    # A long reference alone is no source cut when translated (the line used to count pairs as
    # such), and the line stays under the lengths when the corpora's table comes first.
    corpora = (CorpusShare("a", 4, 9, 1.0, 0.5, 0.5), CorpusShare("b", 2, 7, 2.0, 0.5, 0.5))
    only_reference = dataclasses.replace(report, valid_truncated={"src": 0, "tgt": 2},
                                         corpora=corpora).render().splitlines()
    line = next(i for i, text in enumerate(only_reference) if text.startswith("  longer than max_len"))
    assert only_reference[line].split(None, 3)[-1] == "2 references, cut in the validation loss only"
    assert only_reference[line - 1].strip().startswith(f"valid {report.languages['tgt']}")  # the lengths' last row
    train_en = next(line for line in text.splitlines() if line.strip().startswith("train en"))
    assert train_en.split()[2:] == ["2", "3", "3", "3"]


def test_steps_and_tokens_per_epoch_are_what_the_training_sampler_produces(tiny_corpus: Path, tmp_path: Path):
    cfg = tiny_config(tiny_corpus, train={"batch_tokens": 40}, model={"max_len": 16})
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, resume=False, overwrite=False)
    trainer = Trainer(cfg, run_dir, progress=False)
    report = trainer.data_report
    for epoch in range(4):  # the shuffle differs per epoch, the number of batches does not
        batches = trainer.sampler.epoch_batches(epoch)
        assert len(batches) == report.batches_per_epoch
        assert sum(trainer.train_data.batch(b).n_tgt_tokens for b in batches) == report.tgt_tokens_per_epoch


def test_length_percentiles_are_the_nearest_rank():
    stats = length_stats(list(range(100, 0, -1)))  # 1..100 in any order: the p-th percentile is p
    assert stats.percentiles == {50: 50, 90: 90, 99: 99} and stats.max == 100
    assert length_stats([7]).percentiles == {50: 7, 90: 7, 99: 7}
    assert length_stats([3, 1, 2]).percentiles[50] == 2  # ceil(1.5) = the 2nd smallest


def test_estimated_time_scales_tokens_per_epoch_by_the_measured_throughput(counted):
    cfg, run_dir = counted
    *_, report = prepare_data(cfg, run_dir)
    # 16 target tokens an epoch at 4 tokens/s: 4 s. At step 3 of 6, 3 steps of 16/3 tokens remain: 4 s.
    line = estimated_time(report, 4.0, step=3)
    assert "4s per epoch, 4s more to train.max_steps=6" in line
    assert [format_duration(s) for s in (0.44, 4, 42, 185, 7620, 273600)] == ["0.4s", "4s", "42s", "3m 05s", "2h 07m",
                                                                            "3d 04h"]


def test_training_logs_the_report_before_the_first_step_and_then_the_time_estimate(tiny_corpus: Path, tmp_path: Path,
                                                                                    caplog):
    cfg = tiny_config(tiny_corpus, train={"max_steps": 3, "eval_every_steps": 3, "save_every_steps": 3},
                      model={"n_layers": 1})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    with caplog.at_level(logging.INFO, logger="transformer_mt"):
        train(cfg, tmp_path / "run", progress=False)
    messages = [record.getMessage() for record in caplog.records]
    report = next(i for i, m in enumerate(messages) if m.startswith("data report:"))
    first_step = next(i for i, m in enumerate(messages) if m.startswith("step 1/3 (33%, "))
    assert report < first_step
    estimates = [m for m in messages if m.startswith("estimated training time")]
    assert len(estimates) == 1 and "more to train.max_steps=3" in estimates[0]
    assert messages.index(estimates[0]) == first_step + 1


# --- tmt data --------------------------------------------------------------------------------

def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory`, by relative path: its bytes and modification time."""
    return {p.relative_to(directory).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_with_packed_batches_the_report_counts_the_first_epochs_packs(tiny_corpus: Path, tmp_path: Path):
    cfg = tiny_config(tiny_corpus, train={"batch_tokens": 40, "batching": "packed"}, model={"max_len": 16})
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, resume=False, overwrite=False)
    trainer = Trainer(cfg, run_dir, progress=False)
    report, pack = trainer.data_report, trainer.train_step.batches.pack
    assert report.pack_tokens == (pack.src_tokens, 40) and report.to_dict()["pack_tokens"] == [pack.src_tokens, 40]
    assert report.batches_per_epoch == len(trainer.sampler.epoch_batches(0))
    assert f"{report.batches_per_epoch} packs of {pack.src_tokens} source and 40 target tokens" in report.render()


def test_tmt_data_refuses_a_pair_longer_than_a_pack_naming_the_key(tmp_path: Path, monkeypatch, capsys):
    words = "uno due tre quattro cinque sei sette otto nove dieci".split()
    pairs = [(words[i % 10], " ".join(words)) for i in range(20)] + [(" ".join(words * 3), " ".join(words))]
    corpus = write_corpus(tmp_path / "corpus", {"train": pairs, "valid": pairs[:2], "test": pairs[:2]})
    save_config(tiny_config(corpus, data={"max_length_ratio": 10.0}, train={"batching": "packed"}),
                tmp_path / "packed.yaml")
    code, out, err = run_cli(["data", "--config", str(tmp_path / "packed.yaml")], monkeypatch, capsys, tmp_path)
    assert code == 1 and not out
    assert err.strip().splitlines()[-1].startswith("tmt: error: train.batch_tokens: training pair 21 has 31 source "
                                                   "tokens, more than a pack's 20")


def test_tmt_data_prints_the_report_and_writes_nothing(tmp_path: Path, monkeypatch, capsys):
    code, out, err = run_cli(["data", "--config", str(DEMO_CONFIG), "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert "train 640   valid 60   test 60" in out and "batches of at most 1,024 padded tokens" in out
    assert "trained for this report" in err
    assert list(tmp_path.iterdir()) == []  # no runs/demo, no tokenizer, no splits.json


def test_tmt_data_reuses_a_runs_tokenizer_without_touching_the_run(counted, tmp_path: Path, monkeypatch, capsys):
    cfg, run_dir = counted
    config_file = tmp_path / "counted.yaml"
    save_config(cfg, config_file)
    save_config(cfg, run_dir / "config.yaml")
    before = snapshot(run_dir)

    code, out, err = run_cli(["data", "--config", str(config_file), "--run-dir", str(run_dir)],
                             monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert "12.50%" in out  # the word-level tokenizer's <unk> rate: it was reused
    assert f"the tokenizers of {run_dir}" in err
    assert snapshot(run_dir) == before

    # Other tokenizer settings than the run's: fresh BPE (it saw every character: no <unk>).
    code, out, err = run_cli(["data", "--config", str(config_file), "--run-dir", str(run_dir),
                              "--set", "tokenizer.vocab_size=300"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert "trained for this report" in err and "12.50%" not in out
    assert f"tmt: --run-dir {run_dir} not used: its settings differ (tokenizer.vocab_size)" in err  # said why
    assert snapshot(run_dir) == before
    # A --run-dir that is not there (a typo) or is a file is an error, not a silent fresh report.
    (tmp_path / "a-file").write_text("mine", encoding="utf-8")
    for where, said in (("runs/typo", "no such run directory"), ("a-file", "not a run directory (a file)")):
        code, out, err = run_cli(["data", "--config", str(config_file), "--run-dir", where], monkeypatch, capsys,
                                 tmp_path)
        assert (code, out, err) == (1, "", f"tmt: error: --run-dir {where}: {said}\n")


def test_tmt_data_with_a_bad_config_exits_2_naming_the_key(tmp_path: Path, monkeypatch, capsys):
    code, out, err = run_cli(["data", "--config", str(DEMO_CONFIG), "--set", "model.n_heads=3"],
                             monkeypatch, capsys, tmp_path)
    assert code == 2
    assert "model.n_heads" in err and "Traceback" not in err and out == ""
    code, _, err = run_cli(["data", "--config", str(tmp_path / "missing.yaml")], monkeypatch, capsys, tmp_path)
    assert code == 2 and "missing.yaml" in err
    assert list(tmp_path.iterdir()) == []


def test_tmt_data_reads_dev_files_as_validation_and_says_which_split_is_carved(tmp_path: Path, monkeypatch, capsys):
    # A user walk: with dev.en/dev.it beside train, the report showed "valid 2" and no hint that
    # those pairs were carved from train while dev.* went unread.
    corpus = write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS, "dev": TINY_PAIRS[:3]})
    config_file = tmp_path / "tiny.yaml"
    save_config(tiny_config(corpus), config_file)

    code, out, err = run_cli(["data", "--config", str(config_file)], monkeypatch, capsys, tmp_path)

    assert code == 0, err
    assert "train 10   valid 3   test 2 (carved from train)" in out  # 12 pairs less the 2 carved as test


def test_tmt_data_on_an_existing_run_reports_what_its_training_saw(tmp_path: Path, monkeypatch, capsys):
    # Only a train split: valid and test are carved, and the run's splits.json must be reused.
    corpus = write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS})
    cfg = tiny_config(corpus)
    config_file, run_dir = tmp_path / "tiny.yaml", tmp_path / "runs" / "tiny"
    save_config(cfg, config_file)
    prepare_run_dir(run_dir, resume=False, overwrite=False)
    save_config(cfg, run_dir / "config.yaml")
    # A split the seeded carve would not make: the two longest sentences as validation.
    (run_dir / "splits.json").write_text(json.dumps({"source_rows": 12, "seed": 3, "valid": [2, 3], "test": [0, 1]}))
    *_, report = prepare_data(cfg, run_dir)  # reuses splits.json and writes tokenizer.json, as training does
    before = snapshot(run_dir)
    assert {name.split("/")[0] for name in before} == {".tmt-run", ".tmt-lock", "config.yaml", "splits.json",
                                                     "tokenizer.json", "corpus_cache", "token_cache"}

    code, out, err = run_cli(["data", "--config", str(config_file)], monkeypatch, capsys, tmp_path)  # runs/tiny
    assert code == 0, err
    assert out == report.render() + "\n"
    assert "train 8   valid 2 (carved from train)   test 2 (carved from train)" in out  # 12 pairs, 2 + 2 carved
    assert snapshot(run_dir) == before
    (tmp_path / "fresh").mkdir()
    *_, fresh = prepare_data(cfg, tmp_path / "fresh")  # without the run: its own carve and tokenizer
    assert fresh.render() != report.render()
