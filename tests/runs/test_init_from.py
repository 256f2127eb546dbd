"""train.init_from: a new run that starts from another run's weights and tokenizers."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import run_cli, tiny_config, write_corpus
from transformer_mt.config.loading import load_config, save_config
from transformer_mt.core.errors import ConfigError, UsageError
from transformer_mt.data.tokenization import TokenizerPair
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.init_from import load_parent
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.schedule import lr_at
from transformer_mt.train.trainer import Trainer, train

# Another domain: sentences the parent never saw, whose own BPE would be another vocabulary.
CHILD_PAIRS = [
    ("The train leaves at nine.", "Il treno parte alle nove."),
    ("My sister plays the piano.", "Mia sorella suona il pianoforte."),
    ("Open the window, please.", "Apri la finestra, per favore."),
    ("The children sleep.", "I bambini dormono."),
    ("We visit the museum tomorrow.", "Visitiamo il museo domani."),
    ("The dog runs in the garden.", "Il cane corre nel giardino."),
]


@pytest.fixture
def parent(tiny_corpus: Path, tmp_path: Path) -> Path:
    """A trained run (3 steps) with an EMA of its weights."""
    run = tmp_path / "parent"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 3, "ema_decay": 0.9, "test_at_end": False}), run,
          progress=False)
    return run


def child_config(tmp_path: Path, init_from: Path, **sections):
    corpus = write_corpus(tmp_path / "child_corpus", {"train": CHILD_PAIRS, "valid": CHILD_PAIRS[:2],
                                                      "test": CHILD_PAIRS[2:4]})
    train_settings = {"max_steps": 6, "lr": 5e-4, "init_from": str(init_from), **sections.pop("train", {})}
    return tiny_config(corpus, train=train_settings, **sections)


def test_a_child_starts_from_the_parents_weights_with_a_fresh_optimizer(parent: Path, tmp_path: Path):
    cfg = child_config(tmp_path, parent)
    child = tmp_path / "child"
    prepare_run_dir(child, resume=False, overwrite=False)
    trainer = Trainer(cfg, child, progress=False, parent=load_parent(cfg))
    best = load_checkpoint(parent / "checkpoints" / "best.pt")
    for name, tensor in trainer.model.state_dict().items():  # the parent's EMA weights, what it translates with
        assert torch.equal(tensor, best["ema"]["model"][name]), name
    assert TokenizerPair.load(child).fingerprint() == TokenizerPair.load(parent).fingerprint()
    assert trainer.state.step == 0 and not trainer.train_step.optimizer.state
    assert trainer.train_step.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(1, cfg.train))  # warmup's first
    assert trainer.sampler.state_dict()["epoch"] == 0


def test_a_child_run_trains_on_its_data_records_its_parent_and_resumes_exactly(parent: Path, tmp_path: Path):
    cfg = child_config(tmp_path, parent)
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    state = train(cfg, straight, progress=False)
    assert state.step == 6
    assert TokenizerPair.load(straight).fingerprint() == TokenizerPair.load(parent).fingerprint()
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["init_from"] == {"run_dir": str(parent.resolve()),
                                    "checkpoint": str((parent / "checkpoints" / "best.pt").resolve()),
                                    "step": 3, "weights": "ema"}

    short = child_config(tmp_path, parent, train={"max_steps": 3})
    prepare_run_dir(interrupted, resume=False, overwrite=False)
    train(short, interrupted, progress=False)
    shutil.rmtree(parent)  # a resume reads the child's own checkpoint: train.init_from is ignored
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    train(cfg, interrupted, resume=True, progress=False)
    a = load_checkpoint(straight / "checkpoints" / "step_00000006.pt")
    b = load_checkpoint(interrupted / "checkpoints" / "step_00000006.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert json.loads((interrupted / "summary.json").read_text())["init_from"] == summary["init_from"]


def test_model_and_tokenizer_settings_that_differ_from_the_parents_are_listed(parent: Path, tmp_path: Path):
    cfg = child_config(tmp_path, parent, model={"d_ff": 64}, tokenizer={"vocab_size": 150})
    with pytest.raises(ConfigError) as err:
        load_parent(cfg)
    assert err.value.problems[1:] == ["model.d_ff: 32 in the parent, 64 here",
                                      "tokenizer.vocab_size: 200 in the parent, 150 here"]
    assert err.value.problems[0].startswith("train.init_from: the model and tokenizer settings must be those of")


def test_tmt_train_refuses_a_parent_of_other_settings_before_making_the_run_directory(parent: Path, tmp_path: Path,
                                                                                      monkeypatch, capsys):
    config = tmp_path / "child.yaml"
    save_config(child_config(tmp_path, parent, model={"d_ff": 64}), config)
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(tmp_path / "run")], monkeypatch,
                           capsys, tmp_path)
    assert code == 2 and not (tmp_path / "run").exists()
    assert "train.init_from: the model and tokenizer settings must be those of the parent" in err
    assert "model.d_ff: 32 in the parent, 64 here" in err and "Traceback" not in err


def test_a_child_may_fine_tune_with_other_dropout_rates(parent: Path, tmp_path: Path):
    """Dropout changes how the weights are trained, not what they mean: fine-tuning often lowers it."""
    cfg = child_config(tmp_path, parent, model={"dropout": 0.3, "attention_dropout": 0.2, "activation_dropout": 0.2})
    assert load_parent(cfg).record["weights"] == "ema"


def test_a_child_of_another_language_pair_is_warned_that_it_keeps_the_parents_tokenizers(parent: Path,
                                                                                       tmp_path: Path, caplog):
    """A reversed direction (or a new language) may start from a parent; its tokenizers come along."""
    with caplog.at_level("WARNING", logger="transformer_mt.runs.init_from"):
        load_parent(child_config(tmp_path, parent))
        assert not caplog.records  # the parent's pair: nothing to say
        load_parent(child_config(tmp_path, parent, data={"src_lang": "it", "tgt_lang": "en"}))
    assert [r.getMessage() for r in caplog.records] == [
        "train.init_from: the parent translates en->it and this run it->en; it keeps the parent's tokenizers, "
        "trained on both of the parent's languages (tokenizer.joint)"]


def test_settings_only_training_reads_may_differ_and_depths_compare_as_the_layers_they_give(parent: Path,
                                                                                           tmp_path: Path):
    """Which cached BPE-dropout segmentation an epoch trains on, and how long a training pair may
    be, change nothing the weights mean; n_layers 2 is the model of encoder_layers 2 + decoder_layers 2."""
    cfg = child_config(tmp_path, parent, tokenizer={"bpe_dropout": 0.1, "bpe_dropout_variants": 2,
                                                    "bpe_dropout_start_epoch": 3},
                       model={"max_len": 48, "n_layers": 6, "encoder_layers": 2, "decoder_layers": 2})
    assert load_parent(cfg).record["step"] == 3
    with pytest.raises(ConfigError) as err:
        load_parent(child_config(tmp_path, parent, model={"n_layers": 2, "encoder_layers": 3}))
    assert err.value.problems[1:] == ["model.encoder_layers: 2 in the parent, 3 here"]


def test_overwrite_keeps_the_old_run_when_the_parent_cannot_be_started_from(parent: Path, tmp_path: Path,
                                                                             monkeypatch, capsys):
    """Every check of the parent comes before the run directory is emptied, not only its settings'."""
    old = tmp_path / "old"
    shutil.copytree(parent, old)
    broken = tmp_path / "broken"
    shutil.copytree(parent, broken)
    for tokenizer in broken.glob("tokenizer*.json"):
        tokenizer.unlink()
    config = tmp_path / "child.yaml"
    save_config(child_config(tmp_path, broken), config)
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(old), "--overwrite"], monkeypatch,
                           capsys, tmp_path)
    assert code == 1 and err == f"tmt: error: train.init_from: {broken.resolve()} has no tokenizer files, which its " \
                                "weights need\n"
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == sorted(
        p.name for p in (parent / "checkpoints").iterdir())


