"""The decoding engines behind `Translator` (`torch_engine`, `ct2_engine`): the same greedy output and
the same scores, the CTranslate2 conversion cached per checkpoint and never stale or half-written,
and `tmt translate` without torch once the conversion is cached."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import PYTHONPATH, TINY_PAIRS, run_cli, tiny_config, write_corpus
from transformer_mt.core.errors import CheckpointError
from transformer_mt.export import ct2_conversion
from transformer_mt.decode.generator import Sampling
from transformer_mt.decode.translator import Translator
from transformer_mt.runs.checkpoint import load_checkpoint, save_atomic
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.trainer import train

pytest.importorskip("ctranslate2")

# The training sentences, unseen ones, empty ones and long ones (over model.max_len = 64 tokens:
# truncated, and decoded up to the length cap).
SENTENCES = [src for src, _ in TINY_PAIRS] + [
    "", "   ", "?", "Good", "The station is hot.", "Why is the coffee beautiful?", "We read water.",
    "Thank you, the man is here.", "She eats a book and he drinks the coffee.",
    "The city " * 30, "Where is the station? " * 12, "à è ì ò ù l'uomo",
]


def trained_run(directory: Path, steps: int = 40, **sections) -> Path:
    """A tiny run trained `steps` updates (enough to translate something other than one token)."""
    corpus = write_corpus(directory / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    run = directory / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train_section = {"max_steps": steps, "eval_every_steps": steps, "save_every_steps": steps // 2,
                     "keep_last": 3, **sections.pop("train", {})}
    train(tiny_config(corpus, train=train_section, **sections), run, progress=False)
    return run


@pytest.fixture(scope="module")
def pre_norm_run(tmp_path_factory) -> Path:
    """The default model (pre-norm, shared and tied embeddings), with an EMA of its weights."""
    return trained_run(tmp_path_factory.mktemp("pre"), train={"ema_decay": 0.9})


@pytest.fixture(scope="module")
def post_norm_run(tmp_path_factory) -> Path:
    """Post-norm, separate vocabularies and embeddings, untied output, a deeper encoder."""
    return trained_run(tmp_path_factory.mktemp("post"), tokenizer={"joint": False},
                       model={"norm": "post", "share_embeddings": False, "tie_output": False,
                              "encoder_layers": 3, "decoder_layers": 1})


def engines(run: Path) -> tuple[Translator, Translator]:
    torch_translator = Translator.from_run(run, device="cpu", engine="torch")
    ct2_translator = Translator.from_run(run, device="cpu", engine="ctranslate2")
    assert (torch_translator.engine.name, ct2_translator.engine.name) == ("torch", "ctranslate2")
    return torch_translator, ct2_translator


@pytest.mark.usefixtures("pre_norm_run", "post_norm_run")  # declared: tests/conftest.py marks by fixture
@pytest.mark.parametrize("run_name", ["pre_norm_run", "post_norm_run"])
def test_torch_and_ctranslate2_greedy_translations_are_identical(run_name: str, request):
    torch_translator, ct2_translator = engines(request.getfixturevalue(run_name))
    expected = torch_translator.translate(SENTENCES, beam_size=1)
    assert ct2_translator.translate(SENTENCES, beam_size=1) == expected
    assert len(set(expected)) > 5 and expected[len(TINY_PAIRS)] == ""  # not one token for all; empty stays empty
    # A short cap, so that some translations stop at EOS and others at the cap a·S + b.
    for translator in (torch_translator, ct2_translator):
        translator.set_decoding(max_len_a=0.5, max_len_b=2)
    assert ct2_translator.translate(SENTENCES, beam_size=1) == torch_translator.translate(SENTENCES, beam_size=1)


def test_n_best_lists_and_scores_agree_between_engines(pre_norm_run: Path):
    torch_translator, ct2_translator = engines(pre_norm_run)
    greedy = [engine.translate_n_best(SENTENCES, n_best=1, beam_size=1) for engine in (torch_translator, ct2_translator)]
    for on_torch, on_ct2 in zip(*greedy):
        assert [t.text for t in on_ct2] == [t.text for t in on_torch]
        assert [t.tokens for t in on_ct2] == [t.tokens for t in on_torch]
        assert [t.score for t in on_ct2] == pytest.approx([t.score for t in on_torch], abs=1e-4)
    # Beam search: both rank by log-prob / length^α and stop a sentence once K hypotheses have ended,
    # so the lists are the same; the first of a list is what `translate` gives.
    for alpha in (1.0, 2.0):
        for translator in (torch_translator, ct2_translator):
            translator.set_decoding(length_penalty=alpha)
        beams = [engine.translate_n_best(SENTENCES, n_best=3, beam_size=3) for engine in (torch_translator, ct2_translator)]
        assert [results[0].text for results in beams[1]] == ct2_translator.translate(SENTENCES, beam_size=3)
        for on_torch, on_ct2 in zip(*beams):
            assert [t.text for t in on_ct2] == [t.text for t in on_torch]
            assert [t.score for t in on_ct2] == pytest.approx([t.score for t in on_torch], abs=1e-4)


def test_sampling_on_ctranslate2_draws_n_scored_samples_repeatably(pre_norm_run: Path):
    _, ct2_translator = engines(pre_norm_run)
    sampling = Sampling(temperature=1.5, top_k=0, top_p=1.0, seed=7)
    drawn = ct2_translator.translate_n_best(SENTENCES[:4], n_best=3, sampling=sampling)
    assert [len(samples) for samples in drawn] == [3] * 4
    assert drawn == ct2_translator.translate_n_best(SENTENCES[:4], n_best=3, sampling=sampling)  # same seed
    assert drawn != ct2_translator.translate_n_best(SENTENCES[:4], n_best=3,
                                                    sampling=Sampling(temperature=1.5, seed=8))
    assert all(sample.score < 0 for samples in drawn for sample in samples)


DEMO_TEST = (Path(__file__).parents[2] / "transformer_mt" / "corpora" / "demo_en_it" / "test.en").read_text(
    encoding="utf-8").splitlines()


@pytest.mark.parametrize("beam", [1, 4])
def test_a_prefix_gives_the_same_translations_on_both_engines_scored_as_score_scores_them(pre_norm_run: Path,
                                                                                          beam: int):
    from transformer_mt.decode.hypotheses import length_caps, length_penalty

    torch_translator, ct2_translator = engines(pre_norm_run)
    tokenizers, decode = torch_translator.tokenizers, torch_translator.cfg.decode
    src_ids = tokenizers.encode_src(DEMO_TEST)
    caps = length_caps([len(ids) + 1 for ids in src_ids], decode.max_len_a, decode.max_len_b, torch_translator.max_len)
    for prefix in ("La", "Mio fratello"):
        prefixes = [prefix] * len(DEMO_TEST)
        translations = torch_translator.translate(DEMO_TEST, beam_size=beam, prefixes=prefixes)
        assert ct2_translator.translate(DEMO_TEST, beam_size=beam, prefixes=prefixes) == translations
        assert translations != torch_translator.translate(DEMO_TEST, beam_size=beam)
        pieces = tokenizers.tgt_pieces(tokenizers.encode_tgt([prefix])[0])
        for translator in (torch_translator, ct2_translator):
            results = translator.translate_n_best(DEMO_TEST, n_best=2 if beam > 1 else 1, beam_size=beam,
                                                  prefixes=prefixes)
            assert [best.text for best, *_ in results] == translations
            hyps = [(i, t) for i, sentence in enumerate(results) for t in sentence]
            assert all(t.tokens[:len(pieces)] == pieces for _, t in hyps)
            tgt_ids = [[tokenizers.tgt.token_to_id(piece) for piece in t.tokens] for _, t in hyps]
            forced = torch_translator.engine.score([src_ids[i] for i, _ in hyps], tgt_ids, decode, False)
            for (i, t), ids, log_probs in zip(hyps, tgt_ids, forced):
                ended = len(ids) < caps[i]  # else cut at the cap: no EOS scored
                log_prob = sum(log_probs if ended else log_probs[:-1])
                assert t.score == pytest.approx(log_prob / length_penalty(len(ids) + ended, decode.length_penalty),
                                                abs=1e-4)


def test_samples_begin_with_their_prefix_on_both_engines(pre_norm_run: Path):
    sampling = Sampling(temperature=1.5, seed=3)
    tokenizers = Translator.from_run(pre_norm_run, device="cpu", engine="torch").tokenizers
    prefixes = ["Mio fratello", "", "La"]
    for translator in engines(pre_norm_run):
        drawn = translator.translate_n_best(SENTENCES[:3], n_best=3, sampling=sampling, prefixes=prefixes)
        for prefix, samples in zip(prefixes, drawn):
            pieces = tokenizers.tgt_pieces(tokenizers.encode_tgt([prefix])[0])
            assert len(samples) == 3 and all(sample.tokens[:len(pieces)] == pieces for sample in samples)


def copy_run(run: Path, to: Path) -> Path:
    """A copy of `run`'s config, tokenizers and best checkpoint (no conversion yet)."""
    (to / "checkpoints").mkdir(parents=True)
    for name in ("tokenizer.json", "config.yaml", ".tmt-run"):
        if (run / name).exists():
            (to / name).write_bytes((run / name).read_bytes())
    (to / "checkpoints" / "best.pt").write_bytes((run / "checkpoints" / "best.pt").read_bytes())
    return to


