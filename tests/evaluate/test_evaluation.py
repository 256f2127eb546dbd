"""Scoring: sacreBLEU BLEU/chrF with signatures; tokenized BLEU on tokenized text stays quiet;
`tmt evaluate --run` scores the run's own split as the run read it."""

import json
import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.helpers import TINY_PAIRS, run_cli, train_tiny_run, write_corpus
from transformer_mt.core.run_layout import RunDir
from transformer_mt.evaluate.metrics import score
from transformer_mt.decode.plotting import cross_attention_labels

# Lowercased, tokenized text as in Multi30k's tok/ files: every line ends in " ." (sacreBLEU
# warns about that from 100 such lines on, unless told the text is tokenized on purpose).
REFERENCES = [f"ein mann mit {n} hunden steht auf der straße ." for n in range(120)]
HYPOTHESES = [f"ein mann mit {n} hunden geht auf der straße ." for n in range(120)]


def test_tokenized_bleu_does_not_warn_and_scores_like_plain_sacrebleu(caplog, capsys):
    import sacrebleu

    with caplog.at_level(logging.WARNING):
        scores = score(HYPOTHESES, REFERENCES, tokenize="none")
    assert "detokenize" not in caplog.text + "".join(capsys.readouterr())
    plain = sacrebleu.metrics.BLEU(tokenize="none")
    assert scores.bleu == plain.corpus_score(HYPOTHESES, [REFERENCES]).score
    assert scores.bleu_signature == str(plain.get_signature()) and "tok:none" in scores.bleu_signature
    assert 0 < scores.bleu < 100 and 0 < scores.chrf < 100


def test_raw_text_is_scored_with_13a_by_default():
    scores = score(["Ciao, mondo!"], ["Ciao, mondo!"])
    assert round(scores.bleu, 6) == 100 and "tok:13a" in scores.bleu_signature


