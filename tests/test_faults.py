"""Never lose a run: bad inputs get clear errors, faults are survived, kills are resumed exactly.

The bad-input table runs the real `tmt` entry point in-process (`cli.main`), which is what the
console script calls; cli/test_cli.py covers the same path in subprocesses.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
import sacrebleu
import torch

from tests.helpers import (DEMO_CONFIG, PYTHONPATH, TINY_PAIRS, forked, read_scalars, run_cli, tiny_config,
                           train_tiny_run, write_corpus)
from transformer_mt.config.loading import load_config, save_config
from transformer_mt.core.errors import CheckpointError, DataError, Terminated, TrainingError, TrainingStopped
from transformer_mt.core.files import write_text_atomic
from transformer_mt.core.run_layout import RunDir
from transformer_mt.data.tokenization import TokenizerPair
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train import step as train_step_module
from transformer_mt.train import trainer as training
from transformer_mt.train.trainer import Trainer, train

# Small enough to be quick, long enough for three checkpoints and several epochs of 12 pairs.
KILL_RUN = {"max_steps": 9, "eval_every_steps": 3, "save_every_steps": 3, "keep_last": 5}


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` with its bytes: what 'nothing was overwritten' compares. The lock
    file is left out: it names the last process that wrote (or tried to write) the run."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != RunDir.LOCK}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A trained tiny run (config file beside it), shared by the read-only rows below."""
    root = tmp_path_factory.mktemp("faults")
    return train_tiny_run(root, root / "runs" / "tiny", max_steps=3, eval_every_steps=3, save_every_steps=3)


def copy_run(run_dir: Path, target: Path) -> Path:
    subprocess.run(["cp", "-r", str(run_dir), str(target)], check=True)
    return target


# --- bad inputs -----------------------------------------------------------------------

def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def corpus_config(tmp_path: Path, corpus: Path, extra: str = "") -> Path:
    return config_file(tmp_path, f"name: bad\ndata: {{format: text, path: {corpus}, valid_size: 2, test_size: 2}}\n"
                                 f"tokenizer: {{vocab_size: 200}}\n"
                                 "model: {d_model: 16, n_heads: 2, n_layers: 1, d_ff: 32, max_len: 64}\n"
                                 "train: {max_steps: 2, batch_tokens: 64, device: cpu}\n" + extra)


CONFIG_ROWS = {
    "missing config file": (None, "config.yaml", 2),
    "YAML syntax error": ("name: x\ntrain: {max_steps: 3\n", "config.yaml:3: YAML syntax error", 2),
    "unknown key": ("name: x\ndata: {path: .}\nmodel: {d_modle: 64}\n", "model.d_modle: unknown key (did you mean 'd_model'?)", 2),
    "wrong type": ("name: x\ndata: {path: .}\ntrain: {max_steps: many}\n", "train.max_steps: expected an integer", 2),
    "impossible value": ("name: x\ndata: {path: .}\nmodel: {d_model: 30, n_heads: 4}\n", "model.n_heads: 4 does not divide", 2),
    "vocabulary too small": ("name: x\ndata: {path: .}\ntokenizer: {vocab_size: 4}\n", "tokenizer.vocab_size: 4 leaves no room", 2),
}


@pytest.mark.parametrize("row", CONFIG_ROWS)
def test_bad_config_is_named_with_exit_2(row, tmp_path: Path, monkeypatch, capsys):
    text, expected, code = CONFIG_ROWS[row]
    path = tmp_path / "config.yaml" if text is None else config_file(tmp_path, text)
    result = run_cli(["train", "--config", str(path)], monkeypatch, capsys, tmp_path)
    assert result[0] == code, result
    assert expected in result[2] and "Traceback" not in result[2], result[2]
    assert len(result[2].splitlines()) == 1, result[2]  # one problem (each row has one), one line
    assert not (tmp_path / "runs").exists()  # nothing was created