def conversions(run: Path) -> list[Path]:
    return sorted(path for path in (run / "ctranslate2").iterdir() if path.is_dir())


def test_the_conversion_is_made_once_per_checkpoint_and_a_new_checkpoint_gets_its_own(pre_norm_run: Path,
                                                                                        tmp_path: Path, monkeypatch):
    run = copy_run(pre_norm_run, tmp_path / "run")
    first = Translator.from_run(run, device="cpu").translate(SENTENCES[:3])
    [converted] = conversions(run)
    monkeypatch.setattr(ct2_conversion, "ctranslate2_spec", lambda *args: pytest.fail("converted again"))
    monkeypatch.setattr(Translator, "_on_torch", lambda *args: pytest.fail("torch loaded the checkpoint"))
    assert Translator.from_run(run, device="cpu").translate(SENTENCES[:3]) == first
    monkeypatch.undo()

    # Other weights in the same file name: a new digest, a new conversion with the new weights.
    state = load_checkpoint(run / "checkpoints" / "best.pt")
    with torch.no_grad():
        for tensor in state["ema"]["model"].values():
            tensor.mul_(-1.0)
    save_atomic(state, run / "checkpoints" / "best.pt")
    changed = Translator.from_run(run, device="cpu")
    assert changed.engine.model_dir != converted and len(conversions(run)) == 2
    assert changed.translate(SENTENCES[:3]) == Translator.from_run(run, device="cpu", engine="torch").translate(
        SENTENCES[:3])


