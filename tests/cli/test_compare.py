"""`tmt compare`: sacreBLEU's paired tests against the first system (a clearly better system is
significant, a near copy is not), seed groups with mean ± sd, config differences, the sentences
each system wins, the three formats, and bad input in one line."""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import run_cli

WORDS = "il gatto nero dorme sul divano mentre la pioggia cade piano sulla città addormentata".split()


def sentences(seed: int, n: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))) for _ in range(n)]


def damaged(lines: list[str], seed: int, every: int) -> list[str]:
    """`lines` with a word of every `every`-th line replaced (seeded)."""
    rng = random.Random(seed)
    out = []
    for i, line in enumerate(lines):
        words = line.split()
        if i % every == 0:
            words[rng.randrange(len(words))] = "xyz"
        out.append(" ".join(words))
    return out


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """References, a weak system (every line damaged twice), a system as weak that differs from it
    by chance (a fourth of its lines damaged otherwise), a clearly better one (every fourth line damaged once)."""
    reference = sentences(0)
    weak = damaged(damaged(reference, 1, 1), 2, 1)
    other = damaged(damaged(reference, 11, 1), 12, 1)
    near = [other[i] if i % 4 == 0 else line for i, line in enumerate(weak)]
    systems = {"ref.txt": reference, "weak.txt": weak, "near.txt": near, "better.txt": damaged(reference, 3, 4)}
    paths = {}
    for name, lines in systems.items():
        paths[name] = tmp_path / name
        paths[name].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return paths


def compare(args: list[str], monkeypatch, capsys, cwd: Path) -> tuple[int, str, str]:
    return run_cli(["compare", *args], monkeypatch, capsys, cwd)


