"""Several corpora mixed by weight (`data.corpora`): the pairs of each epoch, the corpus files,
the report, exact resume and the configuration's errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import TINY_PAIRS, run_cli, tiny_config, write_corpus
from transformer_mt.config.loading import config_from_dict, load_config, save_config
from transformer_mt.config.schema import config_to_dict
from transformer_mt.core.errors import ConfigError, DataError
from transformer_mt.data.corpus import load_corpus
from transformer_mt.data.training_split import EpochRows
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.preparation import prepare_data
from transformer_mt.train.trainer import Trainer, train

OTHER_PAIRS = [(f"Number {i} is here.", f"Il numero {i} è qui.") for i in range(8)]


@pytest.fixture
def corpora(tmp_path: Path) -> tuple[Path, Path]:
    first = write_corpus(tmp_path / "first", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:3], "test": TINY_PAIRS[3:5]})
    second = write_corpus(tmp_path / "second", {"train": OTHER_PAIRS, "valid": OTHER_PAIRS[:2]})
    return first, second


def mixed_config(corpora: tuple[Path, Path], weights=(1.0, 2.0), **train):
    first, second = corpora
    return tiny_config("", data={"path": "", "corpora": [{"path": str(first), "weight": weights[0]},
                                                         {"path": str(second), "weight": weights[1]}]},
                       train={"batch_tokens": 128, **train})


def mixture(counts, weights, seed, epoch):
    return EpochRows(counts, weights, seed).pairs(epoch)


def test_each_epoch_shows_every_pair_of_a_corpus_weight_times():
    # Corpus 0: 10 pairs, weight 2 -> 20 examples, each pair twice. Corpus 1: 7 pairs, weight 0.5
    # -> round(3.5) = 4 distinct pairs (halves round up). Corpus 2: 4 pairs, weight 1.5 -> 6: each
    # once, and 2 of them again.
    counts, weights = (10, 7, 4), (2.0, 0.5, 1.5)
    drawn = []
    for epoch in range(6):
        pairs = Counter(mixture(counts, weights, seed=3, epoch=epoch).tolist())
        assert all(pairs[i] == 2 for i in range(10))
        second = [i for i in range(10, 17) if pairs[i]]
        assert len(second) == 4 and all(pairs[i] == 1 for i in second)
        third = [pairs[i] for i in range(17, 21)]
        assert sorted(third) == [1, 1, 2, 2]
        assert sum(pairs.values()) == 20 + 4 + 6
        drawn.append(second)
    assert len({tuple(d) for d in drawn}) > 1  # another half of corpus 1 in another epoch
    assert np.array_equal(mixture(counts, weights, 3, 4), mixture(counts, weights, 3, 4))  # a function of (seed, epoch)
    assert not all(np.array_equal(mixture(counts, weights, 3, e), mixture(counts, weights, 4, e)) for e in range(6))


def test_the_corpora_are_read_one_after_another_and_validation_comes_from_the_first(corpora, tmp_path: Path):
    cfg = mixed_config(corpora)
    corpus = load_corpus(cfg.data, cfg.seed, tmp_path / "run")
    assert list(zip(corpus.train["src"], corpus.train["tgt"])) == TINY_PAIRS + OTHER_PAIRS
    assert list(zip(corpus.valid["src"], corpus.valid["tgt"])) == TINY_PAIRS[:3]  # not the second's valid
    assert list(zip(corpus.test["src"], corpus.test["tgt"])) == TINY_PAIRS[3:5]
    assert corpus.train_parts == ((str(corpora[0]), 12), (str(corpora[1]), 8))


def test_a_missing_split_is_carved_from_the_first_corpus_only(tmp_path: Path):
    first = write_corpus(tmp_path / "first", {"train": TINY_PAIRS})
    second = write_corpus(tmp_path / "second", {"train": OTHER_PAIRS, "valid": OTHER_PAIRS[:2],
                                                "test": OTHER_PAIRS[2:4]})
    cfg = mixed_config((first, second))
    corpus = load_corpus(cfg.data, cfg.seed, tmp_path / "run")
    carved = set(zip(corpus.valid["src"], corpus.valid["tgt"])) | set(zip(corpus.test["src"], corpus.test["tgt"]))
    assert len(carved) == 4 and carved <= set(TINY_PAIRS)
    assert corpus.train_parts == ((str(first), 8), (str(second), 8))
    assert set(zip(corpus.train["src"], corpus.train["tgt"])).isdisjoint(carved)


def test_the_training_sampler_draws_each_corpus_by_its_weight(corpora, tmp_path: Path):
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(mixed_config(corpora, weights=(1.0, 2.0)), tmp_path / "run", progress=False)
    assert len(trainer.train_data) == 20
    for epoch in range(2):
        rows = Counter(np.concatenate(trainer.sampler.epoch_batches(epoch)).tolist())
        assert all(rows[i] == 1 for i in range(12)) and all(rows[i] == 2 for i in range(12, 20))
        assert sum(rows.values()) == 12 + 16
    first = trainer.sampler.epoch_batches(0)
    assert sum(trainer.train_data.batch(b).n_tgt_tokens for b in first) == trainer.data_report.tgt_tokens_per_epoch


def test_the_data_report_gives_each_corpus_its_pairs_tokens_and_share(corpora, tmp_path: Path, monkeypatch, capsys):
    config_file = tmp_path / "mixed.yaml"
    save_config(mixed_config(corpora, weights=(1.0, 0.5)), config_file)
    code, out, err = run_cli(["data", "--config", str(config_file)], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    rows = [next(line.split() for line in out.splitlines() if line.strip().startswith(str(path))) for path in corpora]
    # 12 pairs of weight 1 and 4 of the second corpus's 8 (weight 0.5) make an epoch of 16: 75% and 25%.
    assert [row[1] for row in rows] == ["12", "8"]
    assert [row[3:5] for row in rows] == [["1", "75.0%"], ["0.5", "25.0%"]]
    tokenizers, *_, report = prepare_data(load_config(config_file), tmp_path / "run")
    for pairs, row, share in zip((TINY_PAIRS, OTHER_PAIRS), rows, report.corpora):
        expected = sum(map(len, tokenizers.encode_tgt([t for _, t in pairs]))) + len(pairs)  # + EOS each
        assert share.tgt_tokens == expected and row[2] == f"{expected:,}"
    # The token share: the first corpus gives all its pairs every epoch, so its tokens over the epoch's
    # (which the sampler's batches hold: test above); the second's the rest, from a random half of its pairs.
    first_share = report.corpora[0].tgt_tokens / report.tgt_tokens_per_epoch
    assert [row[5] for row in rows] == [f"{100 * first_share:.1f}%", f"{100 * (1 - first_share):.1f}%"]
    assert report.corpora[0].tgt_share == pytest.approx(first_share)
    assert report.to_dict()["corpora"][1] == {"path": str(corpora[1]), "pairs": 8, "weight": 0.5, "share": 0.25,
                                               "tgt_tokens": report.corpora[1].tgt_tokens,
                                               "tgt_share": pytest.approx(1 - first_share), "pair": None}


def test_tagged_corpora_train_a_multilingual_model_scored_per_language_pair(tmp_path: Path, monkeypatch, capsys):
    # Johnson et al. 2017: each corpus's sources begin with its target-language tag, a token of the
    # trained tokenizer; validation and test come from both corpora and are scored per pair too.
    french = [(f"Number {i} is here.", f"Le numéro {i} est ici.") for i in range(8)]
    ita = write_corpus(tmp_path / "ita", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:3], "test": TINY_PAIRS[3:5]})
    fra = write_corpus(tmp_path / "fra", {"train": french, "valid": french[:2], "test": french[2:4]})
    cfg = tiny_config("", data={"path": "", "corpora": [{"path": str(ita), "target_lang": "ita"},
                                                        {"path": str(fra), "target_lang": "fra"}]},
                      train={"batch_tokens": 128, "max_steps": 3, "eval_every_steps": 3, "save_every_steps": 3})
    save_config(cfg, tmp_path / "multi.yaml")
    code, out, err = run_cli(["data", "--config", "multi.yaml"], monkeypatch, capsys, tmp_path)
    assert code == 0 and f"{ita} (en-ita)" in out and f"{fra} (en-fra)" in out, out + err
    code, _, err = run_cli(["train", "--config", "multi.yaml", "--run-dir", "runs/multi", "--no-progress"],
                           monkeypatch, capsys, tmp_path)
    assert code == 0, err
    run = tmp_path / "runs" / "multi"
    corpus = load_corpus(cfg.data, cfg.seed, run)
    assert corpus.train["src"] == [f">>ita<< {s}" for s, _ in TINY_PAIRS] + [f">>fra<< {s}" for s, _ in french]
    assert corpus.valid["src"] == [f">>ita<< {s}" for s, _ in TINY_PAIRS[:3]] + [f">>fra<< {s}" for s, _ in french[:2]]
    from transformer_mt.data.tokenization import TokenizerPair

    tokenizers = TokenizerPair.load(run)
    assert set(tokenizers.language_tags) == {">>ita<<", ">>fra<<"}
    first = tokenizers.encode_src(corpus.train["src"][:1])[0]  # the tag is one token, the rest as untagged
    assert first == [tokenizers.language_tags[">>ita<<"], *tokenizers.encode_src([TINY_PAIRS[0][0]])[0]]
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    valid, test = summary["last_valid"]["pairs"], summary["test"]["pairs"]
    assert {pair: scores["sentences"] for pair, scores in valid.items()} == {"en-fra": 2, "en-ita": 3}
    assert {pair: scores["sentences"] for pair, scores in test.items()} == {"en-fra": 2, "en-ita": 2}
    assert all(set(scores) == {"sentences", "bleu", "chrf"} for scores in (*valid.values(), *test.values()))
    assert "validation at step 3 per language pair: en-fra BLEU" in err and "test per language pair: en-fra" in err
    code, _, err = run_cli(["translate", "--run", str(run), "Good morning."], monkeypatch, capsys, tmp_path)
    assert code == 2 and "this model translates into 2 languages (ita, fra)" in err, err
    code, out, err = run_cli(["translate", "--run", str(run), "--target-lang", "fra", "Good morning."], monkeypatch,
                             capsys, tmp_path)
    assert code == 0, err

    # tmt evaluate scores each pair as the final test does; tmt compare sets the runs' pairs side by side.
    code, out, err = run_cli(["evaluate", "--run", str(run), "--engine", "torch", "--bootstrap", "0",
                              "--no-diagnostics", "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert "\n\nper language pair:\n" + "".join(
        f"  {pair}  BLEU = {s['bleu']:.2f}  chrF = {s['chrf']:.2f}  ({s['sentences']} sentences)\n"
        for pair, s in test.items()) in out, out
    (tmp_path / "perfect.txt").write_text("".join(f"{line}\n" for line in corpus.test["tgt"]), encoding="utf-8")
    compare = ["compare", str(run), "perfect.txt", "--bootstrap", "10", "--trials", "10", "--examples", "0"]
    code, out, err = run_cli([*compare, "--format", "json"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    systems = json.loads(out)["systems"]
    assert systems[0]["pairs"] == test
    assert {pair: s["chrf"] for pair, s in systems[1]["pairs"].items()} == {"en-fra": 100.0, "en-ita": 100.0}
    code, out, err = run_cli(compare, monkeypatch, capsys, tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("per language pair")))
    assert lines[header].split() == ["per", "language", "pair", "en-fra", "(2)", "BLEU", "en-fra", "(2)", "chrF",
                                     "en-ita", "(2)", "BLEU", "en-ita", "(2)", "chrF"]
    assert lines[header + 1].split() == [str(run), *(f"{s[m]:.2f}" for s in test.values() for m in ("bleu", "chrf"))]
    assert lines[header + 2].split()[0] == "perfect.txt"


def test_training_on_mixed_corpora_resumes_exactly(corpora, tmp_path: Path):
    cfg = mixed_config(corpora, weights=(1.0, 0.5), max_steps=8, eval_every_steps=4, save_every_steps=4)
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(cfg, straight, progress=False)
    prepare_run_dir(interrupted, resume=False, overwrite=False)
    train(mixed_config(corpora, weights=(1.0, 0.5), max_steps=3, eval_every_steps=4, save_every_steps=3),
          interrupted, progress=False)
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    train(cfg, interrupted, resume=True, progress=False)
    final = load_checkpoint(straight / "checkpoints" / "step_00000008.pt")
    resumed = load_checkpoint(interrupted / "checkpoints" / "step_00000008.pt")
    assert final["sampler"] == resumed["sampler"] and final["sampler"]["epoch"] >= 1  # past a fresh draw
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name


@pytest.mark.parametrize("data, problem", [
    ({"corpora": [{"weight": 2.0}]},
     "data.corpora[0].path: missing; each corpus needs a path (a hub dataset or a local directory)"),
    ({"corpora": [{"path": "a"}, {"path": "b", "weight": 0}]}, "data.corpora[1].weight: must be positive, got 0.0"),
    ({"corpora": [{"path": "a", "weight": -1}]}, "data.corpora[0].weight: must be positive, got -1.0"),
    ({"corpora": [{"path": "a", "wieght": 2}]}, "data.corpora[0].wieght: unknown key (did you mean 'weight'?)"),
    ({"corpora": ["a"]}, "data.corpora[0]: expected a mapping, got 'a' (str)"),
    ({"corpora": [{"path": "a", "target_lang": "ita"}, {"path": "b"}]},
     "data.corpora[1].target_lang: missing; with target-language tags every corpus names its target_lang (its "
     "sources carry the tag)"),
    ({"corpora": [{"path": "a", "target_lang": ">>ita<<"}]},
     "data.corpora[0].target_lang: give the language code alone, e.g. 'ita' for the tag '>>ita<<'"),
    ({"corpora": {"path": "a"}}, "data.corpora: expected a list of mappings, got {'path': 'a'} (dict)"),
    ({"path": "x", "corpora": [{"path": "a"}]},
     "data.corpora: given together with data.path; list every corpus under data.corpora (the first gives "
     "validation and test), or use data.path alone (on the command line: --set data.path=null)"),
])
def test_a_bad_corpora_entry_is_one_clear_line(data, problem):
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"data": data})
    assert caught.value.problems == [problem]


def test_a_config_with_data_path_switches_to_corpora_from_the_command_line(corpora, tmp_path: Path):
    config_file = tmp_path / "single.yaml"
    config_file.write_text(f"data:\n  path: {corpora[0]}\n", encoding="utf-8")
    cfg = load_config(config_file, ["data.path=null", f"data.corpora=[{{path: {corpora[1]}, weight: 2}}]"])
    assert cfg.data.path == "" and [(e.path, e.weight) for e in cfg.data.corpora] == [(str(corpora[1]), 2.0)]
    with pytest.raises(ConfigError) as caught:  # null is no path at all when no corpora replace it
        load_config(config_file, ["data.path=null"])
    assert caught.value.problems[0].startswith("data.path: '' must name a hub dataset or a local directory")


def test_a_corpus_that_cannot_be_read_is_named_by_its_entry(corpora, tmp_path: Path):
    cfg = mixed_config((corpora[0], tmp_path / "nowhere"))
    with pytest.raises(DataError, match=r"^data\.corpora\[1\]\.path: '.*nowhere' is not a directory"):
        load_corpus(cfg.data, cfg.seed, tmp_path / "run")


def test_a_hub_entrys_error_names_the_entrys_own_keys(corpora, tmp_path: Path, monkeypatch):
    """The entry's format, hub_config and revision stand for data.*'s: the message names the entry's keys."""
    from transformer_mt.data import sources as data_sources
    from transformer_mt.data.sources import PARQUET_CONVERSION

    monkeypatch.setattr(data_sources, "_check_hub_reachable", lambda cfg: None)  # refused before any download
    cfg = tiny_config("", data={"path": "", "format": "text", "corpora": [
        {"path": str(corpora[0])}, {"path": "someone/pairs", "format": "hub", "revision": PARQUET_CONVERSION}]})
    with pytest.raises(DataError) as caught:
        load_corpus(cfg.data, cfg.seed, tmp_path / "run")
    assert str(caught.value).startswith(f"data.corpora[1].hub_config: with data.corpora[1].revision: "
                                        f"{PARQUET_CONVERSION}, name the configuration to read")
    assert "data.hub_config" not in str(caught.value) and "data.revision" not in str(caught.value)