def test_a_half_written_or_incomplete_conversion_is_never_used(pre_norm_run: Path, tmp_path: Path):
    run = copy_run(pre_norm_run, tmp_path / "run")
    expected = Translator.from_run(run, device="cpu", engine="torch").translate(SENTENCES)
    converted = Translator.from_run(run, device="cpu").engine.model_dir
    # A conversion cut short: the folder renamed into place without its last file, and a temp
    # folder of a killed writer beside it with a broken model.
    (converted / "tmt.json").unlink()
    (converted / "model.bin").write_bytes(b"")
    (run / "ctranslate2" / f".{converted.name}.0badc0de.tmp").mkdir()
    translator = Translator.from_run(run, device="cpu")
    assert translator.engine.model_dir == converted and (converted / "tmt.json").is_file()
    assert translator.translate(SENTENCES) == expected
    # A remembered digest of a file that has changed since (its mtime) is computed again, never trusted.
    digests = run / "ctranslate2" / "digests.json"
    digests.write_text(digests.read_text().replace(converted.name.split("-")[0], "0" * 32))
    os.utime(run / "checkpoints" / "best.pt", ns=(1, 1))
    assert Translator.from_run(run, device="cpu").engine.model_dir == converted
    assert converted.name.split("-")[0] in digests.read_text()