def write_lines(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


DATA_ROWS = ["missing data file", "different line counts", "invalid UTF-8", "no pairs left after filtering"]


@pytest.mark.parametrize("row", DATA_ROWS)
def test_bad_data_is_named_with_exit_1(row, tmp_path: Path, monkeypatch, capsys):
    corpus = write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[:2]})
    extra = ""
    if row == "missing data file":
        (corpus / "train.it").unlink()
        expected = "train.it"
    elif row == "different line counts":
        write_lines(corpus / "train.it", [t.encode() for _, t in TINY_PAIRS[:-1]])
        expected = "has 12 lines but"
    elif row == "invalid UTF-8":
        write_lines(corpus / "train.en", [s.encode() for s, _ in TINY_PAIRS[:4]] + [b"caf\xe9 au lait"]
                    + [s.encode() for s, _ in TINY_PAIRS[5:]])
        expected = "train.en:5: not valid UTF-8"
    else:
        extra = "data: {format: text, path: %s, valid_size: 2, test_size: 2, max_words: 1}\n" % corpus
        expected = "data.max_words"
    config = corpus_config(tmp_path, corpus)
    if extra:  # replace the data section
        config.write_text(config.read_text().split("\n", 2)[0] + "\n" + extra + config.read_text().split("\n", 2)[2])
    code, _, err = run_cli(["train", "--config", str(config)], monkeypatch, capsys, tmp_path)
    assert code == 1, err
    assert expected in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()  # a start that never trained leaves no run behind


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_bad_data_leaves_a_run_that_existed_before(flag, tiny_run: Path, tmp_path: Path, monkeypatch, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    kept = (lambda name: name != "train.log") if flag == "--resume" else (lambda name: name == RunDir.MARKER)
    before = {k: v for k, v in snapshot(run).items() if kept(k)}

    def unreadable(*args, **kwargs):
        raise DataError("train.it: gone")

    monkeypatch.setattr(training, "prepare_data", unreadable)
    code, _, err = run_cli(["train", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--run-dir", str(run),
                            flag], monkeypatch, capsys, tmp_path)
    assert code == 1 and err.splitlines()[-1] == "tmt: error: train.it: gone", err
    # Resumed: the run as it was; started over (--overwrite asked to delete it): the folder stays, marked.
    assert {k: v for k, v in snapshot(run).items() if k in before} == before
    assert (run / "train.log").is_file()


def test_training_into_a_used_run_directory_refuses_and_keeps_everything(tiny_run: Path, tmp_path: Path,
                                                                        monkeypatch, capsys):
    before = snapshot(tiny_run)
    code, _, err = run_cli(["train", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--run-dir",
                            str(tiny_run)], monkeypatch, capsys, tmp_path)
    assert code == 2 and "--resume" in err and "Traceback" not in err
    assert snapshot(tiny_run) == before

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    code, _, err = run_cli(["train", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--run-dir",
                            str(foreign), "--overwrite"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "notes.txt" in err
    assert (foreign / "notes.txt").read_text() == "precious"


def test_a_bleu_tokenizer_sacrebleu_cannot_build_is_refused_before_training(tiny_run: Path, tmp_path: Path,
                                                                          monkeypatch, capsys):
    try:
        sacrebleu.metrics.BLEU(tokenize="ja-mecab")
        pytest.skip("MeCab is installed here, so sacreBLEU can build ja-mecab")
    except (ImportError, RuntimeError):
        pass
    run_dir = tmp_path / "ja"
    code, _, err = run_cli(["train", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--run-dir", str(run_dir),
                            "--set", "train.bleu_tokenize=ja-mecab"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "train.bleu_tokenize: sacreBLEU cannot use the 'ja-mecab' tokenizer" in err, err
    assert "Traceback" not in err and not (run_dir / "checkpoints").exists()
    written = {p: p.stat().st_mtime_ns for p in tiny_run.rglob("*")}
    code, _, err = run_cli(["evaluate", "--run", str(tiny_run), "--tokenize", "ja-mecab", "--quiet"],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and "--tokenize: sacreBLEU cannot use the 'ja-mecab' tokenizer" in err, err
    assert "invalid configuration" not in err and len(err.strip().splitlines()) == 1  # a flag, said on one line
    assert {p: p.stat().st_mtime_ns for p in tiny_run.rglob("*")} == written  # refused before translating


def test_resume_without_a_checkpoint_names_the_run_directory(tiny_run: Path, tmp_path: Path, monkeypatch, capsys):
    code, _, err = run_cli(["train", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--resume",
                            "--run-dir", str(tmp_path / "empty")], monkeypatch, capsys, tmp_path)
    assert code == 1 and "no checkpoint to resume from" in err and str(tmp_path / "empty") in err


def test_translate_with_no_run_found(tmp_path: Path, monkeypatch, capsys):
    code, _, err = run_cli(["translate", "hello"], monkeypatch, capsys, tmp_path)
    assert code == 1 and "no trained run found" in err and "Traceback" not in err


def test_checkpoint_from_another_format_version_is_refused(tiny_run: Path, tmp_path: Path, monkeypatch, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    path = run / "checkpoints" / "best.pt"
    state = torch.load(path, weights_only=True)
    state["format_version"] = 99
    torch.save(state, path)
    code, _, err = run_cli(["translate", "--run", str(run), "hello"], monkeypatch, capsys, tmp_path)
    assert code == 1 and "format version 99" in err and "best.pt" in err


def test_missing_tokenizer_files_are_named_for_translate_and_resume(tiny_run: Path, tmp_path: Path,
                                                                   monkeypatch, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    (run / "tokenizer.json").unlink()
    code, _, err = run_cli(["translate", "--run", str(run), "hello"], monkeypatch, capsys, tmp_path)
    assert code == 1 and "no tokenizer files" in err
    before = snapshot(run)
    code, _, err = run_cli(["train", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--run-dir", str(run),
                            "--resume", "--set", "train.max_steps=6"], monkeypatch, capsys, tmp_path)
    assert code == 1 and "tokenizer files are missing" in err
    assert {k: v for k, v in snapshot(run).items() if k != "train.log"} == \
        {k: v for k, v in before.items() if k != "train.log"}  # no new vocabulary was trained


@pytest.mark.parametrize("stdin, code, expected", [
    (b"", 2, "nothing to translate"),
    (b"Good morning.\n\xff\xfe bad bytes\n", 1, "stdin line 2: not valid UTF-8"),
    (b"Good morning.\rThank you.\r", 1, "stdin: its lines end in a carriage return"),
])
def test_bad_stdin_for_translate(stdin, code, expected, tiny_run: Path, tmp_path: Path, monkeypatch, capsys):
    result = run_cli(["translate", "--run", str(tiny_run)], monkeypatch, capsys, tmp_path, stdin=stdin)
    assert result[0] == code and expected in result[2] and "Traceback" not in result[2], result


def test_a_sentence_argument_that_is_not_utf8_is_named(tiny_run: Path, tmp_path: Path, monkeypatch, capsys):
    latin1 = os.fsdecode(b"caf\xe9")  # what Python makes of `tmt translate "café"` typed in a Latin-1 terminal
    code, out, err = run_cli(["translate", "--run", str(tiny_run), "Good morning.", latin1], monkeypatch, capsys,
                             tmp_path)
    assert code == 1 and out == "" and "Traceback" not in err
    assert "sentence argument 2: not valid UTF-8 (after 'caf')" in err


def test_a_dash_for_input_and_output_means_stdin_and_stdout(tiny_run: Path, tmp_path: Path, monkeypatch, capsys):
    text = b"Good morning.\nThe bread.\n"
    code, plain, err = run_cli(["translate", "--run", str(tiny_run)], monkeypatch, capsys, tmp_path, stdin=text)
    assert code == 0, err
    code, dashes, err = run_cli(["translate", "--run", str(tiny_run), "--input", "-", "--output", "-"],
                                monkeypatch, capsys, tmp_path, stdin=text)
    assert code == 0, err
    assert dashes == plain and plain.count("\n") == 2 and not (tmp_path / "-").exists()
    code, out, err = run_cli(["translate", "--run", str(tiny_run), "--output", "./-"], monkeypatch, capsys, tmp_path,
                             stdin=text)
    assert code == 0 and out == "" and (tmp_path / "-").read_text("utf-8") == plain, err  # ./- is a file
    code, out, err = run_cli(["evaluate", "--run", str(tiny_run), "--output", "-"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "--output -: evaluate prints its scores on stdout" in err, err


def test_stdin_with_a_byte_order_mark_translates_like_the_same_file(tiny_run: Path, tmp_path: Path,
                                                                     monkeypatch, capsys):
    text = "\ufeffGood morning.\nThe bread.\n".encode("utf-8")  # as Windows Notepad saves it
    (tmp_path / "in.en").write_bytes(text)
    code, from_file, err = run_cli(["translate", "--run", str(tiny_run), "--input", str(tmp_path / "in.en")],
                                   monkeypatch, capsys, tmp_path)
    assert code == 0, err
    code, from_stdin, err = run_cli(["translate", "--run", str(tiny_run)], monkeypatch, capsys, tmp_path, stdin=text)
    assert code == 0, err
    code, plain, err = run_cli(["translate", "--run", str(tiny_run)], monkeypatch, capsys, tmp_path,
                               stdin=text.removeprefix("\ufeff".encode("utf-8")))
    assert code == 0, err
    assert from_stdin == from_file == plain


def test_one_stdin_line_ending_in_a_carriage_return_is_still_one_sentence(tiny_run: Path, tmp_path: Path,
                                                                          monkeypatch, capsys):
    outputs = []
    for stdin in (b"Good morning.\n", b"Good morning.\r\n", b"Good morning.\r"):
        code, out, err = run_cli(["translate", "--run", str(tiny_run)], monkeypatch, capsys, tmp_path, stdin=stdin)
        assert code == 0, err
        outputs.append(out)
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].count("\n") == 1


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_an_output_that_is_a_directory_is_refused_before_translating(command, tiny_run: Path, tmp_path: Path,
                                                                     monkeypatch, capsys):
    (tmp_path / "out").mkdir()
    args = ["--input", str(tmp_path / "in.en")] if command == "translate" else ["--quiet"]
    (tmp_path / "in.en").write_text("Good morning.\n", encoding="utf-8")
    code, _, err = run_cli([command, "--run", str(tiny_run), *args, "--output", str(tmp_path / "out")],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and f"--output {tmp_path / 'out'} is a directory" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en", "out"]  # no temporary file left behind


@pytest.mark.parametrize("command, inputs, output", [
    ("translate", ["--input", "in.en"], "in.en"),
    ("evaluate", ["--src", "in.en", "--ref", "ref.it", "--quiet"], "in.en"),
    ("evaluate", ["--src", "in.en", "--ref", "ref.it", "--quiet"], "ref.it"),
])
def test_an_output_that_is_an_input_file_is_refused(command, inputs, output, tiny_run: Path, tmp_path: Path,
                                                    monkeypatch, capsys):
    (tmp_path / "in.en").write_text("Good morning.\n", encoding="utf-8")
    (tmp_path / "ref.it").write_text("Buongiorno.\n", encoding="utf-8")
    before = snapshot(tmp_path)
    code, _, err = run_cli([command, "--run", str(tiny_run), *inputs, "--output", output], monkeypatch, capsys,
                           tmp_path)
    assert code == 2 and "would destroy the input" in err and "Traceback" not in err, err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command, output", [
    ("translate", "checkpoints/best.pt"),
    ("translate", "tokenizer.json"),
    ("translate", "."),  # the folder itself: refused as a directory
    ("evaluate", "config.yaml"),
    ("evaluate", "evaluation/test_scores.json"),
    ("evaluate", "validation/new.txt"),
])
def test_an_output_that_is_a_file_the_run_keeps_is_refused(command, output, tiny_run: Path, tmp_path: Path,
                                                            monkeypatch, capsys):
    """Written over, a checkpoint, the tokenizers or the config would leave the run unusable."""
    (tmp_path / "in.en").write_text("Good morning.\n", encoding="utf-8")
    (tmp_path / "ref.it").write_text("Buongiorno.\n", encoding="utf-8")
    inputs = ["--input", "in.en"] if command == "translate" else ["--src", "in.en", "--ref", "ref.it", "--quiet"]
    before = snapshot(tiny_run)
    code, _, err = run_cli([command, "--run", str(tiny_run), *inputs, "--output", str(tiny_run / output)],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and "Traceback" not in err, err
    assert ("is a directory" if output == "." else "is part of the run") in err
    assert snapshot(tiny_run) == before
    # Beside the run's files, and evaluate's own outputs in evaluation/, an output is written as asked.
    for elsewhere in ("hypotheses.txt", "evaluation/mine.txt"):
        code, _, err = run_cli([command, "--run", str(tiny_run), *inputs, "--output", str(tiny_run / elsewhere)],
                               monkeypatch, capsys, tmp_path)
        assert code == 0 and (tiny_run / elsewhere).is_file(), err


@pytest.mark.parametrize("size", ["4096000000", "1e100"])
def test_a_model_too_big_for_the_machine_is_one_config_error_before_the_run_exists(size, tmp_path: Path,
                                                                                    monkeypatch, capsys):
    code, _, err = run_cli(["train", "--config", str(DEMO_CONFIG), "--set", f"model.d_model={size}"], monkeypatch,
                           capsys, tmp_path)
    assert code == 2 and "Traceback" not in err and "internal error" not in err, err
    assert err.strip().splitlines()[-1].startswith("tmt: error: invalid configuration: model.d_model: a model of "
                                                   f"model.d_model={float(size):.6g}, ")
    assert "GiB in fp32, more than this machine's" in err
    assert not (tmp_path / "runs").exists()


def test_a_model_that_fits_passes_the_memory_check():
    from transformer_mt.config.schema import ModelConfig
    from transformer_mt.core.errors import ConfigError
    from transformer_mt.train.batches import check_model_fits, parameter_count

    model = ModelConfig(d_model=64, d_ff=128, n_heads=2, n_layers=2)
    need = 4 * parameter_count(model, 1000)
    check_model_fits(model, 1000, need)
    with pytest.raises(ConfigError):
        check_model_fits(model, 1000, need - 1)


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_a_beam_wider_than_the_target_vocabulary_is_refused(command, tiny_run: Path, tmp_path: Path, monkeypatch,
                                                            capsys):
    """A beam wider than the vocabulary allows is one clear line, not a failure deep in an engine."""
    vocabulary = TokenizerPair.load(tiny_run).tgt.get_vocab_size()
    (tmp_path / "in.en").write_text("Good morning.\n", encoding="utf-8")
    inputs = ["Good morning."] if command == "translate" else ["--src", "in.en", "--ref", "in.en", "--quiet"]
    code, out, err = run_cli([command, "--run", str(tiny_run), "--beam", str(vocabulary - 2), *inputs], monkeypatch,
                             capsys, tmp_path)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert f"--beam {vocabulary - 2}: beam search keeps at most {vocabulary - 3} hypotheses" in err
    code, out, err = run_cli([command, "--run", str(tiny_run), "--beam", str(vocabulary - 3), *inputs], monkeypatch,
                             capsys, tmp_path)
    assert code == 0 and "Warning" not in err, err


def test_scoring_a_file_named_test_keeps_the_final_tests_hypotheses(tiny_run: Path, tmp_path: Path,
                                                                    monkeypatch, capsys):
    evaluation = tiny_run / "evaluation"
    reported = evaluation / json.loads((evaluation / "test_scores.json").read_text())["hypotheses"]
    kept = reported.read_bytes()
    (tmp_path / "test").write_text("Good morning.\n", encoding="utf-8")
    (tmp_path / "test.ref").write_text("Buongiorno.\n", encoding="utf-8")
    code, _, err = run_cli(["evaluate", "--run", str(tiny_run), "--src", "test", "--ref", "test.ref",
                            "--beam", str(json.loads((evaluation / "test_scores.json").read_text())["beam_size"]),
                            "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert reported.read_bytes() == kept
    (scored,) = evaluation.glob(f"file-test-*.{reported.name[len('test.'):]}")
    # Another folder's file of the same name gets a file of its own, as the same file again replaces its own.
    (tmp_path / "other").mkdir()
    for folder in ("other", "."):
        (tmp_path / folder / "test").write_text("Good morning.\n", encoding="utf-8")
        code, _, err = run_cli(["evaluate", "--run", str(tiny_run), "--src", f"{folder}/test", "--ref", "test.ref",
                                "--quiet"], monkeypatch, capsys, tmp_path)
        assert code == 0, err
    assert len({path.name.split(".")[0] for path in evaluation.glob("file-test-*")}) == 2 and scored.is_file()


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_evaluating_a_file_with_no_sentence_is_refused(text, tiny_run: Path, tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "in.en").write_text(text, encoding="utf-8")
    (tmp_path / "ref.it").write_text(text, encoding="utf-8")
    code, out, err = run_cli(["evaluate", "--run", str(tiny_run), "--src", "in.en", "--ref", "ref.it", "--quiet"],
                             monkeypatch, capsys, tmp_path)
    assert code == 2 and out == "" and "in.en: no sentences to evaluate" in err, err  # not "BLEU = 0.00"


def test_a_10000_word_sentence_is_truncated_with_a_warning(tiny_run: Path, tmp_path: Path, monkeypatch, capsys):
    long_line = " ".join(["bread"] * 10_000).encode() + b"\nGood morning.\n"
    code, out, err = run_cli(["translate", "--run", str(tiny_run)], monkeypatch, capsys, tmp_path, stdin=long_line)
    assert code == 0, err
    assert len(out.splitlines()) == 2
    # One line as the command's other lines read, not a timestamped log record
    assert err == "tmt: warning: 1 input(s) longer than model.max_len=64 tokens were truncated\n", err


# --- resume: what may change --------------------------------------------------------

def test_resume_refuses_model_or_data_changes_listing_every_key(tiny_run: Path, tmp_path: Path,
                                                                monkeypatch, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    before = snapshot(run)
    code, _, err = run_cli(["train", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--run-dir", str(run),
                            "--resume", "--set", "model.d_ff=48", "--set", "data.max_words=50",
                            "--set", "train.max_steps=6"], monkeypatch, capsys, tmp_path)
    assert code == 2, err
    assert "model.d_ff: 32 -> 48" in err and "data.max_words" in err and "train.max_steps" not in err
    assert {k: v for k, v in snapshot(run).items() if k != "train.log"} == \
        {k: v for k, v in before.items() if k != "train.log"}


def test_resume_report_names_the_position_and_the_changed_training_settings(tiny_run: Path, tmp_path: Path,
                                                                           monkeypatch, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    code, _, err = run_cli(["train", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--run-dir", str(run),
                            "--resume", "--no-progress", "--set", "train.max_steps=4",
                            "--set", "train.eval_every_steps=2"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert "resuming from" in err and "step_00000003.pt: step 3, epoch" in err and "batch" in err
    assert "train.max_steps: 3 -> 4" in err and "train.eval_every_steps: 3 -> 2" in err


# --- faults during training -------------------------------------------------------------

def test_a_non_finite_loss_skips_the_update_and_training_goes_on(tiny_corpus: Path, tmp_path: Path, monkeypatch):
    real_loss, calls = train_step_module.StepLoss.forward, []

    def loss_with_a_nan(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        if torch.is_grad_enabled():  # a training step, not validation
            calls.append(1)
            if len(calls) == 3:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(train_step_module.StepLoss, "forward", loss_with_a_nan)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 5, "eval_every_steps": 5, "save_every_steps": 5})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    state = train(cfg, tmp_path / "run", progress=False)
    assert state.step == 5 and state.skipped_nonfinite == 1 and len(calls) == 6  # 6 batches for 5 updates
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000005.pt")
    assert all(torch.isfinite(t).all() for t in saved["model"].values())
    adam_steps = {int(s["step"]) for s in saved["optimizer"]["state"].values()}
    assert adam_steps == {5}  # the skipped batch did not reach the optimizer
    assert read_scalars(tmp_path / "run", "train/skipped_nonfinite") == {2: 1.0}


def test_non_finite_losses_in_a_row_stop_the_run_naming_the_step(tiny_corpus: Path, tmp_path: Path, monkeypatch):
    real_loss = train_step_module.StepLoss.forward

    def infinite_in_training(*args, **kwargs):
        return real_loss(*args, **kwargs) * (float("inf") if torch.is_grad_enabled() else 1)

    monkeypatch.setattr(train_step_module.StepLoss, "forward", infinite_in_training)
    cfg = tiny_config(tiny_corpus, train={"max_nonfinite_steps": 3})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    with pytest.raises(TrainingError, match=r"stopping at step 1: 3 updates in a row .*train.max_nonfinite_steps=3.*"
                                            r"then start again with --overwrite \(no checkpoint was written yet\)"):
        train(cfg, tmp_path / "run", progress=False)  # --resume would find nothing to resume from


def test_out_of_memory_skips_one_batch_and_stops_with_advice_the_second_time(tiny_corpus: Path, tmp_path: Path):
    cfg = tiny_config(tiny_corpus, train={"max_steps": 4, "eval_every_steps": 4, "save_every_steps": 4})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    real_forward, calls = trainer.train_step.step_model.forward, []  # the step's forward (`StepLoss`)

    def forward(*args, fail_at=(2,)):
        calls.append(1)
        if len(calls) in fail_at and torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(*args)

    trainer.train_step.step_model.forward = forward
    state = trainer.run()
    assert state.step == 4 and state.skipped_oom == 1

    again = range(len(calls) + 1, len(calls) + 100)
    trainer.train_step.step_model.forward = lambda *args: forward(*args, fail_at=again)
    trainer.cfg = tiny_config(tiny_corpus, train={"max_steps": 8})
    with pytest.raises(TrainingError, match=r"out of memory again at step 5 .*lower train.batch_tokens \(now 64\)"):
        trainer.run()


def test_out_of_memory_in_an_fp16_optimizer_step_leaves_a_scaler_that_goes_on(tiny_corpus: Path, tmp_path: Path):
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(tiny_config(tiny_corpus), tmp_path / "run", progress=False)
    trainer.train_step.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # as fp16 training on a GPU has
    real_step = trainer.train_step.optimizer.step

    def step_out_of_memory(*args, **kwargs):
        trainer.train_step.optimizer.step = real_step
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    trainer.train_step.optimizer.step = step_out_of_memory  # after unscale_, inside scaler.step
    batch = trainer.train_step.batches.load(list(range(4)))
    assert trainer.train_step.run_or_skip([batch], batch.n_tgt_tokens, None, 0) is None
    assert trainer.train_step.run(batch).updated  # the scaler's next unscale_ is allowed
    assert trainer.train_step.scaler.get_scale() == 1024.0


def test_a_full_disk_keeps_the_earlier_checkpoints_and_stops_clearly(tiny_corpus: Path, tmp_path: Path,
                                                                    monkeypatch, capsys):
    run = tmp_path / "run"
    cfg = tiny_config(tiny_corpus, train={"max_steps": 6, "eval_every_steps": 3, "save_every_steps": 3})
    save_config(cfg, tmp_path / "tiny.yaml")
    real_save, saves = torch.save, []

    def save_onto_a_full_disk(obj, handle):
        saves.append(1)
        if len(saves) == 2:  # the second checkpoint: write it to a device that is always full
            with open("/dev/full", "wb") as full:
                real_save(obj, full)
                full.flush()
        real_save(obj, handle)

    monkeypatch.setattr(torch, "save", save_onto_a_full_disk)
    code, _, err = run_cli(["train", "--config", str(tmp_path / "tiny.yaml"), "--run-dir", str(run),
                            "--no-progress"], monkeypatch, capsys, tmp_path)
    assert code == 1 and "Traceback" not in err
    assert "could not write checkpoint " + str(run / "checkpoints" / "step_00000006.pt") + \
        ": No space left on device; " in err
    assert "earlier checkpoints are intact" in err
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best.pt", "step_00000003.pt"]  # no temp file left behind
    assert load_checkpoint(run / "checkpoints" / "step_00000003.pt")["train_state"]["step"] == 3

    monkeypatch.setattr(torch, "save", real_save)  # space freed: resume finishes the run
    code, _, err = run_cli(["train", "--config", str(tmp_path / "tiny.yaml"), "--run-dir", str(run),
                            "--resume", "--no-progress"], monkeypatch, capsys, tmp_path)
    assert code == 0, err


def test_a_failed_text_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path, monkeypatch):
    """config.yaml, summary.json, splits.json, hypotheses and scores all go through this writer."""
    target = tmp_path / "summary.json"
    write_text_atomic(target, "old\n")
    assert target.read_text(encoding="utf-8") == "old\n"

    def fsync_on_a_full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_on_a_full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(target, "new, never complete\n")
    assert target.read_text(encoding="utf-8") == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # the temp file is gone


def test_text_files_get_the_usual_permissions(tmp_path: Path):
    previous = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "config.yaml", "a: 1\n")
        (tmp_path / "plain.txt").write_text("a: 1\n")
    finally:
        os.umask(previous)
    assert (tmp_path / "config.yaml").stat().st_mode & 0o777 == (tmp_path / "plain.txt").stat().st_mode & 0o777 == 0o644


def test_a_checkpoint_trained_with_other_tokenizers_is_refused(tiny_run: Path, tmp_path: Path, monkeypatch,
                                                                capsys):
    run_dir = copy_run(tiny_run, tmp_path / "run")
    foreign = run_dir / "checkpoints" / "other.pt"  # say, copied from another run with as many pieces
    state = load_checkpoint(run_dir / "checkpoints" / "best.pt")
    assert state["tokenizers"] == TokenizerPair.load(run_dir).fingerprint()
    state["tokenizers"] = "0" * 32
    torch.save(state, foreign)
    for command in (["translate", "--checkpoint", str(foreign), "Buongiorno."],
                    ["evaluate", "--checkpoint", str(foreign), "--quiet"]):
        code, out, err = run_cli(command, monkeypatch, capsys, tmp_path)
        assert code == 1 and out == "", err
        assert f"{foreign} was trained with other tokenizers than those of {run_dir}" in err
    torch.save(state, run_dir / "checkpoints" / "step_00000004.pt")  # the newest step: what --resume loads
    cfg = load_config(tiny_run.parent.parent / "tiny.yaml", ["train.max_steps=5"])
    with pytest.raises(CheckpointError, match="trained with other tokenizers"):
        train(cfg, run_dir, resume=True, progress=False)
    del state["tokenizers"]  # a checkpoint from before tmt saved the fingerprint: trusted
    torch.save(state, foreign)
    code, out, err = run_cli(["translate", "--checkpoint", str(foreign), "Buongiorno."], monkeypatch, capsys, tmp_path)
    assert code == 0 and out.strip(), err


# --- signals outside the training steps ------------------------------------------------

def test_a_signal_during_the_last_validation_stops_before_the_final_test(tiny_corpus: Path, tmp_path: Path,
                                                                         monkeypatch):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 3, "eval_every_steps": 3})
    validate = Trainer.validate

    def signalled(self, writer):
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice comes while the last step validates
        return validate(self, writer)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "validate", signalled)
        with pytest.raises(TrainingStopped, match="^interrupted by SIGTERM after the last step \\(3\\); checkpoint "
                                                  "saved$") as stopped:
            train(cfg, run, progress=False)
    assert stopped.value.exit_code == 143
    assert (run / "checkpoints" / "step_00000003.pt").is_file() and not (run / "evaluation").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    train(cfg, run, resume=True, progress=False)  # nothing left to train: the final test
    assert (run / "evaluation" / "test_scores.json").is_file()


def test_sigterm_in_the_final_test_is_an_interruption_the_summary_records(tiny_corpus: Path, tmp_path: Path,
                                                                          monkeypatch):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    handler = signal.getsignal(signal.SIGTERM)

    def terminated(self):
        os.kill(os.getpid(), signal.SIGTERM)  # without tmt's handler, this would kill pytest itself
        raise AssertionError("SIGTERM did not interrupt the final test")

    monkeypatch.setattr(Trainer, "final_test", terminated)
    with pytest.raises(Terminated):
        train(tiny_config(tiny_corpus, train={"max_steps": 2}), run, progress=False)
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is handler  # restored


@pytest.mark.parametrize("checkpoint", [True, False])
def test_an_interrupted_train_command_says_how_to_go_on(checkpoint, tiny_run: Path, tmp_path: Path, monkeypatch,
                                                       capsys):
    config = tiny_run.parent.parent / "tiny.yaml"
    # With a checkpoint: a resumed run. Without: a new one, stopped while its data was prepared.
    run_dir = copy_run(tiny_run, tmp_path / "run") if checkpoint else tmp_path / "new"
    resume = ["--resume"] if checkpoint else []

    def terminated(*args, **kwargs):
        raise Terminated()

    monkeypatch.setattr(training, "train", terminated)
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(run_dir), *resume,
                            "--set", "train.max_steps=4"], monkeypatch, capsys, tmp_path)
    again = ["tmt", "train", "--config", str(config), "--run-dir", str(run_dir), "--set", "train.max_steps=4"]
    assert code == 143 and "Traceback" not in err and "error" not in err
    again = shlex.join(again + ['--resume'] if checkpoint else again)
    assert err.splitlines()[-1] == f"tmt: interrupted by SIGTERM; continue with: {again}"


# --- kill -9 at any moment, then resume ------------------------------------------------

# Runs `train` in a child process that SIGKILLs itself at a chosen point: `step@N` before
# update N+1, `write@N` half-way through writing the N-th checkpoint file, `rename@N` just
# before the N-th checkpoint rename (the temp file complete), `validate@N` inside the N-th
# validation. With `resume`, it continues the run instead (and is not killed). The patches
# are made in the child, whose memory is its own.
def train_killed_at(config: Path, run_dir: Path, mode: str) -> None:
    from transformer_mt.runs import checkpoint
    from transformer_mt.runs import run_dir as run_dir_module

    logging.basicConfig(level=logging.INFO)
    point, _, n = mode.partition("@")
    n, calls = int(n or 0), []

    def kill_on_nth_call():
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "step":
        real_step = train_step_module.TrainStep.run

        def train_step(self, *args, **kwargs):
            if self.state.step == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_step(self, *args, **kwargs)
        train_step_module.TrainStep.run = train_step
    elif point == "write":
        real_save = torch.save

        def save(obj, handle):
            real_save(obj, handle)
            if len(calls) + 1 == n:
                handle.flush()
                handle.truncate(handle.tell() // 2)  # what the disk holds when the process dies mid-write
            kill_on_nth_call()
        torch.save = save
    elif point == "rename":
        real_replace = os.replace

        def replace(src, dst):
            if str(dst).endswith(".pt"):
                kill_on_nth_call()
            real_replace(src, dst)
        checkpoint.os.replace = replace
    elif point == "validate":
        real_validate = training.Trainer.validate

        def validate(self, writer):
            kill_on_nth_call()
            return real_validate(self, writer)
        training.Trainer.validate = validate

    resume = point == "resume"
    run_dir_module.prepare_run_dir(run_dir, resume=resume, overwrite=False)
    training.train(load_config(config), run_dir, resume=resume, progress=False)


def drive(config: Path, run_dir: Path, mode: str) -> subprocess.CompletedProcess:
    return forked(lambda: train_killed_at(config, run_dir, mode), cwd=run_dir.parent,
                  env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, Path]:
    """(config file, run directory) of the reference run that was never killed."""
    root = tmp_path_factory.mktemp("kill")
    corpus = write_corpus(root / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    config = root / "tiny.yaml"
    save_config(tiny_config(corpus, train=KILL_RUN), config)
    result = drive(config, root / "straight", "none")
    assert result.returncode == 0, result.stderr
    return config, root / "straight"


# (kill point, the step the resumed run continues from)
KILL_POINTS = [("step@2", None), ("step@4", 3), ("write@2", 3), ("rename@2", 3), ("validate@2", 3), ("step@8", 6)]


@pytest.mark.parametrize("point, resumes_from", KILL_POINTS)
def test_a_killed_run_resumes_to_exactly_the_uninterrupted_result(point, resumes_from, uninterrupted, tmp_path):
    config, straight = uninterrupted
    run = tmp_path / "run"
    killed = drive(config, run, point)
    assert killed.returncode == -9, killed.stderr  # it really died by SIGKILL

    # No checkpoint yet: starting again (without --resume) reuses the half-made run directory.
    resumed = drive(config, run, "resume" if resumes_from else "none")
    assert resumed.returncode == 0, resumed.stderr
    if resumes_from:
        assert f"step_{resumes_from:08d}.pt: step {resumes_from}," in resumed.stderr
    if resumes_from == 3:  # 12 pairs make 2 batches per epoch: step 3 is in the middle of epoch 2
        assert "epoch 2, batch 1 of that epoch" in resumed.stderr

    expected, got = read_scalars(straight, "train/loss"), read_scalars(run, "train/loss")
    assert sorted(got) == sorted(expected) == list(range(1, KILL_RUN["max_steps"] + 1)), (
        sorted(got), sorted(path.name for path in (run / "tensorboard").iterdir()))
    for step in expected:
        assert abs(got[step] - expected[step]) < 1e-6, (step, got[step], expected[step])
    final = f"step_{KILL_RUN['max_steps']:08d}.pt"
    a, b = (load_checkpoint(d / "checkpoints" / final) for d in (straight, run))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["sampler"] == b["sampler"] and progress_of(a) == progress_of(b)
    assert not list((run / "checkpoints").glob(".*.tmp"))
    if point.startswith(("write@", "rename@")):  # the crash left a temp file: resume removed it, not a save
        assert "left by an interrupted save" in resumed.stderr
    best_a, best_b = (load_checkpoint(d / "checkpoints" / "best.pt") for d in (straight, run))
    assert progress_of(best_a) == progress_of(best_b)


def progress_of(checkpoint: dict) -> dict:
    """The train state without the wall time, which no two runs share."""
    return {k: v for k, v in checkpoint["train_state"].items() if k != "train_seconds"}


def test_resume_may_change_how_many_processes_tokenize():
    from transformer_mt.runs.run_dir import resume_config_changes

    changes = resume_config_changes({"data": {"path": "d", "num_proc": 2}}, {"data": {"path": "d", "num_proc": 4}},
                                     Path("step_00000010.pt"))
    assert changes == ["data.num_proc: 2 -> 4"]


def test_rng_states_of_devices_that_cannot_be_restored_are_named(monkeypatch, caplog):
    """A run saved with 2 visible GPUs, resumed with 1: its CUDA RNG states cannot be put back."""
    from transformer_mt.core import runtime

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    cpu_state = torch.get_rng_state()
    with caplog.at_level("WARNING", logger="transformer_mt.core.runtime"):
        runtime.load_rng_state({"cpu": cpu_state, "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2})
    assert restored == [] and "2 CUDA devices, and 1 are visible" in caplog.text
    assert torch.equal(torch.get_rng_state(), cpu_state)
    runtime.load_rng_state({"cpu": cpu_state, "cuda": [torch.zeros(16, dtype=torch.uint8)]})
    assert len(restored) == 1


def test_a_checkpoint_that_is_not_one_or_lies_outside_a_run_is_named(tiny_run: Path, tmp_path: Path,
                                                                     monkeypatch, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "notes.pt").write_bytes((run / "config.yaml").read_bytes())
    code, _, err = run_cli(["translate", "--checkpoint", str(run / "checkpoints" / "notes.pt"), "Hello."],
                           monkeypatch, capsys, tmp_path)
    assert code == 1 and "notes.pt: not a readable checkpoint" in err, err
    assert "weights_only" not in err and len(err.strip().splitlines()) == 1  # torch's advice is not passed on
    best = (run / "checkpoints" / "best.pt").read_bytes()
    (run / "checkpoints" / "cut.pt").write_bytes(best[:len(best) // 2])  # a copy cut short
    code, _, err = run_cli(["translate", "--checkpoint", str(run / "checkpoints" / "cut.pt"), "Hello."],
                           monkeypatch, capsys, tmp_path)
    assert code == 1 and "cut.pt: not a readable checkpoint" in err, err
    assert "central directory)" in err and "likelihood" not in err, err  # the cause, not torch's guesses after it
    shutil.copyfile(run / "checkpoints" / "best.pt", tmp_path / "copied.pt")
    code, _, err = run_cli(["translate", "--checkpoint", str(tmp_path / "copied.pt"), "Hello."],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and "inside a run's checkpoints/ folder" in err, err


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_file_torch_never_wrote_is_told_apart_from_a_checkpoint_holding_other_objects(tmp_path: Path, legacy):
    import datetime

    (tmp_path / "garbage.pt").write_bytes(b"garbage\n")  # torch's weights-only unpickler fails on it too
    with pytest.raises(CheckpointError, match=r"garbage\.pt: .*it is not a PyTorch file") as excinfo:
        load_checkpoint(tmp_path / "garbage.pt")
    assert "objects other than" not in str(excinfo.value)
    (tmp_path / "empty.pt").write_bytes(b"")  # say, the disk filled up before the first byte
    with pytest.raises(CheckpointError, match=r"empty\.pt: not a readable checkpoint: the file is empty"):
        load_checkpoint(tmp_path / "empty.pt")
    # A real torch.save file, in either of its formats, holding a date: the weights-only load refuses it.
    torch.save({"model": {}, "saved_on": datetime.date(2024, 1, 1)}, tmp_path / "dated.pt",
               _use_new_zipfile_serialization=not legacy)
    with pytest.raises(CheckpointError, match=r"dated\.pt: .*it holds objects other than tensors"):
        load_checkpoint(tmp_path / "dated.pt")


def test_tmt_data_names_the_runs_damaged_file_not_its_scratch_copy(tiny_run: Path, tmp_path: Path,
                                                                    monkeypatch, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    (run / "tokenizer.json").write_text("{junk", encoding="utf-8")
    code, _, err = run_cli(["data", "--config", str(tiny_run.parent.parent / "tiny.yaml"), "--run-dir", str(run)],
                           monkeypatch, capsys, tmp_path)
    assert code == 1 and f"{run / 'tokenizer.json'}: cannot load tokenizer" in err and "tmt-data-" not in err, err
