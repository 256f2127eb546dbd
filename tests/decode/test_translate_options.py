"""`tmt translate` beyond one best translation: n-best lists with scores, JSON lines, sampling,
interactive use, and attention pictures in the format their name asks for."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import PYTHONPATH, tiny_model
from transformer_mt.decode.generator import greedy_decode, sample_decode
from transformer_mt.decode.hypotheses import Sampling, length_penalty
from transformer_mt.model.transformer import Transformer

BOS, EOS, PAD, V = 1, 2, 0, 24


def sources() -> torch.Tensor:
    return torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD], [11, 12, 13, EOS, PAD]])  # (3, 5)


def sample(model: Transformer, sampling: Sampling, n_samples: int = 1) -> list[list]:
    generator = torch.Generator().manual_seed(sampling.seed)
    return sample_decode(model, sources(), bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4, sampling=sampling,
                         generator=generator, n_samples=n_samples)


# --- sampling in decoding.py ------------------------------------------------------------------

def test_sampling_from_the_top_token_only_is_greedy_decoding():
    model = tiny_model(vocab_size=V)
    greedy = greedy_decode(model, sources(), bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    for sampling in (Sampling(top_k=1, temperature=5.0), Sampling(top_p=1e-6, seed=3)):
        assert [samples[0].ids for samples in sample(model, sampling)] == greedy, sampling


def test_samples_repeat_with_the_seed_and_differ_with_another():
    model = tiny_model(vocab_size=V)
    first = sample(model, Sampling(temperature=2.0, seed=1), n_samples=3)
    assert sample(model, Sampling(temperature=2.0, seed=1), n_samples=3) == first
    assert sample(model, Sampling(temperature=2.0, seed=2), n_samples=3) != first
    assert [len(samples) for samples in first] == [3, 3, 3]


def test_a_samples_score_is_its_log_probability_under_the_model_over_the_length_penalty():
    model = tiny_model(vocab_size=V)
    for src, samples in zip(sources(), sample(model, Sampling(temperature=3.0, seed=4), n_samples=2)):
        for hyp in samples:
            src_ids = src[src != PAD][None]  # (1, S)
            cap = int(1.5 * src_ids.shape[1] + 4)  # max_len_a · S + max_len_b tokens, EOS included
            targets = hyp.ids if len(hyp.ids) == cap else hyp.ids + [EOS]  # a sample cut at the cap has no EOS
            tgt_in = torch.tensor([[BOS] + targets[:-1]])  # (1, T)
            with torch.no_grad():
                logits = model(src_ids, tgt_in).float()  # (T, V)
            logits[:, [PAD, BOS]] = torch.finfo(logits.dtype).min  # never generated
            log_prob = torch.log_softmax(logits, -1)[range(len(targets)), targets].sum().item()
            assert hyp.log_prob == pytest.approx(log_prob, abs=1e-4)
            assert hyp.score == pytest.approx(log_prob / len(targets), abs=1e-4)  # α 1 by default


def test_top_k_and_top_p_cut_the_distribution_where_they_say():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = Sampling(top_k=2).probabilities(logits)
    assert torch.allclose(kept, torch.tensor([[0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]]))
    # top-p 0.75: 0.5 alone falls short, 0.5 + 0.3 reaches it; the rest is cut (not renormalised:
    # torch.multinomial takes weights)
    assert torch.allclose(Sampling(top_p=0.75).probabilities(logits), torch.tensor([[0.0, 0.5, 0.0, 0.3]]))
    assert torch.allclose(Sampling(temperature=1.0).probabilities(logits), probs)
    with pytest.raises(ValueError):
        Sampling(temperature=0.0)


# --- the command line -------------------------------------------------------------------------

SENTENCES = ["Good morning.", "", "Where is the station?"]


def test_n_best_lists_with_scores_number_each_sentence_and_start_with_the_plain_translation(workdir: Path, tmt_here):
    plain = tmt_here("translate", "--run", "runs/tiny", "--beam", "4", *SENTENCES, cwd=workdir)
    result = tmt_here("translate", "--run", "runs/tiny", "--beam", "4", "--n-best", "3", "--scores", *SENTENCES,
                      cwd=workdir)
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert all(len(row) == 3 for row in rows)
    # 3 hypotheses each (a tiny model's beam always finishes 4), and one empty one for the empty line
    assert [row[0] for row in rows] == ["0", "0", "0", "1", "2", "2", "2"]
    assert rows[3] == ["1", "0.0000", ""]
    for number in ("0", "2"):
        scores = [float(row[1]) for row in rows if row[0] == number]
        assert scores == sorted(scores, reverse=True) and all(score < 0 for score in scores)
    best = [row[2] for row in rows if row[0] in ("0", "2")][::3]
    assert best == [plain.stdout.splitlines()[0], plain.stdout.splitlines()[2]]
    scored = tmt_here("translate", "--run", "runs/tiny", "--scores", *SENTENCES, cwd=workdir)  # greedy, scored
    assert [line.split("\t")[1] for line in scored.stdout.splitlines()] == \
        tmt_here("translate", "--run", "runs/tiny", *SENTENCES, cwd=workdir).stdout.splitlines()


def test_jsonl_gives_source_hypotheses_scores_and_tokens_per_sentence(workdir: Path, tmt_here):
    result = tmt_here("translate", "--run", "runs/tiny", "--beam", "3", "--n-best", "2", "--format", "jsonl",
                      *SENTENCES, cwd=workdir)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["source"] for r in records] == SENTENCES
    for record in records:
        assert set(record) == {"source", "hypotheses", "scores", "tokens"}
        assert len(record["hypotheses"]) == len(record["scores"]) == len(record["tokens"])
    assert records[1] == {"source": "", "hypotheses": [""], "scores": [0.0], "tokens": [[]]}
    assert len(records[0]["hypotheses"]) == 2 and all(isinstance(t, str) for t in records[0]["tokens"][0])


def test_sampling_from_the_command_line_repeats_with_its_seed(workdir: Path, tmt_here):
    args = ["translate", "--run", "runs/tiny", "--sample", "--temperature", "3", "--n-best", "4", "--scores"]
    first = tmt_here(*args, "--seed", "5", *SENTENCES, cwd=workdir)
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.splitlines()) == 4 + 1 + 4
    assert tmt_here(*args, "--seed", "5", *SENTENCES, cwd=workdir).stdout == first.stdout
    assert tmt_here(*args, "--seed", "6", *SENTENCES, cwd=workdir).stdout != first.stdout


@pytest.mark.parametrize("args, message", [
    (["--n-best", "3"], "tmt: error: --n-best 3: beam search keeps only the run's decode.beam_size=1"),
    (["--beam", "2", "--n-best", "3"], "tmt: error: --n-best 3: beam search keeps only --beam 2"),
    (["--top-k", "5"], "tmt: error: --top-k is a sampling option: add --sample"),
    (["--sample", "--beam", "3"], "tmt: error: --sample draws each token and keeps no beams"),
    (["--show-attention", "a.png", "--n-best", "1", "--scores"], "tmt: error: --show-attention draws the best"),
    (["--sample", "--temperature", "0"], "argument --temperature: must be a finite number above 0"),
    (["--sample", "--top-p", "1.5"], "argument --top-p: must be above 0 and at most 1"),
    (["--interactive", "--output", "x.txt"], "tmt: error: --interactive reads sentences as they are typed"),
    (["--show-attention", "a.bmp"], "tmt: error: --show-attention a.bmp: name a picture file ending in"),
    (["--attention-layer", "0"], "tmt: error: --attention-layer picks the layer --show-attention draws"),
])
def test_list_sampling_and_picture_options_that_cannot_work_are_refused_in_one_line(workdir: Path, tmt_here, args,
                                                                                    message):
    result = tmt_here("translate", "--run", "runs/tiny", *args, "Good morning.", cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr.splitlines()[-1], result.stderr


def test_attention_is_drawn_in_the_format_the_file_name_asks_for(workdir: Path, tmt_here):
    for name, magic in (("a.jpg", b"\xff\xd8\xff"), ("a.svg", b"<?xml"), ("a.pdf", b"%PDF")):
        result = tmt_here("translate", "--run", "runs/tiny", "--show-attention", name, "Good morning.", cwd=workdir)
        assert result.returncode == 0, result.stderr
        assert (workdir / name).read_bytes().startswith(magic), name


def read_line(stream, timeout_s: float = 60) -> str:
    """One line from a subprocess's pipe, failing the test if none comes within `timeout_s`."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, "no output line: the translation did not come as the line was entered"
    return stream.readline().decode("utf-8")