def test_a_weight_that_gives_a_corpus_no_pair_is_refused_naming_it(corpora, tmp_path: Path):
    """round(weight x pairs) = 0 would leave the corpus out of every epoch without a word."""
    cfg = mixed_config(corpora, weights=(1.0, 0.05))  # 8 pairs x 0.05 = 0.4: none an epoch
    with pytest.raises(ConfigError) as caught:  # a value of the config: exit 2, as any other
        prepare_data(cfg, tmp_path / "run")
    assert caught.value.problems == [f"data.corpora[1].weight: 0.05 gives the 8 training pairs of {corpora[1]} none "
                                     "per epoch (round(0.05 x 8) = 0); raise it to at least 0.0625"]
    prepare_data(mixed_config(corpora, weights=(1.0, 0.0625)), tmp_path / "run2")  # 8 x 0.0625 = 0.5: one pair


@pytest.mark.parametrize("order, sets, problem", [
    ((0, 2), {"data": {"max_words": 10}}, "no training pair is left after the filters (data.max_words, "
                                          "data.max_length_ratio)"),
    ((0, 2, 1), {"data": {"max_words": 10}}, "no training pair is left after the filters (data.max_words, "
                                             "data.max_length_ratio)"),
    ((0, 2), {"model": {"max_len": 16}}, "no training pair fits in model.max_len=16 tokens"),
])
def test_a_corpus_the_filters_empty_is_named_by_its_entry(corpora, order, sets, problem, tmp_path: Path,
                                                          monkeypatch, capsys):
    """Every pair of the second entry is 20 words long: the word filter or model.max_len leaves it none."""
    long_pairs = [(" ".join(["word"] * 19) + f" {i}.", " ".join(["parola"] * 19) + f" {i}.") for i in range(3)]
    paths = (*corpora, write_corpus(tmp_path / "long", {"train": long_pairs}))
    raw = config_to_dict(mixed_config(corpora))
    raw["data"]["corpora"] = [{"path": str(paths[i])} for i in order]
    for section, values in sets.items():
        raw[section].update(values)
    config_file = tmp_path / "mixed.yaml"
    save_config(config_from_dict(raw), config_file)
    code, out, err = run_cli(["data", "--config", str(config_file)], monkeypatch, capsys, tmp_path)
    assert code != 0 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"tmt: error: data.corpora[1] ({paths[2]}): {problem}"


