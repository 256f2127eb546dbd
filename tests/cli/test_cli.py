"""End to end through the real `tmt` entry point, in subprocesses, in a temp directory."""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import DEMO_CONFIG, PYTHONPATH, run_cli

STEPS = 40
CORPUS = DEMO_CONFIG.parent.parent / "transformer_mt" / "corpora" / "demo_en_it"
VALID_EN, VALID_IT = CORPUS / "valid.en", CORPUS / "valid.it"


def tmt(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transformer_mt", *args], cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                               "PYTHONPATH": PYTHONPATH})


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny demo run trained through the CLI; returns the working directory holding runs/demo."""
    workdir = tmp_path_factory.mktemp("cli")
    result = tmt("train", "--config", str(DEMO_CONFIG), "--no-progress",
                 "--set", f"train.max_steps={STEPS}", "--set", "train.eval_every_steps=20",
                 "--set", "train.save_every_steps=20", "--set", "model.d_model=32", "--set", "model.d_ff=64",
                 cwd=workdir)
    assert result.returncode == 0, result.stderr
    return workdir


def test_train_then_translate_gives_the_validation_translations(trained: Path, tmt_here):
    tmp_path, run = trained, trained / "runs" / "demo"
    for name in ("config.yaml", "tokenizer.json", "train.log", f"checkpoints/step_{STEPS:08d}.pt", "checkpoints/best.pt"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # Validation decoded every valid sentence (demo: eval_max_sentences 0); translating them
    # with the same checkpoint must give the same text.
    validation = (run / "validation" / f"step_{STEPS:08d}.txt").read_text("utf-8")
    result = tmt("translate", "--checkpoint", str(run / "checkpoints" / f"step_{STEPS:08d}.pt"),
                 cwd=tmp_path, stdin=VALID_EN.read_text("utf-8"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == validation

    # No --run: the newest run under ./runs; arguments instead of stdin; one line each.
    result = tmt_here("translate", "Good morning.", "Where is the station?", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2

    # Training again into the same directory refuses and keeps everything.
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    result = tmt_here("train", "--config", str(DEMO_CONFIG), cwd=tmp_path)
    assert result.returncode == 2
    assert "--resume" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_bad_config_exits_2_naming_every_key_without_a_traceback(tmp_path: Path, tmt_here):
    config = tmp_path / "bad.yaml"
    config.write_text("name: x\ndata: {path: .}\ntrian: {}\nmodel: {d_model: 30, n_heads: 4}\n", encoding="utf-8")
    result = tmt_here("train", "--config", str(config), "--set", "train.lr=fast", cwd=tmp_path)
    assert result.returncode == 2
    assert "trian: unknown key (did you mean 'train'?)" in result.stderr
    assert "train.lr: expected a number" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_precision_the_device_lacks_is_refused_before_the_run_directory_exists(tmp_path: Path, tmt_here):
    result = tmt_here("train", "--config", str(DEMO_CONFIG), "--set", "train.device=cpu",
                      "--set", "train.precision=fp16", cwd=tmp_path)
    assert result.returncode == 2 and "train.precision: fp16 needs a CUDA GPU" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


def test_translate_without_any_run_exits_1_with_a_clear_message(tmp_path: Path, tmt_here):
    result = tmt_here("translate", "hello", cwd=tmp_path)
    assert result.returncode == 1
    assert "no trained run found" in result.stderr and "Traceback" not in result.stderr


def test_resume_without_a_checkpoint_exits_1(tmp_path: Path, tmt_here):
    result = tmt_here("train", "--config", str(DEMO_CONFIG), "--resume", "--run-dir", str(tmp_path / "empty"),
                      cwd=tmp_path)
    assert result.returncode == 1
    assert "no checkpoint to resume from" in result.stderr


def test_translate_files_with_beam_search_keeps_input_order_and_empty_lines(trained: Path, tmt_here):
    lines = ["Good morning.", "", "The city is very beautiful and the coffee is hot, isn't it?", "Yes."]
    (trained / "in.en").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    result = tmt_here("translate", "--run", "runs/demo", "--beam", "3", "--input", "in.en", "--output", "out/it.txt",
                      cwd=trained)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    out = (trained / "out" / "it.txt").read_text("utf-8").split("\n")
    assert len(out) == len(lines) + 1 and out[-1] == ""  # one line each, newline-terminated
    assert out[1] == ""
    # Each line translated alone gives the same result: order is restored after length sorting.
    alone = tmt_here("translate", "--run", "runs/demo", "--beam", "3", lines[2], cwd=trained)
    assert alone.stdout == out[2] + "\n"


def test_evaluate_scores_a_split_and_files_with_the_sacrebleu_signature(trained: Path, tmt_here):
    result = tmt("evaluate", "--run", "runs/demo", "--split", "valid", "--quiet", cwd=trained)
    assert result.returncode == 0, result.stderr
    bleu_line, chrf_line, chrf_pp_line, ter_line = result.stdout.splitlines()[:4]
    assert bleu_line.startswith("BLEU = ") and "tok:13a" in bleu_line and "(95% CI " in bleu_line
    assert chrf_line.startswith("chrF = ") and chrf_pp_line.startswith("chrF++ = ") and ter_line.startswith("TER = ")
    hyps = (trained / "runs" / "demo" / "evaluation" / "valid.best.beam1.txt").read_text("utf-8")
    # Greedy on the whole valid split is what validation at the best step produced.
    best_step = torch.load(trained / "runs/demo/checkpoints/best.pt", weights_only=True)["train_state"]["step"]
    assert hyps == (trained / "runs/demo/validation" / f"step_{best_step:08d}.txt").read_text("utf-8")

    result = tmt_here("evaluate", "--run", "runs/demo", "--src", str(VALID_EN), "--ref", str(VALID_IT),
                      "--tokenize", "none", "--quiet", cwd=trained)
    assert result.returncode == 0, result.stderr
    assert "tok:none" in result.stdout


def test_evaluate_with_misaligned_files_names_both_counts(trained: Path, tmp_path: Path, tmt_here):
    (tmp_path / "ref.it").write_text("uno\n", encoding="utf-8")
    result = tmt_here("evaluate", "--run", str(trained / "runs" / "demo"), "--src", str(VALID_EN),
                      "--ref", str(tmp_path / "ref.it"), cwd=tmp_path)
    assert result.returncode == 1
    assert "has 60 lines but" in result.stderr and "has 1" in result.stderr


def test_an_output_under_a_file_is_refused_naming_that_file(trained: Path, tmp_path: Path, tmt_here):
    (tmp_path / "in.en").write_text("Good morning.\n", encoding="utf-8")
    run = str(trained / "runs" / "demo")
    for args in (["translate", "--run", run, "--input", "in.en", "--output", "in.en/out.it"],
                 ["translate", "--run", run, "--input", "in.en", "--output", "in.en/sub/out.it"],
                 ["evaluate", "--run", run, "--quiet", "--output", "in.en/out.it"]):
        result = tmt_here(*args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert f"--output {args[-1]}: in.en is not a directory" in result.stderr, result.stderr
        assert (tmp_path / "in.en").read_text("utf-8") == "Good morning.\n"
    # The check creates nothing: a command that then fails leaves no folder behind.
    result = tmt_here("translate", "--run", "no-such-run", "--output", "a/b/out.it", "Hello.", cwd=tmp_path)
    assert result.returncode == 1 and "no-such-run: no such run directory" in result.stderr
    assert not (tmp_path / "a").exists()


def test_translate_into_a_closed_pipe_exits_quietly(trained: Path):
    script = f"{sys.executable} -m transformer_mt translate --run runs/demo 'Good morning.' 'Yes.' 'No.' | head -c 0"
    result = subprocess.run(["bash", "-c", script], cwd=trained, capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"})
    assert "Error" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_says_how_to_resume(sig, tmp_path: Path):
    overrides = ["--set", "train.max_steps=100000", "--set", "train.log_every_steps=1", "--set", "model.d_model=32",
                 "--set", "model.d_ff=64", "--set", "train.save_every_steps=100000"]
    process = subprocess.Popen(
        [sys.executable, "-m", "transformer_mt", "train", "--config", str(DEMO_CONFIG), "--no-progress", *overrides],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH})
    for line in process.stderr:  # wait until training steps are running
        if "step 3/" in line:
            break
    process.send_signal(sig)
    rest = process.stderr.read()
    assert process.wait(timeout=60) == 128 + sig  # 130 for Ctrl-C, 143 for SIGTERM
    checkpoints = list((tmp_path / "runs" / "demo" / "checkpoints").glob("step_*.pt"))
    assert len(checkpoints) == 1
    step = int(checkpoints[0].stem.removeprefix("step_"))
    # A stop the user asked for, not an error; the same config and overrides (without them the resume
    # would be refused: model.* differs).
    by = " by SIGTERM" if sig == signal.SIGTERM else ""
    again = shlex.join(["tmt", "train", "--config", str(DEMO_CONFIG), *overrides, "--resume"])
    last = f"tmt: interrupted{by} at step {step}; checkpoint saved; continue with: {again}"
    assert rest.splitlines()[-1] == last
    assert "error" not in rest and "Traceback" not in rest
    log = (tmp_path / "runs" / "demo" / "train.log").read_text("utf-8")
    # The log of a run read later ends as the terminal did.
    assert log.splitlines()[-1].endswith(f" {last}") and "ERROR" not in log.splitlines()[-1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_python_exits_ends_it_with_tmts_exit_code_and_no_traceback(sig, tmp_path: Path):
    """After tmt's last line (say, a second Ctrl-C after a stopped run) Python runs its exit handlers
    (torch's among them); a signal then must not print a KeyboardInterrupt traceback under that line,
    nor lose what tmt wrote to stdout."""
    script = (f"import atexit, os, time; from transformer_mt.cli import main as cli\n"
              f"cli.main = lambda: print('translated') or 130\n"
              f"atexit.register(lambda: os.kill(os.getpid(), {int(sig)}) or time.sleep(30))\n"
              f"cli.run()\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH})
    assert (result.returncode, result.stdout, result.stderr) == (130, "translated\n", "")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_a_signal_while_translating_says_so_and_leaves_the_output_alone(command, sig, trained: Path, tmp_path: Path):
    """Ctrl-C or SIGTERM (a job scheduler's stop) while `tmt translate` or `tmt evaluate` reads its
    input: one line, exit 128 + signal, no traceback, the --output file as it was."""
    fifo, output = tmp_path / "in.en", tmp_path / "out.it"
    os.mkfifo(fifo)
    output.write_text("the user's earlier translations\n", encoding="utf-8")
    inputs = ["--input", str(fifo)] if command == "translate" else ["--src", str(fifo), "--ref", str(VALID_IT)]
    process = subprocess.Popen(
        [sys.executable, "-m", "transformer_mt", command, "--run", "runs/demo", *inputs, "--output", str(output)],
        cwd=trained, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": PYTHONPATH})
    deadline = time.monotonic() + 120
    while True:  # opening the fifo's writing end succeeds once tmt has opened it to read: tmt waits there
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.05)
    try:
        # A signal between tmt's open() and its read() is handled only once read() returns (Python runs
        # its handlers between bytecodes): wait until tmt sleeps in read(), as a user's Ctrl-C finds it.
        wchan, waited = Path(f"/proc/{process.pid}/wchan"), time.monotonic() + 10
        while "pipe" not in wchan.read_text() and time.monotonic() < waited:
            time.sleep(0.05)
        process.send_signal(sig)
        assert process.wait(timeout=60) == 128 + sig  # 130 for Ctrl-C, 143 for SIGTERM
    finally:
        os.close(writer)
    by = " by SIGTERM" if sig == signal.SIGTERM else ""
    assert process.stderr.read() == f"tmt: interrupted{by}\n"
    assert output.read_text("utf-8") == "the user's earlier translations\n"


@pytest.mark.parametrize("bad", ["missing data path", "missing language file"])
def test_a_start_that_fails_on_its_data_leaves_no_run_behind(bad, tmp_path: Path, tmt_here):
    corpus = tmp_path / "corpus"
    if bad == "missing language file":
        corpus.mkdir()
        for split in ("train", "valid", "test"):
            (corpus / f"{split}.en").write_text(f"Hello from {split}.\n", encoding="utf-8")
            (corpus / f"{split}.it").write_text(f"Ciao da {split}.\n", encoding="utf-8")
        (corpus / "train.it").unlink()
    result = tmt_here("train", "--config", str(DEMO_CONFIG), "--run-dir", "runs/m3", "--set", f"data.path={corpus}",
                      "--no-progress", cwd=tmp_path)
    assert result.returncode == 1 and result.stderr.splitlines()[-1].startswith("tmt: error: "), result.stderr
    assert not (tmp_path / "runs").exists()  # nor the folder created to hold it
    listed = tmt_here("runs", cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.splitlines()[1:] == [], listed.stdout

    # A folder the user made is theirs: left in place, as it was.
    (tmp_path / "mine").mkdir()
    result = tmt_here("train", "--config", str(DEMO_CONFIG), "--run-dir", "mine", "--set", f"data.path={corpus}",
                      "--no-progress", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert (tmp_path / "mine").is_dir() and list((tmp_path / "mine").iterdir()) == []


def test_show_attention_draws_a_png_of_one_sentence(trained: Path, tmt_here):
    result = tmt_here("translate", "--run", "runs/demo", "--show-attention", "att/a.png", "--attention-layer", "0",
                      "Where is the station?", cwd=trained)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1  # the translation, as without --show-attention
    assert (trained / "att" / "a.png").read_bytes().startswith(b"\x89PNG")
    result = tmt_here("translate", "--run", "runs/demo", "--show-attention", "b.png", "One.", "Two.", cwd=trained)
    assert result.returncode == 2 and "one sentence" in result.stderr
    result = tmt_here("translate", "--run", "runs/demo", "--show-attention", "b.png", "--attention-layer", "7", "One.",
                      cwd=trained)
    assert result.returncode == 2 and "decoder layers" in result.stderr


def test_show_attention_writes_to_output_warns_on_truncation_and_refuses_an_empty_sentence(trained: Path,
                                                                                            tmt_here):
    result = tmt_here("translate", "--run", "runs/demo", "--show-attention", "c.png", "--output", "o/c.txt",
                      "Where is the station?", cwd=trained)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # the translation went to --output, as without --show-attention
    plain = tmt_here("translate", "--run", "runs/demo", "Where is the station?", cwd=trained)
    assert (trained / "o" / "c.txt").read_text("utf-8") == plain.stdout

    long_sentence = " ".join(["the city is beautiful"] * 40)  # 160 words: past the demo's model.max_len=64
    result = tmt_here("translate", "--run", "runs/demo", "--show-attention", "d.png", long_sentence, cwd=trained)
    assert result.returncode == 0, result.stderr
    assert "longer than model.max_len=64 tokens were truncated" in result.stderr

    result = tmt_here("translate", "--run", "runs/demo", "--show-attention", "e.png", " ", cwd=trained)
    assert result.returncode == 2 and "the sentence is empty" in result.stderr and "Traceback" not in result.stderr
    result = tmt_here("translate", "--run", "runs/demo", "--show-attention", "c.png", "--output", "./c.png", "One.",
                      cwd=trained)
    assert result.returncode == 2 and "same file" in result.stderr
    assert not (trained / "e.png").exists() and (trained / "c.png").read_bytes().startswith(b"\x89PNG")


def test_every_command_help_has_examples():
    from transformer_mt.cli.parser import build_parser

    parser = build_parser()
    assert "tmt train --config configs/demo.yaml" in parser.format_help()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) >= {"train", "translate", "evaluate", "export", "average", "runs"}
    for name, command in commands.items():
        assert "examples:" in command.format_help(), name


def help_texts(columns: int, monkeypatch) -> dict[str, str]:
    """`tmt --help` and every `tmt COMMAND --help` as a terminal `columns` wide shows them."""
    from transformer_mt.cli.parser import build_parser

    monkeypatch.setenv("COLUMNS", str(columns))  # argparse sizes its text to it
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {"tmt": parser.format_help(), **{name: command.format_help() for name, command in commands.items()}}


def test_every_help_fits_80_columns_and_splits_no_word(monkeypatch):
    narrow, wide = help_texts(80, monkeypatch), help_texts(200, monkeypatch)
    for name, text in narrow.items():
        too_long = [line for line in text.splitlines() if len(line) > 80]
        assert not too_long, (name, too_long)
        # The same words as on a wide terminal: wrapping moved them, never cut one (`--show-` / `attention`)
        assert text.split() == wide[name].split(), name


@pytest.mark.parametrize("command", ["train", "data"])
@pytest.mark.parametrize("mistake", [["--config", "missing.yaml"], ["--config", "typo.yaml"],
                                     ["--config", "good.yaml", "--set", "train.max_steps"]])
def test_a_config_mistake_is_answered_before_torch_is_imported(command, mistake, tmp_path: Path):
    """torch takes seconds to import: a typo in the config must not wait for it."""
    (tmp_path / "typo.yaml").write_text(DEMO_CONFIG.read_text().replace("max_steps:", "max_step:"))
    (tmp_path / "good.yaml").write_text(DEMO_CONFIG.read_text())
    script = ("import sys; from transformer_mt.cli.main import main; code = main(sys.argv[1:]); "
              "print(code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script, command, *mistake], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH})
    assert result.stdout.split() == ["2", "False"], (result.stdout, result.stderr)
    assert result.stderr.startswith("tmt: error: ") and result.stderr.count("\n") == 1, result.stderr


def test_mistakes_in_naming_a_file_or_an_override_get_the_hint_that_fixes_them(trained: Path, monkeypatch, capsys):
    (trained / "configs").mkdir(exist_ok=True)
    (trained / "configs" / "demo.yaml").write_text(DEMO_CONFIG.read_text())
    (trained / "tabs.yaml").write_text("name: tabs\nmodel:\n\td_model: 64\n")
    cases = [
        (["train", "--config", "configs/demo.yml"], 2,
         "tmt: error: invalid configuration: configs/demo.yml: config file not found (did you mean configs/demo.yaml?)"),
        (["train", "--config", "tabs.yaml"], 2,
         "tmt: error: invalid configuration: tabs.yaml:3: YAML syntax error: found character '\\t' that cannot start "
         "any token (YAML is indented with spaces, never tabs)"),
        (["train", "--config", "configs/demo.yaml", "--set", "train.max_steps", "200"], 2,
         "tmt: error: --set train.max_steps 200: write KEY=VALUE as one word: --set train.max_steps=200"),
        (["translate", "--checkpoint", "runs/demo/checkpoints/step_00002400.pt", "Hello."], 1,
         "tmt: error: runs/demo/checkpoints/step_00002400.pt: checkpoint not found; runs/demo/checkpoints holds "
         f"best.pt, step_{STEPS - 20:08d}.pt, step_{STEPS:08d}.pt"),
    ]
    for args, code, line in cases:
        try:
            got, out, err = run_cli(args, monkeypatch, capsys, trained)
        except SystemExit as exit_:  # refused while parsing the command line, as argparse refuses
            got, (out, err) = exit_.code, capsys.readouterr()
        assert (got, out, err) == (code, "", line + "\n"), args