def test_tmt_data_refuses_what_tmt_train_would_and_names_the_parents_tokenizers(parent: Path, tmp_path: Path,
                                                                                monkeypatch, capsys):
    config = tmp_path / "child.yaml"
    save_config(child_config(tmp_path, parent), config)
    code, out, err = run_cli(["data", "--config", str(config), "--quiet", "--set", "tokenizer.vocab_size=150"],
                             monkeypatch, capsys, tmp_path)
    assert code == 2 and "tokenizer.vocab_size: 200 in the parent, 150 here" in err and not out
    code, out, err = run_cli(["data", "--config", str(config), "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0 and "per epoch" in out
    assert err.endswith(f"with the tokenizers of {parent.resolve()} (train.init_from)\n")


def test_a_checkpoint_file_names_its_run_and_a_bad_path_is_one_clear_line(parent: Path, tmp_path: Path,
                                                                          monkeypatch, capsys):
    step = parent / "checkpoints" / "step_00000003.pt"
    loaded = load_parent(child_config(tmp_path, step))
    assert (loaded.run_dir, loaded.checkpoint, loaded.record["step"]) == (parent.resolve(), step.resolve(), 3)
    shutil.copyfile(step, tmp_path / "loose.pt")
    with pytest.raises(UsageError, match="is not in a run's checkpoints/ folder"):
        load_parent(child_config(tmp_path, tmp_path / "loose.pt"))
    with pytest.raises(UsageError, match="holds no checkpoints/ to start from"):
        load_parent(child_config(tmp_path, tmp_path / "child_corpus"))

    config = tmp_path / "child.yaml"
    save_config(child_config(tmp_path, parent), config)
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"),
                            "--set", "train.init_from=nowhere"], monkeypatch, capsys, tmp_path)
    assert code == 2 and not (tmp_path / "run").exists()  # refused before the run directory is made
    assert err == f"tmt: error: train.init_from: {tmp_path.resolve() / 'nowhere'}: no such run directory or checkpoint\n"