def test_relative_corpus_paths_stay_the_config_files_when_the_command_line_sets_data_path(corpora, tmp_path: Path,
                                                                                          monkeypatch):
    """`--set data.path=null` (how a config of one corpus switches to its corpora) moves no path."""
    config_file = corpora[0].parent / "mixed.yaml"
    config_file.write_text(f"data:\n  path: {corpora[0]}\n  corpora:\n    - {{path: first}}\n"
                           "    - {path: second, weight: 3}\n", encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(config_file, ["data.path=null"])
    assert [entry.path for entry in cfg.data.corpora] == [str(corpora[0]), str(corpora[1])]
    cfg = load_config(config_file, ["data.path=null", "data.corpora=[{path: first}]"])  # given here: read here
    assert [entry.path for entry in cfg.data.corpora] == [str(elsewhere / "first")]


def test_relative_corpus_paths_are_resolved_against_the_config_file(corpora, tmp_path: Path):
    config_file = corpora[0].parent / "mixed.yaml"
    config_file.write_text("data:\n  corpora:\n    - {path: first}\n    - {path: second, weight: 3}\n",
                           encoding="utf-8")
    cfg = load_config(config_file)
    assert [entry.path for entry in cfg.data.corpora] == [str(corpora[0]), str(corpora[1])]
    assert [entry.weight for entry in cfg.data.corpora] == [1.0, 3.0]


def test_an_entry_carries_its_own_source_keys_a_hub_dataset_beside_local_files(corpora, tmp_path: Path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    hub = tmp_path / "hub_dataset"  # a local folder in the hub layout: train.jsonl, a `translation` column
    hub.mkdir()
    (hub / "train.jsonl").write_text("".join(json.dumps({"translation": {"en": f"Line {i}.", "it": f"Riga {i}."}}) + "\n"
                                             for i in range(5)), encoding="utf-8")
    cfg = tiny_config("", data={"path": "", "format": "text", "corpora": [
        {"path": str(corpora[0])}, {"path": str(hub), "format": "hub", "weight": 0.4}]})
    corpus = load_corpus(cfg.data, cfg.seed, tmp_path / "run")
    assert list(zip(corpus.train["src"], corpus.train["tgt"]))[12:] == [(f"Line {i}.", f"Riga {i}.") for i in range(5)]
    assert corpus.train_parts == ((str(corpora[0]), 12), (str(hub), 5))


def test_summary_provenance_names_every_corpus_and_its_weight(corpora, tmp_path: Path):
    import torch

    from transformer_mt.runs.summary import provenance

    data = provenance(mixed_config(corpora), tmp_path, torch.device("cpu"), None)["data"]
    assert [(entry["path"], entry["weight"]) for entry in data["corpora"]] == [(str(corpora[0]), 1.0),
                                                                              (str(corpora[1]), 2.0)]