def test_a_clearly_better_system_is_significant_and_a_near_copy_is_not(files, tmp_path: Path, monkeypatch, capsys):
    code, out, err = compare([str(files["weak.txt"]), str(files["near.txt"]), str(files["better.txt"]),
                              str(files["weak.txt"]), "--ref", str(files["ref.txt"]), "--format", "json",
                              "--trials", "2000"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    report = json.loads(out)
    weak, near, better, same = report["systems"]
    assert "p_bootstrap" not in weak["scores"]["bleu"]  # the baseline
    for metric in ("bleu", "chrf", "chrf++", "ter"):
        assert not near["scores"][metric]["significant"], metric
        assert near["scores"][metric]["p_bootstrap"] > 0.05 and near["scores"][metric]["p_randomization"] > 0.05
        assert better["scores"][metric]["significant"], metric
        assert better["scores"][metric]["p_bootstrap"] < 0.01 and better["scores"][metric]["p_randomization"] < 0.01
        assert same["scores"][metric]["p_bootstrap"] == same["scores"][metric]["p_randomization"] == 1.0
        low, high = better["scores"][metric]["ci95"]
        assert low < better["scores"][metric]["score"] < high
    assert better["scores"]["bleu"]["score"] > weak["scores"]["bleu"]["score"]
    assert better["scores"]["ter"]["score"] < weak["scores"]["ter"]["score"]
    # The near copy's wins and losses are among the lines it changed, largest first.
    for side, sign in (("wins", 1), ("losses", -1)):
        segments = report["segments"][0][side]
        assert len(segments) == 3 and all((s["line"] - 1) % 4 == 0 and s["gain"] * sign > 0 for s in segments)
        assert [abs(s["gain"]) for s in segments] == sorted((abs(s["gain"]) for s in segments), reverse=True)
    assert report["test_set"] == {"sentences": 120, "references": 1, "tokenize": "13a"}


def test_p_values_and_intervals_are_sacrebleus_paired_tests(files, tmp_path: Path, monkeypatch, capsys):
    code, out, _ = compare([str(files["weak.txt"]), str(files["better.txt"]), "--ref", str(files["ref.txt"]),
                            "--format", "json", "--trials", "1000", "--bootstrap", "300"], monkeypatch, capsys,
                           tmp_path)
    ours = json.loads(out)["systems"][1]["scores"]["bleu"]
    env = {**os.environ, "SACREBLEU_SEED": "12345"}
    for test, key, extra in (("--paired-bs", "p_bootstrap", ["--paired-bs-n", "300"]),
                             ("--paired-ar", "p_randomization", ["--paired-ar-n", "1000"])):
        result = subprocess.run([sys.executable, "-m", "sacrebleu", str(files["ref.txt"]), "-i", str(files["weak.txt"]),
                                 str(files["better.txt"]), "-m", "bleu", test, *extra, "-f", "json"],
                                capture_output=True, text=True, check=True, env=env)
        expected = json.loads(result.stdout)[1]["BLEU"]
        assert ours[key] == pytest.approx(expected["p_value"], abs=1e-4)
        if test == "--paired-bs":
            low, high = ours["ci95"]
            assert (low + high) / 2 == pytest.approx(expected["mean"], abs=0.011)
            assert (high - low) / 2 == pytest.approx(expected["ci"], abs=0.011)


def test_runs_are_grouped_by_config_with_mean_and_sd_over_seeds(workdir: Path, monkeypatch, capsys):
    runs = workdir / "runs"
    shutil.copytree(runs / "tiny", runs / "tiny-s2", dirs_exist_ok=True)
    config = yaml.safe_load((runs / "tiny-s2" / "config.yaml").read_text(encoding="utf-8"))
    config["seed"] += 1
    (runs / "tiny-s2" / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    report = json.loads((runs / "tiny-s2" / "evaluation" / "test_scores.json").read_text(encoding="utf-8"))
    hypotheses = runs / "tiny-s2" / "evaluation" / report["hypotheses"]
    hypotheses.write_text("La città è bella.\nIl caffè è caldo.\n", encoding="utf-8")  # a better "seed"
    code, out, err = compare(["runs/tiny", "runs/tiny-s2", "--format", "json", "--trials", "200"], monkeypatch,
                             capsys, workdir)
    assert code == 0, err
    result = json.loads(out)
    assert result["seed_groups"] == [{"systems": ["runs/tiny", "runs/tiny-s2"], "seeds": [3, 4],
                                      "mean": result["seed_groups"][0]["mean"], "sd": result["seed_groups"][0]["sd"]}]
    bleu = [s["scores"]["bleu"]["score"] for s in result["systems"]]
    assert result["seed_groups"][0]["mean"]["bleu"] == pytest.approx(statistics.mean(bleu), abs=0.01)
    assert result["seed_groups"][0]["sd"]["bleu"] == pytest.approx(statistics.stdev(bleu), abs=0.01)
    assert result["systems"][1]["config_differences"] == {"seed": [3, 4]}
    code, text, _ = compare(["runs/tiny", "runs/tiny-s2", "--trials", "200"], monkeypatch, capsys, workdir)
    assert "seed group" in text and "config of runs/tiny-s2 against runs/tiny: seed: 3 -> 4" in text
    assert "where runs/tiny-s2 wins most over runs/tiny" in text
    code, markdown, _ = compare(["runs/tiny", "runs/tiny-s2", "--format", "markdown", "--trials", "200"],
                                monkeypatch, capsys, workdir)
    assert "| system | BLEU | chrF | chrF++ | TER |" in markdown and "| --- |" in markdown
    # A run given twice is compared with itself, but makes no seed group of one run counted twice
    code, out, err = compare(["runs/tiny", "runs/tiny-s2", str(workdir / "runs" / "tiny"), "--format", "json",
                              "--trials", "200"], monkeypatch, capsys, workdir)
    assert code == 0, err
    assert [group["systems"] for group in json.loads(out)["seed_groups"]] == [["runs/tiny", "runs/tiny-s2"],
                                                                             [str(workdir / "runs" / "tiny")]]


@pytest.mark.parametrize("args, message", [
    (["weak.txt"], "compare needs two systems or more"),
    (["weak.txt", "missing.txt", "--ref", "ref.txt"], "missing.txt: no such run directory or hypothesis file"),
    (["weak.txt", "better.txt"], "hypothesis files need their references: add --ref FILE"),
    (["weak.txt", "short.txt", "--ref", "ref.txt"], "short.txt has 3 translations but --ref"),
    (["weak.txt", "empty_dir", "--ref", "ref.txt"], "empty_dir: a directory but not a run"),
])
def test_bad_compare_input_gets_one_line(files, tmp_path: Path, monkeypatch, capsys, args, message):
    (tmp_path / "short.txt").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "empty_dir").mkdir()
    code, out, err = compare(args, monkeypatch, capsys, tmp_path)
    assert code != 0 and out == "" and message in err and len(err.strip().splitlines()) == 1, err


def test_a_run_without_a_final_test_or_of_another_test_set_is_named(workdir: Path, files, monkeypatch, capsys):
    runs = workdir / "runs"
    shutil.copytree(runs / "tiny", runs / "untested", dirs_exist_ok=True)
    (runs / "untested" / "evaluation" / "test_scores.json").unlink()
    code, _, err = compare(["runs/tiny", "runs/untested"], monkeypatch, capsys, workdir)
    assert code == 1 and "runs/untested: no final test to compare" in err and len(err.splitlines()) == 1
    code, _, err = compare(["runs/tiny", str(files["weak.txt"]), "--ref", str(files["ref.txt"])], monkeypatch,
                           capsys, workdir)
    assert code == 1 and "runs/tiny was tested on another test set than --ref" in err


def test_comet_in_compare_says_what_is_missing(files, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "comet", None)  # unbabel-comet not installed
    code, out, err = compare([str(files["weak.txt"]), str(files["better.txt"]), "--ref", str(files["ref.txt"]),
                              "--comet", "Unbabel/wmt22-comet-da"], monkeypatch, capsys, tmp_path)
    assert code == 2 and out == "" and err.strip() == ("tmt: error: --comet needs the unbabel-comet package, which "
                                                       "is not installed: pip install 'transformer-mt[comet]'")


def test_comet_in_compare_of_hypothesis_files_needs_their_sources(files, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "comet", type(sys)("comet"))  # the package's presence alone
    sys.modules["comet"].download_model = lambda name: str(tmp_path / "model.ckpt")
    (tmp_path / "model.ckpt").write_bytes(b"")
    args = [str(files["weak.txt"]), str(files["better.txt"]), "--ref", str(files["ref.txt"]), "--comet",
            str(tmp_path / "model.ckpt")]
    code, out, err = compare(args, monkeypatch, capsys, tmp_path)
    assert code == 2 and err.strip() == "tmt: error: --comet reads the sources too: add --src FILE (or compare runs, " \
                                        "whose test split has them)"
    code, out, err = compare(args + ["--src", str(files["weak.txt"]) + ".missing"], monkeypatch, capsys, tmp_path)
    assert code == 1 and "weak.txt.missing: cannot read" in err and len(err.strip().splitlines()) == 1


def test_compare_with_a_glossary_tests_term_accuracy_as_the_other_metrics(tmp_path: Path, monkeypatch, capsys):
    from tests.evaluate.test_terms import GLOSSARY, HYPOTHESES, REFERENCES, SOURCES

    files = {"src.en": SOURCES, "ref.it": REFERENCES, "misses.it": HYPOTHESES, "references.it": REFERENCES}
    for name, lines in files.items():
        (tmp_path / name).write_text("".join(line + "\n" for line in lines * 30), encoding="utf-8")
    (tmp_path / "terms.tsv").write_text(GLOSSARY, encoding="utf-8")
    args = ["misses.it", "references.it", "--ref", "ref.it", "--src", "src.en", "--glossary", "terms.tsv",
            "--bootstrap", "200", "--trials", "500"]
    code, out, err = compare([*args, "--format", "json"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    report = json.loads(out)
    misses, references = (system["scores"]["terms"] for system in report["systems"])
    assert misses["score"] == 71.43 and references["score"] == 85.71  # 5 and 6 of the 7 terms, by hand
    assert references["significant"] and references["p_bootstrap"] < 0.01 and "p_bootstrap" not in misses
    assert report["test_set"]["glossary"] == "terms.tsv" and "terms randomization" in report["signatures"]
    code, out, _ = compare(args, monkeypatch, capsys, tmp_path)
    header, first = out.splitlines()[2:4]
    assert header.split()[-2:] == ["Term", "accuracy"] and first.split()[-3] == "71.43"


@pytest.mark.parametrize("args, message", [
    (["--glossary", "terms.tsv"], "--glossary reads the sources too: add --src FILE (or compare runs, whose test "
                                  "split has them)"),
    (["--glossary", "terms.tsv", "--src", "src.en"], "--glossary terms.tsv: no source sentence of the test set "
                                                     "holds one of its terms"),
    (["--glossary", "bad.tsv", "--src", "src.en"], "glossary bad.tsv line 1: no tab; write source term<TAB>target term"),
])
def test_a_glossary_in_compare_without_sources_or_terms_gets_one_line(files, tmp_path: Path, monkeypatch, capsys,
                                                                       args, message):
    (tmp_path / "terms.tsv").write_text("train\ttreno\n", encoding="utf-8")
    (tmp_path / "bad.tsv").write_text("train treno\n", encoding="utf-8")
    (tmp_path / "src.en").write_text("".join(f"sentence {i}\n" for i in range(120)), encoding="utf-8")
    code, out, err = compare([str(files["weak.txt"]), str(files["better.txt"]), "--ref", str(files["ref.txt"]), *args],
                             monkeypatch, capsys, tmp_path)
    assert code != 0 and out == "" and err.strip() == f"tmt: error: {message}", err