def test_overwrite_never_deletes_the_run_a_new_run_starts_from(parent: Path):
    with pytest.raises(UsageError, match="is the run train.init_from starts from"):
        prepare_run_dir(parent, resume=False, overwrite=True, init_from=str(parent / "checkpoints" / "best.pt"))
    assert (parent / "checkpoints" / "best.pt").is_file()


def test_a_relative_init_from_is_read_from_the_config_files_folder_or_from_the_command_lines(tmp_path: Path,
                                                                                             monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    config = tmp_path / "configs" / "finetune.yaml"
    config.write_text("data: {path: corpus}\ntrain: {init_from: ../runs/base}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load_config(config).train.init_from == str(tmp_path.resolve() / "runs" / "base")
    overridden = load_config(config, ["train.init_from=runs/base"])
    assert overridden.train.init_from == str(tmp_path.resolve() / "elsewhere" / "runs" / "base")
    assert load_config(config, ["train.init_from="]).train.init_from is None  # off again


def write_fine_tuning_config(tmp_path: Path, parent: Path, *, model: dict | None = None, tokenizer: dict | None = None,
                             train: dict | None = None) -> Path:
    """A fine-tuning config as a user writes one: data and train (plus any sections given), nothing of the model."""
    corpus = write_corpus(tmp_path / "child_corpus", {"train": CHILD_PAIRS, "valid": CHILD_PAIRS[:2],
                                                      "test": CHILD_PAIRS[2:4]})
    # batch_tokens 64 is below the default model.max_len (256): valid only with the parent's max_len (64).
    raw = {"data": {"path": str(corpus), "valid_size": 2, "test_size": 2},
           "train": {"init_from": str(parent), "max_steps": 4, "batch_tokens": 64, "lr": 5e-4, "warmup_steps": 2,
                     "eval_every_steps": 2, "save_every_steps": 2, "precision": "fp32", "device": "cpu",
                     "test_at_end": False, **(train or {})}}
    raw.update({key: value for key, value in (("model", model), ("tokenizer", tokenizer)) if value is not None})
    config = tmp_path / "finetune.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return config


def test_a_config_of_data_and_train_only_fine_tunes_with_the_parents_model_and_tokenizers(parent: Path,
                                                                                         tmp_path: Path,
                                                                                         monkeypatch, capsys):
    """model.* and tokenizer.* default to the parent's; the run's config.yaml holds them, so a resume
    needs neither the parent's folder nor those sections; no BPE is trained."""
    config = write_fine_tuning_config(tmp_path, parent, train={"freeze": ["embeddings"]})
    child = tmp_path / "child"
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(child), "--quiet"], monkeypatch,
                           capsys, tmp_path)
    assert code == 0, err
    saved = yaml.safe_load((child / "config.yaml").read_text(encoding="utf-8"))
    parents = yaml.safe_load((parent / "config.yaml").read_text(encoding="utf-8"))
    assert saved["model"] == parents["model"] and saved["tokenizer"] == parents["tokenizer"]
    assert (child / "tokenizer.json").read_bytes() == (parent / "tokenizer.json").read_bytes()
    train_log = (child / "train.log").read_text(encoding="utf-8")
    assert "trained BPE" not in train_log and "copied the tokenizers of" in train_log
    # The frozen embeddings are the parent's EMA weights, bit for bit; the rest has trained.
    parent_weights = load_checkpoint(parent / "checkpoints" / "best.pt")["ema"]["model"]
    child_weights = load_checkpoint(child / "checkpoints" / "step_00000004.pt")["model"]
    assert torch.equal(child_weights["src_embed.weight"], parent_weights["src_embed.weight"])
    assert not torch.equal(child_weights["encoder_layers.0.ffn.linear1.weight"],
                           parent_weights["encoder_layers.0.ffn.linear1.weight"])

    shutil.rmtree(parent)
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(child), "--resume", "--quiet",
                            "--set", "train.max_steps=6"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert load_checkpoint(child / "checkpoints" / "step_00000006.pt")["train_state"]["step"] == 6