def tmt_translate_in_python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`tmt translate ARGS` in a fresh interpreter that fails unless torch stayed unimported."""
    code = ("import sys; from transformer_mt.cli.main import main; rc = main(['translate', *sys.argv[1:]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"})


def test_translating_with_a_cached_conversion_never_imports_torch(pre_norm_run: Path, tmp_path: Path):
    runs = tmp_path / "runs"
    run = copy_run(pre_norm_run, runs / "tiny")
    sentences = ["Good morning.", "Where is the station?"]
    expected = Translator.from_run(run, device="cpu", engine="torch").translate(sentences, beam_size=3)
    first = tmt_translate_in_python(["--beam", "3", *sentences], tmp_path)  # converts: torch loads the checkpoint
    assert "torch was imported" in first.stderr and first.stdout.splitlines() == expected
    done = tmt_translate_in_python(["--beam", "3", *sentences], tmp_path)
    assert done.returncode == 0 and done.stdout.splitlines() == expected, done.stderr
    assert done.stderr == ("tmt: using runs/tiny (en->it, best.pt), the most recently updated run under runs/; "
                           "choose another with --run DIR (`tmt runs` lists them)\n")
    many = [f"Sentence {i}." for i in range(100)]
    done = tmt_translate_in_python(["--run", str(run), "--quantize", "int8", *many], tmp_path)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == len(many), done.stderr
    # The torch engine, asked for, imports it.
    assert "torch was imported" in tmt_translate_in_python(["--engine", "torch", "Good morning."], tmp_path).stderr


def test_translating_with_a_run_still_training_says_so_and_at_which_step(pre_norm_run: Path, tmp_path: Path):
    # A run still training will have a better model: say so, on CTranslate2's cached path too (no torch).
    from transformer_mt.runs.run_dir import RunLock

    run = copy_run(pre_norm_run, tmp_path / "runs" / "tiny")
    finished = json.loads((pre_norm_run / "summary.json").read_text())
    assert finished["status"] == "finished" and finished["best_step"] == 40
    (run / "summary.json").write_text(json.dumps({**finished, "status": "running", "step": 60, "max_steps": 100,
                                                  "pid": os.getpid()}))  # as this process's own training
    tmt_translate_in_python(["Good morning."], tmp_path)  # converts the checkpoint (with torch)
    training = "runs/tiny (en->it, best.pt of step 40; still training, at step 60 of 100)"
    done = tmt_translate_in_python(["Good morning."], tmp_path)
    assert done.returncode == 0 and done.stderr == (f"tmt: using {training}, the most recently updated run under "
                                                    "runs/; choose another with --run DIR (`tmt runs` lists them)\n")
    done = tmt_translate_in_python(["--run", "runs/tiny", "Good morning."], tmp_path)
    assert done.returncode == 0 and done.stderr == f"tmt: using {training}\n"

    # A resume holding the lock while it prepares its data trains too, whatever the old summary says.
    (run / "summary.json").write_text(json.dumps({**finished, "status": "stopped early", "pid": 2 ** 22 + 12345}))
    with RunLock.acquire(run, "tmt train --resume"):
        done = tmt_translate_in_python(["--run", "runs/tiny", "Good morning."], tmp_path)
    assert done.returncode == 0 and done.stderr == ("tmt: using runs/tiny (en->it, best.pt of step 40; still "
                                                    "training, at step 40 of 40)\n"), done.stderr
    # Finished (its lock free, its writer gone): the run is named as before, and only when it was not given.
    for summary in (finished, {**finished, "status": "running", "pid": 2 ** 22 + 12345}):
        (run / "summary.json").write_text(json.dumps(summary))
        done = tmt_translate_in_python(["--run", "runs/tiny", "Good morning."], tmp_path)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        done = tmt_translate_in_python(["Good morning."], tmp_path)
        assert done.returncode == 0 and done.stderr.startswith("tmt: using runs/tiny (en->it, best.pt), the most")


@pytest.mark.parametrize("damage", ["truncated", "other tokenizers", "missing"])
def test_a_bad_checkpoint_gives_the_same_one_line_error_on_both_engines(damage: str, pre_norm_run: Path,
                                                                        tmp_path: Path, monkeypatch, capsys):
    run = copy_run(pre_norm_run, tmp_path / "run")
    Translator.from_run(run, device="cpu").translate(["Good morning."])  # a conversion of the good file, cached
    checkpoint = run / "checkpoints" / "best.pt"
    original = checkpoint.read_bytes()
    if damage == "truncated":
        checkpoint.write_bytes(original[: len(original) // 2])
    elif damage == "other tokenizers":
        state = load_checkpoint(checkpoint)
        save_atomic({**state, "tokenizers": "0" * 32}, checkpoint)
        with pytest.raises(CheckpointError, match="other tokenizers"):
            Translator.from_run(run, device="cpu")
    else:
        checkpoint.unlink()
    errors = []
    for engine in ("ctranslate2", "torch"):
        code, out, err = run_cli(["translate", "--run", str(run), "--engine", engine, "Good morning."],
                                 monkeypatch, capsys, tmp_path)
        assert code == 1 and out == "" and err.startswith("tmt: error: ") and len(err.splitlines()) == 1, err
        errors.append(err)
    assert errors[0] == errors[1]


def test_quantize_int8_decodes_on_ctranslate2_and_names_evaluates_output(pre_norm_run: Path, tmp_path: Path,
                                                                        monkeypatch, capsys):
    run = copy_run(pre_norm_run, tmp_path / "run")
    write_corpus(run.parent / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    code, _, err = run_cli(["evaluate", "--run", str(run), "--quiet", "--quantize", "int8", "--src",
                            str(run.parent / "corpus" / "test.en"), "--ref", str(run.parent / "corpus" / "test.it")],
                           monkeypatch, capsys, tmp_path)
    assert code == 0 and "beam 1, int8 weights;" in err, err
    assert list((run / "evaluation").glob("file-test.en-*.best.beam1.int8.txt"))  # never the fp32 hypotheses' file
    translator = Translator.from_run(run, device="cpu")
    translator.set_decoding(quantize="int8")
    assert len(translator.translate(SENTENCES)) == len(SENTENCES) and set(translator.engine._translators) == {"int8"}
    code, _, err = run_cli(["translate", "--run", str(run), "--engine", "torch", "--quantize", "int8", "Hi."],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and err.startswith("tmt: error: decode.quantize: int8 decodes on the ctranslate2 engine")
    assert len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as exit_:
        run_cli(["translate", "--run", str(run), "--quantize", "int4", "hello"], monkeypatch, capsys, tmp_path)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --quantize: invalid choice: 'int4'" in err and "Traceback" not in err


def test_quantize_on_a_gpu_warns_that_it_decodes_unquantised(pre_norm_run: Path, caplog):
    translator = Translator.from_run(pre_norm_run, device="cpu", engine="torch")
    translator.engine.device = "cuda"  # only its name is read: no GPU needed
    with caplog.at_level(logging.WARNING, logger="transformer_mt.decode.translator"):
        translator.set_decoding(quantize="int8")
    assert "decode.quantize: int8 applies to CPU decoding only; decoding on cuda unquantised" in caplog.text
    assert translator.quantized is None


def test_show_attention_draws_from_torch_and_says_so_for_ctranslate2(pre_norm_run: Path, tmp_path: Path,
                                                                     monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    picture = tmp_path / "a.png"
    code, out, err = run_cli(["translate", "--run", str(pre_norm_run), "--device", "cpu", "--show-attention",
                              str(picture), "Good morning."], monkeypatch, capsys, tmp_path)
    assert code == 0 and picture.is_file(), err
    assert out.splitlines() == Translator.from_run(pre_norm_run, device="cpu").translate(["Good morning."])
    code, _, err = run_cli(["translate", "--run", str(pre_norm_run), "--engine", "ctranslate2", "--show-attention",
                            str(tmp_path / "b.png"), "Good morning."], monkeypatch, capsys, tmp_path)
    assert code == 2 and err == ("tmt: error: --show-attention draws from the torch engine's model; leave out "
                                 "--engine ctranslate2\n")


def test_the_engine_setting_is_a_config_key_and_an_option(pre_norm_run: Path, tmp_path: Path, monkeypatch, capsys):
    with pytest.raises(Exception, match="decode.engine"):
        tiny_config(tmp_path, decode={"engine": "numpy"})
    assert tiny_config(tmp_path, decode={"engine": "torch"}).decode.engine == "torch"
    with pytest.raises(SystemExit):
        run_cli(["translate", "--run", str(pre_norm_run), "--engine", "numpy", "hello"], monkeypatch, capsys, tmp_path)
    assert "argument --engine: invalid choice: 'numpy'" in capsys.readouterr().err


@pytest.mark.parametrize("setting, threads", [("1", 1), ("3", 3), ("", 2), ("many", 2)])
def test_ctranslate2_decodes_on_omp_num_threads_threads(pre_norm_run: Path, monkeypatch, setting: str, threads: int):
    # fp32: one worker of every thread; int8 weights: one worker of one thread each, but a seeded
    # sampler one worker of them all.
    import ctranslate2

    made = []
    monkeypatch.setattr(ctranslate2, "Translator",
                        lambda *args, **options: made.append((options["inter_threads"], options["intra_threads"])))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # two cores: the default
    monkeypatch.setenv("OMP_NUM_THREADS", setting)
    translator = Translator.from_run(pre_norm_run, engine="ctranslate2")
    translator.engine._translator(translator.cfg.decode)
    translator.set_decoding(quantize="int8")
    translator.engine._translator(translator.cfg.decode)
    translator.engine._translator(translator.cfg.decode, seed=1)
    assert made == [(1, threads), (threads, 1), (1, threads)]


def test_loading_a_ctranslate2_translator_leaves_torchs_threads_as_they_were(pre_norm_run: Path):
    # CTranslate2 sets the loading thread's OpenMP threads to its workers' (one here); torch shares them.
    translator = Translator.from_run(pre_norm_run, engine="ctranslate2")
    translator.engine.threads = 3
    translator.set_decoding(quantize="int8")
    torch.set_num_threads(2)  # the autouse fixture puts back one thread
    translator.translate(["Good"], beam_size=1)
    assert torch.get_num_threads() == 2


def test_a_call_cut_across_workers_translates_as_one_worker_does(pre_norm_run: Path, monkeypatch):
    # int8 weights on three workers: each call is cut into batches decoded side by side, within the
    # token budget.
    import ctranslate2

    calls = []
    translate_batch = ctranslate2.Translator.translate_batch

    def recording(self, source, *args, **options):
        calls.append((len(source), options["max_batch_size"], self.num_translators))
        return translate_batch(self, source, *args, **options)

    monkeypatch.setattr(ctranslate2.Translator, "translate_batch", recording)
    one, three = (Translator.from_run(pre_norm_run, engine="ctranslate2") for _ in range(2))
    one.engine.threads, three.engine.threads = 1, 3
    for translator in (one, three):
        translator.set_decoding(quantize="int8")
    for beam_size in (1, 4):
        assert three.translate(SENTENCES, beam_size=beam_size) == one.translate(SENTENCES, beam_size=beam_size)
    n_best = [[t for hyps in translator.translate_n_best(SENTENCES, n_best=3, beam_size=4) for t in hyps]
              for translator in (one, three)]
    assert [t.text for t in n_best[1]] == [t.text for t in n_best[0]]
    assert [t.score for t in n_best[1]] == pytest.approx([t.score for t in n_best[0]], abs=1e-4)
    cut = [(n, size) for n, size, workers in calls if workers == 3]
    assert cut and all(size < n * 64 for n, size in cut if n >= 3)  # smaller batches than the whole call
    for translator in (one, three):
        translator.set_decoding(batch_tokens=64)  # the budget caps the batches: 64 // 4 rows
    assert three.translate(SENTENCES, beam_size=4) == one.translate(SENTENCES, beam_size=4)
    assert calls[-1][1] <= 16