def translator_process(args: list[str], cwd: Path, stdin) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "transformer_mt", "translate", *args], cwd=cwd, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH})


def test_interactive_translates_each_line_as_it_comes_with_the_model_loaded_once(workdir: Path, tmt_here):
    expected = tmt_here("translate", "--run", "runs/tiny", "--scores", "Good morning.", "Thank you very much.",
                        cwd=workdir).stdout.splitlines()
    process = translator_process(["--run", "runs/tiny", "--interactive", "--scores"], workdir, subprocess.PIPE)
    try:
        for sentence, translation in zip(["Good morning.", "Thank you very much."], expected):
            process.stdin.write(sentence.encode() + b"\n")
            process.stdin.flush()  # the next line is not written until this one's translation came back
            assert read_line(process.stdout) == translation + "\n"
        process.stdin.close()
        assert process.wait(timeout=60) == 0
        assert process.stderr.read() == b""  # no prompt when stdin is not a terminal
    finally:
        process.kill()


def test_a_terminal_on_stdin_gets_a_prompt_and_a_translation_per_line(workdir: Path, tmt_here):
    expected = tmt_here("translate", "--run", "runs/tiny", "Good morning.", cwd=workdir).stdout
    main_fd, child_fd = pty.openpty()
    process = translator_process(["--run", "runs/tiny"], workdir, child_fd)
    os.close(child_fd)
    try:
        os.write(main_fd, b"Good morning.\n")
        assert read_line(process.stdout) == expected
        os.write(main_fd, b"\x04")  # Ctrl-D: the end of input
        assert process.wait(timeout=60) == 0
        stderr = process.stderr.read().decode()
        assert "tmt: translating en->it with runs/tiny/checkpoints/best.pt" in stderr and "en> " in stderr
    finally:
        process.kill()
        os.close(main_fd)