def test_a_model_key_given_is_checked_against_the_parents_and_tmt_data_reports_as_training_would(
        parent: Path, tmp_path: Path, monkeypatch, capsys):
    config = write_fine_tuning_config(tmp_path, parent, model={"d_model": 16, "dropout": 0.2})
    code, out, err = run_cli(["data", "--config", str(config), "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0 and "per epoch" in out, err
    assert err.endswith(f"with the tokenizers of {parent.resolve()} (train.init_from)\n")

    config = write_fine_tuning_config(tmp_path, parent, model={"d_model": 16, "d_ff": 64},
                                      tokenizer={"vocab_size": 200})
    for command in ("data", "train"):
        run_dir = ["--run-dir", str(tmp_path / "run")] if command == "train" else []
        code, out, err = run_cli([command, "--config", str(config), *run_dir, "--quiet"], monkeypatch, capsys,
                                 tmp_path)
        assert code == 2 and not (tmp_path / "run").exists() and not out, command
        assert "model.d_ff: 32 in the parent, 64 here" in err and "d_model" not in err and "vocab_size" not in err
        assert "Traceback" not in err


def as_unigram(run_dir: Path) -> None:
    """Replace a run's BPE tokenizer by a Unigram one with the same vocabulary (an imported run's kind):
    the same ids, so the same fingerprint as its checkpoints'."""
    settings = json.loads((run_dir / "tokenizer.json").read_text(encoding="utf-8"))
    pieces = sorted(settings["model"]["vocab"].items(), key=lambda item: item[1])
    settings["model"] = {"type": "Unigram", "unk_id": 1, "vocab": [[piece, -1.0] for piece, _ in pieces],
                         "byte_fallback": False}
    settings["decoder"] = None
    (run_dir / "tokenizer.json").write_text(json.dumps(settings), encoding="utf-8")


def test_bpe_dropout_is_refused_in_one_line_when_the_parents_tokenizers_are_not_bpe(parent: Path, tmp_path: Path,
                                                                                    monkeypatch, capsys):
    as_unigram(parent)
    config = write_fine_tuning_config(tmp_path, parent, tokenizer={"bpe_dropout": 0.1})
    for command in ("data", "train"):
        run_dir = ["--run-dir", str(tmp_path / "run")] if command == "train" else []
        code, out, err = run_cli([command, "--config", str(config), *run_dir, "--quiet"], monkeypatch, capsys,
                                 tmp_path)
        assert code == 2 and not out and not (tmp_path / "run").exists(), err
        assert err == (f"tmt: error: invalid configuration: tokenizer.bpe_dropout: 0.1 does nothing with the "
                       f"Unigram tokenizers of {parent.resolve()} (train.init_from); BPE-dropout needs BPE "
                       "tokenizers: set it to 0\n")
    config = write_fine_tuning_config(tmp_path, parent, train={"max_steps": 2})
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--quiet"],
                           monkeypatch, capsys, tmp_path)
    assert code == 0, err  # without BPE-dropout, a Unigram parent fine-tunes
    assert TokenizerPair.load(tmp_path / "run").fingerprint() == TokenizerPair.load(parent).fingerprint()