def sacrebleu_cli(tmp_path: Path, hypotheses: list[str], *references: list[str], args: tuple = ()) -> list[dict]:
    """What the `sacrebleu` command prints as JSON for these files (4 decimals)."""
    files = []
    for name, lines in [("hyp", hypotheses)] + [(f"ref{i}", ref) for i, ref in enumerate(references)]:
        (tmp_path / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        files.append(str(tmp_path / name))
    result = subprocess.run([sys.executable, "-m", "sacrebleu", *files[1:], "-i", files[0], "-f", "json", "-w", "4",
                             *args], capture_output=True, text=True, check=True,
                            env={**os.environ, "SACREBLEU_SEED": "12345"})
    parsed = json.loads(result.stdout)
    return parsed if isinstance(parsed, list) else [parsed]


def test_confidence_intervals_are_sacrebleus_bootstrap_for_the_same_seed(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SACREBLEU_SEED", "12345")
    # Sentences of differing quality, so that resamples differ: some cut short, some with a word replaced.
    hypotheses = [" ".join(h.replace("geht", "läuft" if n % 3 else "geht").split()[: 9 - n % 5])
                  for n, h in enumerate(HYPOTHESES[:40])]
    ours = score(hypotheses, REFERENCES[:40], n_bootstrap=200)
    plain = sacrebleu_cli(tmp_path, hypotheses, REFERENCES[:40], args=("-m", "bleu", "chrf", "ter", "--confidence",
                                                                          "--confidence-n", "200"))
    plus = sacrebleu_cli(tmp_path, hypotheses, REFERENCES[:40], args=("-m", "chrf", "--chrf-word-order", "2",
                                                                         "--confidence", "--confidence-n", "200"))
    for name, expected in zip(["bleu", "chrf", "ter", "chrf++"], plain + plus):
        result = ours[name]
        assert result.value == pytest.approx(expected["score"], abs=1e-4), name
        assert result.mean == pytest.approx(expected["confidence_mean"], abs=1e-4), name
        assert result.ci == pytest.approx(expected["confidence_var"], abs=1e-4), name
        assert result.signature == expected["signature"]
        assert result.interval[0] < result.mean < result.interval[1], name
    assert ours.report()["bleu_ci95"] == [round(ours["bleu"].mean - ours["bleu"].ci, 2),
                                          round(ours["bleu"].mean + ours["bleu"].ci, 2)]


def test_several_references_are_scored_as_sacrebleu_scores_them(tmp_path: Path):
    others = [r.replace("steht", "ist") for r in REFERENCES[:30]]
    hypotheses = [h.replace("geht", "ist") for h in HYPOTHESES[:30]]
    ours = score(hypotheses, [REFERENCES[:30], others])
    expected = sacrebleu_cli(tmp_path, hypotheses, REFERENCES[:30], others, args=("-m", "bleu", "chrf", "ter"))
    assert [ours[name].value for name in ("bleu", "chrf", "ter")] == pytest.approx(
        [e["score"] for e in expected], abs=1e-4)
    assert "nrefs:2" in ours.bleu_signature and ours.bleu > score(hypotheses, REFERENCES[:30]).bleu


def test_an_interval_is_shown_as_its_two_bounds_even_below_zero():
    from transformer_mt.evaluate.metrics import MetricScore

    near_zero = MetricScore(1.78, "sig", mean=1.71, ci=1.72)  # sacreBLEU's mean ± half-width can dip below 0
    assert near_zero.shown("bleu") == "BLEU = 1.78 (95% CI [-0.01, 3.43])"
    assert MetricScore(31.2, "sig").shown("chrf++") == "chrF++ = 31.20"


def test_evaluate_prints_four_metrics_with_intervals_and_takes_several_references(workdir: Path, tmt_here):
    (workdir / "s.en").write_text("Good morning.\nThe city is beautiful.\n", encoding="utf-8")
    (workdir / "r1.it").write_text("Buongiorno.\nLa città è bella.\n", encoding="utf-8")
    (workdir / "r2.it").write_text("Buon giorno.\nÈ bella la città.\n", encoding="utf-8")
    result = tmt_here("evaluate", "--run", "runs/tiny", "--src", "s.en", "--ref", "r1.it", "r2.it", "--bootstrap", "50",
                      "--quiet", cwd=workdir)
    assert result.returncode == 0, result.stderr
    lines, diagnostics = result.stdout.split("\n\n")
    lines = lines.splitlines()
    assert [line.split(" = ")[0] for line in lines] == ["BLEU", "chrF", "chrF++", "TER"]
    assert diagnostics.startswith("diagnostics of 2 translations") and "repeated n-gram loops" in diagnostics
    assert "chrF by source length: 1-5 words" in diagnostics
    assert all("(95% CI " in line and "nrefs:2|bs:50|seed:12345" in line for line in lines), lines
    (workdir / "r3.it").write_text("Buongiorno.\n", encoding="utf-8")
    bad = tmt_here("evaluate", "--run", "runs/tiny", "--src", "s.en", "--ref", "r1.it", "r3.it", cwd=workdir)
    assert bad.returncode == 1 and bad.stderr.strip() == ("tmt: error: s.en has 2 lines but r3.it has 1; each --ref "
                                                          "needs one line per source sentence")
    plain = tmt_here("evaluate", "--run", "runs/tiny", "--src", "s.en", "--ref", "r1.it", "--bootstrap", "0", "--quiet",
                     "--no-diagnostics", cwd=workdir)
    assert plain.returncode == 0 and "CI" not in plain.stdout and "nrefs:1|case" in plain.stdout
    assert len(plain.stdout.splitlines()) == 4  # the scores alone


def test_attention_labels_match_the_rows_and_columns_of_the_map():
    eos = "</s>"
    assert cross_attention_labels(["a", "b"], ["x", "y"], eos, max_len=8) == (["a", "b", eos], ["x", "y", eos])
    # A hypothesis that filled all max_len positions (no EOS generated): every piece, no EOS row.
    src, hyp = list("abcdefghij"), list("qrstuvwx")
    assert cross_attention_labels(src, hyp, eos, max_len=8) == (list("abcdefg") + [eos], hyp)
    assert cross_attention_labels(src, hyp[:7], eos, max_len=8)[1] == hyp[:7] + [eos]


# --- the run's own split: its corpus_cache/, whatever happened to the data files since ---------

@pytest.fixture
def tiny_run(tmp_path: Path) -> Path:
    """A tiny trained run of its own (the tests move or edit its data), over tmp_path/corpus."""
    return train_tiny_run(tmp_path, tmp_path / "run", max_steps=2, eval_every_steps=2, save_every_steps=2)


def run_files(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Bytes and modification time of every file of the run but evaluate's own output."""
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.parent.name != "evaluation"}


def evaluate_test_split(run_dir: Path, monkeypatch, capsys) -> tuple[int, str, str, str]:
    """`tmt evaluate --run RUN`: exit code, stdout (the scores), stderr, and the hypotheses written."""
    code, out, err = run_cli(["evaluate", "--run", str(run_dir), "--quiet"], monkeypatch, capsys, run_dir.parent)
    hypotheses = run_dir / "evaluation" / "test.best.beam1.txt"
    return code, out, err, hypotheses.read_text("utf-8") if code == 0 else ""


def test_evaluate_scores_the_runs_copy_of_a_corpus_that_was_moved(tiny_run: Path, monkeypatch, capsys):
    code, scores, err, hypotheses = evaluate_test_split(tiny_run, monkeypatch, capsys)
    assert code == 0 and "warning" not in err, err  # the data is where the run read it: nothing to say
    before = run_files(tiny_run)
    corpus = tiny_run.parent / "corpus"
    corpus.rename(tiny_run.parent / "moved")

    code, moved_scores, err, moved_hypotheses = evaluate_test_split(tiny_run, monkeypatch, capsys)
    assert code == 0, err
    assert (moved_scores, moved_hypotheses) == (scores, hypotheses)
    assert f"tmt: warning: data.path {str(corpus)!r} of the run's config ({tiny_run / 'config.yaml'})" in err
    assert f"own copy of its data in {tiny_run / 'corpus_cache'} is scored" in err
    assert run_files(tiny_run) == before


def test_evaluate_scores_the_split_the_run_read_not_the_edited_files(tiny_run: Path, monkeypatch, capsys):
    code, scores, err, hypotheses = evaluate_test_split(tiny_run, monkeypatch, capsys)
    assert code == 0, err
    before = run_files(tiny_run)
    # Three other test pairs: rebuilding the corpus would score 3 sentences, not the run's 2.
    write_corpus(tiny_run.parent / "corpus", {"test": TINY_PAIRS[6:9]})

    code, edited_scores, err, edited_hypotheses = evaluate_test_split(tiny_run, monkeypatch, capsys)
    assert code == 0, err
    assert (edited_scores, edited_hypotheses) == (scores, hypotheses) and len(hypotheses.splitlines()) == 2
    assert "tmt: warning: the data files of data.path" in err and "may have changed since the run read them" in err
    assert "--src FILE --ref FILE" in err
    assert run_files(tiny_run) == before  # corpus_cache/ neither rebuilt nor touched


def test_evaluate_without_corpus_cache_or_data_names_the_runs_config_and_src_ref(tiny_run: Path, monkeypatch,
                                                                                 capsys):
    shutil.rmtree(tiny_run / "corpus_cache")
    shutil.rmtree(tiny_run.parent / "corpus")
    code, out, err = run_cli(["evaluate", "--run", str(tiny_run), "--quiet"], monkeypatch, capsys, tiny_run.parent)
    assert code == 1 and out == "", err
    assert "is not a directory" in err and str(tiny_run / "config.yaml") in err and "--src FILE --ref FILE" in err
    assert "Traceback" not in err and not (tiny_run / "corpus_cache").exists()


def test_a_length_penalty_option_reaches_beam_search_and_names_evaluates_output(tiny_run: Path, monkeypatch,
                                                                                capsys):
    from transformer_mt.decode.ct2_engine import CT2Engine
    from transformer_mt.decode.torch_engine import TorchEngine

    seen = []  # (beam size, length penalty) of each call into decoding, on either engine
    for engine in (CT2Engine, TorchEngine):
        def recording(self, src_ids, decode_cfg, beam_size, progress, prefixes=None, real=engine.translate):
            seen.append((beam_size, decode_cfg.length_penalty))
            return real(self, src_ids, decode_cfg, beam_size, progress, prefixes)

        monkeypatch.setattr(engine, "translate", recording)
    code, _, err = run_cli(["evaluate", "--run", str(tiny_run), "--quiet", "--beam", "3", "--length-penalty", "1.5"],
                           monkeypatch, capsys, tiny_run.parent)
    assert code == 0, err
    assert seen == [(3, 1.5)] and "beam 3, length penalty 1.5;" in err
    assert (tiny_run / "evaluation" / "test.best.beam3.lp1.5.txt").is_file()  # not the run's own beam3 file
    code, _, err = run_cli(["evaluate", "--run", str(tiny_run), "--quiet", "--length-penalty", "1.5"],
                           monkeypatch, capsys, tiny_run.parent)  # greedy (the run's beam 1): no penalty to name
    assert code == 0 and seen[-1] == (1, 1.5) and "beam 1;" in err, err
    assert not list((tiny_run / "evaluation").glob("*beam1.lp*"))
    code, _, err = run_cli(["translate", "--run", str(tiny_run), "--engine", "torch", "--beam", "2",
                            "--length-penalty", "0", "hello"], monkeypatch, capsys, tiny_run.parent)
    assert code == 0 and seen[-1] == (2, 0.0), err
    code, _, err = run_cli(["translate", "--run", str(tiny_run), "--engine", "torch", "hello"], monkeypatch, capsys,
                           tiny_run.parent)
    assert code == 0 and seen[-1][1] == 1.0, err  # the run's decode.length_penalty
    for bad in ("-1", "nan", "x"):
        with pytest.raises(SystemExit) as exit_:  # argparse's usage error
            run_cli(["translate", "--run", str(tiny_run), "--length-penalty", bad, "hello"], monkeypatch, capsys,
                    tiny_run.parent)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "argument --length-penalty:" in err and "Traceback" not in err, err


# --- COMET (the optional extra): what is missing is said in one line ----------------------------

def test_comet_without_its_package_says_how_to_install_it(workdir: Path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "comet", None)  # as when unbabel-comet is not installed
    code, out, err = run_cli(["evaluate", "--run", "runs/tiny", "--comet", "Unbabel/wmt22-comet-da"], monkeypatch,
                             capsys, workdir)
    assert code == 2 and out == ""
    assert err.strip() == ("tmt: error: --comet needs the unbabel-comet package, which is not installed: "
                           "pip install 'transformer-mt[comet]'")


def test_train_valid_comet_without_its_package_stops_before_the_data_is_prepared(workdir: Path, monkeypatch,
                                                                                   capsys):
    monkeypatch.setitem(sys.modules, "comet", None)
    code, out, err = run_cli(["train", "--config", "tiny.yaml", "--run-dir", "runs/comet",
                              "--set", "train.valid_comet=Unbabel/wmt22-comet-da"], monkeypatch, capsys, workdir)
    assert code == 2 and err.strip().splitlines()[-1] == (
        "tmt: error: train.valid_comet needs the unbabel-comet package, which is not installed: "
        "pip install 'transformer-mt[comet]'")
    assert not RunDir(workdir / "runs" / "comet").tokenizer_file(joint=True).exists()  # nothing prepared


class UnreachableHub(types.ModuleType):
    """The comet package's two entry points, with the Hub out of reach (as here: no network)."""

    def __init__(self):
        super().__init__("comet")
        self.loaded = []

    @staticmethod
    def download_model(name):
        raise ConnectionError(f"Cannot reach https://huggingface.co/{name}: offline")

    def load_from_checkpoint(self, path):
        self.loaded.append(path)
        raise RuntimeError("not a COMET checkpoint")


@pytest.mark.parametrize("model, message", [
    ("Unbabel/wmt22-comet-da", "--comet Unbabel/wmt22-comet-da: cannot get the model from the Hugging Face Hub "
                               "(ConnectionError: Cannot reach"),
    ("wmt22-comet-da", "--comet wmt22-comet-da: no such folder, and not a Hub model name"),
    ("empty_model", "--comet empty_model: no COMET checkpoint at empty_model/checkpoints/model.ckpt"),
])
def test_comet_without_its_model_names_what_is_missing(workdir: Path, monkeypatch, capsys, model: str, message: str):
    monkeypatch.setitem(sys.modules, "comet", UnreachableHub())
    (workdir / "empty_model").mkdir(exist_ok=True)
    code, out, err = run_cli(["evaluate", "--run", "runs/tiny", "--comet", model], monkeypatch, capsys, workdir)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_comet_checkpoint_that_does_not_load_is_named(tmp_path: Path, monkeypatch):
    from transformer_mt.core.errors import UsageError
    from transformer_mt.evaluate.comet import Comet

    fake = UnreachableHub()
    monkeypatch.setitem(sys.modules, "comet", fake)
    checkpoint = tmp_path / "model" / "checkpoints" / "model.ckpt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="cannot load .*model.ckpt \\(RuntimeError: not a COMET checkpoint\\)"):
        Comet.load(str(tmp_path / "model"))
    assert fake.loaded == [str(checkpoint)]


# --- one test-set evaluation: training's final test and `tmt evaluate` -------------------------

def test_a_test_set_is_translated_scored_against_every_reference_and_its_hypotheses_written(tmp_path: Path):
    from transformer_mt.evaluate.diagnostics import diagnose
    from transformer_mt.evaluate.test_set import evaluate_test_set

    sources = [src for src, _ in TINY_PAIRS[:4]]
    references = [[tgt for _, tgt in TINY_PAIRS[:4]], ["Buon giorno.", "Buona sera.", "Grazie.", "Dov'è?"]]
    translated = []

    def translate(lines: list[str]) -> list[str]:
        translated.append(list(lines))
        return [tgt if number % 2 else src for number, (src, tgt) in enumerate(zip(lines, references[0]))]

    class FakeComet:  # COMET's interface: sources, hypotheses, the first reference, a device
        def score(self, sources, hypotheses, references, *, device):
            self.seen = (sources, hypotheses, references, device)
            return types.SimpleNamespace(model="fake", score=0.5)

    comet = FakeComet()
    output = tmp_path / "new" / "hyps.txt"
    result = evaluate_test_set(translate, sources, references, output, tokenize="13a", n_bootstrap=20, src_lang="en",
                               comet=comet, device="cpu", diagnostics=True)
    hypotheses = translate(sources)
    assert translated[0] == sources and result.hypotheses == hypotheses and result.output == output
    assert output.read_text("utf-8") == "".join(h + "\n" for h in hypotheses)
    expected = score(hypotheses, references, tokenize="13a", n_bootstrap=20)
    assert result.scores.report() == expected.report() and "nrefs:2|bs:20" in result.scores.bleu_signature
    assert comet.seen == (sources, hypotheses, references[0], "cpu") and result.comet.score == 0.5
    assert result.diagnostics.lines() == diagnose(sources, hypotheses, references[0]).lines()
    assert result.seconds >= 0 and result.pairs == {}  # no target-language tags: no language pairs

    plain = evaluate_test_set(translate, sources, references[:1], output, tokenize="13a", n_bootstrap=1, src_lang="en")
    assert plain.comet is None and plain.diagnostics is None and "nrefs:1" in plain.scores.bleu_signature


def test_a_tagged_test_set_is_scored_per_language_pair_against_every_reference(tmp_path: Path):
    from transformer_mt.evaluate.test_set import evaluate_test_set

    tags = [">>ita<<", ">>fra<<", ">>ita<<", ">>ita<<"]
    sources = [f"{tag} {src}" for tag, (src, _) in zip(tags, TINY_PAIRS)]
    references = [[tgt for _, tgt in TINY_PAIRS[:4]], ["Buon giorno.", "Bonsoir.", "Grazie.", "Dov'è?"]]
    hypotheses = ["Buon giorno.", "Bonsoir.", TINY_PAIRS[2][1], "Ciao."]
    result = evaluate_test_set(lambda lines: hypotheses, sources, references, tmp_path / "hyps.txt", tokenize="13a",
                               n_bootstrap=1, src_lang="en")
    assert list(result.pairs) == ["en-fra", "en-ita"]
    for pair, rows in (("en-fra", [1]), ("en-ita", [0, 2, 3])):  # each pair's sentences against both references
        own = score([hypotheses[i] for i in rows], [[stream[i] for i in rows] for stream in references], "13a")
        assert result.pairs[pair] == {"sentences": len(rows), "bleu": round(own.bleu, 2), "chrf": round(own.chrf, 2)}
    assert result.pairs["en-fra"]["chrf"] == 100.0  # the second reference is its own


def test_a_test_set_whose_hypotheses_cannot_be_written_names_the_file_in_one_line(tmp_path: Path):
    from transformer_mt.core.errors import TmtError
    from transformer_mt.evaluate.test_set import evaluate_test_set

    (tmp_path / "file").write_text("kept\n", encoding="utf-8")
    with pytest.raises(TmtError, match=f"^{tmp_path / 'file' / 'hyps.txt'}: ") as raised:
        evaluate_test_set(lambda lines: lines, ["a"], [["a"]], tmp_path / "file" / "hyps.txt", tokenize="13a",
                          n_bootstrap=1, src_lang="en")
    assert "\n" not in str(raised.value) and (tmp_path / "file").read_text("utf-8") == "kept\n"