def test_translating_imports_nothing_that_only_training_or_scoring_needs(workdir: Path):
    # Start-up time of `tmt translate`: the meta device's sympy, sacreBLEU, datasets,
    # TensorBoard and matplotlib cost seconds together and a translation uses none of them.
    heavy = ["sympy", "sacrebleu", "datasets", "torch.utils.tensorboard", "matplotlib"]
    code = ("import sys; from transformer_mt.cli import main as cli; "
            "code = cli.main(['translate', '--run', 'runs/tiny', 'Good morning.']); "
            f"print(code, [m for m in {heavy!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 []"


# --- target prefixes ---------------------------------------------------------------------------

def test_jsonl_input_begins_each_translation_with_its_lines_prefix(workdir: Path, tmt_here):
    lines = [{"source": "Good morning.", "prefix": "Buon"}, {"source": "Thank you very much."},
             {"source": "Where is the station?", "prefix": ""}, None, {"source": "I am tired.", "prefix": " Sono "}]
    (workdir / "in.jsonl").write_text("".join(("" if line is None else json.dumps(line)) + "\n" for line in lines))

    def translated(*args: str) -> list[str]:
        result = tmt_here("translate", "--run", "runs/tiny", *args, cwd=workdir)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    expected = [*translated("--prefix", "Buon", "Good morning."),
                *translated("Thank you very much.", "Where is the station?"), "",
                *translated("--prefix", "Sono", "I am tired.")]
    assert expected[0].startswith("Buon") and expected[4].startswith("Sono") and expected[0] != translated(
        "Good morning.")[0]
    assert translated("--input-format", "jsonl", "--input", "in.jsonl") == expected
    listed = [json.loads(line) for line in translated("--input-format", "jsonl", "--input", "in.jsonl", "--format",
                                                      "jsonl", "--beam", "2", "--n-best", "2")]
    assert [entry["source"] for entry in listed] == ["Good morning.", "Thank you very much.", "Where is the station?",
                                                     "", "I am tired."]
    assert all(hypothesis.startswith("Buon") for hypothesis in listed[0]["hypotheses"])
    assert all(hypothesis.startswith("Sono") for hypothesis in listed[4]["hypotheses"])


@pytest.mark.parametrize("args, stdin, code, message", [
    (["--input-format", "jsonl"], '{"source": "a"}\n{"source": "b", "prefix": 3}\n', 1,
     'stdin line 2: "prefix" must be a string, got 3'),
    (["--input-format", "jsonl"], '{"source": "b", "prefix": null}\n', 1,
     'stdin line 1: "prefix" must be a string, got null'),
    (["--input-format", "jsonl"], '{"source": "b", "prefx": "c"}\n', 1,
     'stdin line 1: "prefx" is not a field of an input line (source, prefix, constraints)'),
    (["--input-format", "jsonl"], '{"prefix": "c"}\n', 1, 'stdin line 1: no "source", the sentence to translate'),
    (["--input-format", "jsonl"], '["b"]\n', 1, 'stdin line 1: not a JSON object such as {"source"'),
    (["--input-format", "jsonl"], '{"source": "b",\n', 1, "stdin line 1: not valid JSON (Expecting"),
    (["--input-format", "jsonl", "--prefix", "a"], '{"source": "b"}\n', 2,
     '--prefix begins every translation; with --input-format jsonl give each line its "prefix" field instead'),
    (["--prefix", "la " * 30], "Good morning.\n", 1,
     "line 1: the prefix is 30 tokens; this sentence's translation is capped at 17 tokens with its EOS"),
])
def test_bad_prefixes_are_refused_in_one_line_naming_the_line(workdir: Path, tmt_here, args, stdin, code, message):
    result = tmt_here("translate", "--run", "runs/tiny", *args, cwd=workdir, stdin=stdin)
    assert result.returncode == code and result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"tmt: error: {message}"), result.stderr
