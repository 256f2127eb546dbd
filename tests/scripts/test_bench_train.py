"""The benchmark harness's scripts in benchmarks/: the GPU runbook's stages, the figure lines of a
training run (recipe_figures.py) and of the goals (goal_figures.py), and the synthetic corpus."""

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, run_cli, tiny_config
from transformer_mt.config.loading import save_config


BENCHMARKS = REPO / "benchmarks"


def test_a_training_stage_prints_its_figure_as_one_json_line(tiny_corpus: Path, tmp_path: Path, monkeypatch, capsys):
    cfg = tiny_config(tiny_corpus, train={"max_steps": 4, "log_every_steps": 2, "eval_every_steps": 4,
                                          "save_every_steps": 2, "average_last": 2, "ema_decay": 0.9})
    save_config(cfg, tmp_path / "tiny.yaml")
    code, _, err = run_cli(["train", "--config", str(tmp_path / "tiny.yaml"), "--run-dir", str(tmp_path / "run"),
                            "--no-progress"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    monkeypatch.setenv("COMMIT", "abc1234")
    result = subprocess.run([sys.executable, str(BENCHMARKS / "recipe_figures.py"), str(tmp_path / "run"),
                             "--label", "multi30k-en-de", "--stage-seconds", "12"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    assert line["figure"] == "multi30k-en-de" and line["commit"] == "abc1234" and line["end_to_end_s"] == 12
    assert line["test_bleu"] == summary["test"]["bleu"] and line["step"] == 4
    assert line["test_ema_bleu"] == summary["test"]["ema"]["bleu"]  # the average's test, then the EMA's
    log = (tmp_path / "run" / "train.log").read_text(encoding="utf-8")
    rates = [float(m.group(1)) for m in re.finditer(r"step \d+/4 .*? (\d+) target tokens/s", log)]
    assert len(rates) == 2  # the log lines of steps 2 and 4
    assert line["tgt_tokens_per_s_median"] == statistics.median(rates)
    assert line["ms_per_update"] == pytest.approx(1000 * summary["tgt_tokens_seen"] / 4 / statistics.median(rates), rel=1e-3)
    resumed = subprocess.run([sys.executable, str(BENCHMARKS / "recipe_figures.py"), str(tmp_path / "run"),
                              "--stage-seconds", "12", "--resumed"], capture_output=True, text=True)
    assert json.loads(resumed.stdout)["end_to_end_s"] is None  # a resumed run's stage is not a whole run


def test_the_figure_scores_validation_as_tmt_evaluate_does_and_says_when_it_cannot(tiny_corpus: Path, tmp_path: Path,
                                                                                monkeypatch, capsys):
    cfg = tiny_config(tiny_corpus, train={"max_steps": 4, "eval_every_steps": 4, "save_every_steps": 2,
                                          "average_last": 2, "ema_decay": 0.9}, decode={"beam_size": 2})
    save_config(cfg, tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    code, _, err = run_cli(["train", "--config", str(tmp_path / "tiny.yaml"), "--run-dir", str(run), "--no-progress"],
                           monkeypatch, capsys, tmp_path)
    assert code == 0, err
    figure = [sys.executable, str(BENCHMARKS / "recipe_figures.py"), str(run), "--score-valid"]
    line = json.loads(subprocess.run(figure, capture_output=True, text=True, check=True).stdout)
    last = "step_00000004.pt"  # the EMA's measure: its weights at the last step, not best.pt's (chosen on validation)
    for checkpoint in (line["test_checkpoint"], last):  # validation, at the run's beam
        hypotheses = run / "evaluation" / f"valid.{checkpoint.removesuffix('.pt')}.beam2.txt"
        assert len(hypotheses.read_text(encoding="utf-8").splitlines()) == 4
    expected = {}
    for key, checkpoint in (("valid_bleu", line["test_checkpoint"]), ("valid_ema_bleu", last)):
        code, out, err = run_cli(["evaluate", "--checkpoint", str(run / "checkpoints" / checkpoint), "--split", "valid",
                                  "--quiet"], monkeypatch, capsys, tmp_path)
        assert code == 0, err
        expected[key] = float(re.search(r"^BLEU = ([\d.]+)", out, re.MULTILINE).group(1))
    assert {key: line[key] for key in expected} == expected
    (run / "checkpoints" / line["test_checkpoint"]).unlink()  # the averaged checkpoint gone: no score, exit 1
    failed = subprocess.run(figure, capture_output=True, text=True)
    assert failed.returncode == 1 and json.loads(failed.stdout)["valid_bleu"] is None
    assert f"tmt evaluate --split valid of {line['test_checkpoint']} failed" in failed.stderr


def test_the_runbook_parses_and_skips_variants_that_no_longer_fit(tmp_path: Path):
    script = BENCHMARKS / "gpu_runbook.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = {**os.environ, "BUDGET": "0", "OUT": str(tmp_path / "out"), "COMMIT": "abc1234",
           "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(script), "variants"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"figure"')]
    assert [line["figure"] for line in lines] == ["variant-compiled", "variant-16k-tokens", "variant-no-cuda-graphs",
                                                  "variant-pad1"]
    assert all(line["commit"] == "abc1234" and "skipped" in line for line in lines)
    unknown = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True, env=env)
    assert unknown.returncode == 2 and "unknown stage 'nonsense'" in unknown.stderr


def test_tag_names_a_runbook_training_stage_apart_from_the_plain_recipe(tmp_path: Path):
    """Seeds of a variant run with TAG=levers: a warm machine must not resume the plain recipe's run."""
    env = {**os.environ, "BUDGET": "0", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "TAG": "levers"}
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu_runbook.sh"), "multi30k-seed3"], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "multi30k-en-de-seed3-levers: NO CHECKPOINT in runs/gpu-multi30k-en-de-seed3-levers" in result.stdout


def test_the_runbook_compare_stage_says_when_there_is_nothing_to_compare(tmp_path: Path):
    if any((REPO / "runs").glob("gpu-multi30k-en-de*/evaluation/test_scores.json")):
        pytest.skip("this checkout holds finished GPU runs: the stage would compare them")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "COMMIT": "abc1234"}
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu_runbook.sh"), "compare"], capture_output=True, text=True,
                            env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"figure"')]
    assert lines == [{"figure": "compare", "commit": "abc1234",
                      "skipped": "fewer than two finished Multi30k runs in runs/"}]


def test_runbook_stages_joined_by_commas_run_at_once_each_into_its_own_log(tmp_path: Path):
    """`check,multi30k,...` shares one GPU machine between stages: each keeps its own log and status."""
    out = tmp_path / "out"
    env = {**os.environ, "BUDGET": "0", "OUT": str(out), "PYTHON": sys.executable, "COMMIT": "abc1234"}
    env.pop("OMP_NUM_THREADS", None)  # unset: the host's cores shared out, rounded up
    fake = tmp_path / "bin"  # a host of 5 cores, whatever this one has: 2 stages get 3 threads each
    fake.mkdir()
    (fake / "nproc").write_text("#!/bin/sh\necho 5\n", encoding="utf-8")
    (fake / "nproc").chmod(0o755)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    script = str(BENCHMARKS / "gpu_runbook.sh")
    result = subprocess.run(["bash", script, "variants,multi30k-seed2"], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "at once: variants multi30k-seed2, each into its own STAGE.log, 3 CPU threads each" in result.stdout
    assert '"figure": "variant-pad1"' in (out / "variants.log").read_text(encoding="utf-8")
    assert "NO CHECKPOINT in runs/gpu-multi30k-en-de-seed2" in (out / "multi30k-seed2.log").read_text(encoding="utf-8")
    assert not (out / "runs.tar.gz").exists()  # nothing trained: nothing to archive
    unknown = subprocess.run(["bash", script, "variants,nonsense"], capture_output=True, text=True, env=env)
    assert unknown.returncode == 2 and "unknown stage 'nonsense'" in unknown.stderr


def test_runbook_scout_runs_each_recipe_under_its_own_name_into_one_log(tmp_path: Path):
    out = tmp_path / "out"
    env = {**os.environ, "BUDGET": "0", "OUT": str(out), "PYTHON": sys.executable,
           "SCOUT": "pre:model.norm=pre;pre-s2:seed=2 model.norm=pre", "OMP_NUM_THREADS": "3"}
    script = str(BENCHMARKS / "gpu_runbook.sh")
    result = subprocess.run(["bash", script, "scout"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "scout.log").read_text(encoding="utf-8")
    assert "scout: 2 runs at once, 3 CPU threads each" in log  # OMP_NUM_THREADS set: each run gets it
    for name in ("pre", "pre-s2"):
        assert f"[{name}] == " in log and f"NO CHECKPOINT in runs/gpu-multi30k-en-de-{name}:" in log
    env.pop("SCOUT")
    unset = subprocess.run(["bash", script, "scout"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert unset.returncode == 1 and "scout needs SCOUT=" in unset.stdout + unset.stderr


def test_the_figure_of_a_run_without_a_summary_or_a_validation_is_said_not_a_traceback(tmp_path: Path):
    figure = [sys.executable, str(BENCHMARKS / "recipe_figures.py")]
    missing = subprocess.run([*figure, str(tmp_path / "nothing")], capture_output=True, text=True)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.startswith(f"recipe_figures: {tmp_path / 'nothing' / 'summary.json'}: cannot read it")
    run = tmp_path / "run"  # stopped before its first validation: tmt's -1 markers are no BLEU
    run.mkdir()
    summary = {"status": "interrupted", "step": 5, "max_steps": 10, "best_bleu": -1.0, "best_step": -1, "test": None,
               "tgt_tokens_seen": 100, "train_seconds": 3.0, "provenance": {}}
    (run / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    (run / "train.log").write_text("", encoding="utf-8")
    line = json.loads(subprocess.run([*figure, str(run)], capture_output=True, text=True, check=True).stdout)
    assert (line["best_valid_bleu"], line["best_step"]) == (None, None)


def test_the_synthetic_corpus_script_never_writes_over_a_users_corpus(tmp_path: Path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.en").write_text("my precious line\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(BENCHMARKS / "make_synthetic_corpus.py"), "--pairs", "5",
                             "--out", str(tmp_path / "mine")], capture_output=True, text=True)
    assert result.returncode == 1 and "already holds train.en; choose another --out" in result.stderr
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["train.en"]
    assert (tmp_path / "mine" / "train.en").read_text(encoding="utf-8") == "my precious line\n"


def test_the_runbook_states_every_goal_as_one_json_line_and_what_is_not_measured_yet(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    bench = {"figure": "goal-bench", "mfu": 0.362, "tmt_vs_hf_marian": 1.8, "real_token_share": 0.985}
    recipe = {"figure": "multi30k-en-de", "ms_per_update": 2.7, "end_to_end_s": None, "test_bleu": 41.3,
              "cuda_graphs": {"captured_shapes": 1, "capture_seconds": 4.2, "compile_seconds": 0.0}}
    (out / "goal-bench.log").write_text("== 10:00:00 bench\n" + json.dumps({**bench, "mfu": 0.1}) + "\n"
                                        + json.dumps(bench) + "\n", encoding="utf-8")  # the last line counts
    (out / "multi30k.log").write_text(json.dumps(recipe) + "\n", encoding="utf-8")
    (out / "multi30k-seed2.log").write_text(json.dumps({"figure": "multi30k-en-de-seed2", "test_bleu": 40.9}) + "\n"
                                            + '{"figure": "cut off', encoding="utf-8")  # a stage stopped mid-line
    env = {**os.environ, "OUT": str(out), "COMMIT": "abc1234", "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu_runbook.sh"), "goals"], capture_output=True, text=True,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line["figure"]: line for line in map(json.loads, (x for x in result.stdout.splitlines()
                                                                if x.startswith('{"figure"')))}
    assert list(lines) == ["goal-mfu", "goal-vs-hf-marian", "goal-real-token-share", "goal-ms-per-update",
                           "goal-end-to-end-s", "goal-test-bleu-3-seeds", "goal-captures-per-run",
                           "goal-capture-compile-s"]
    assert all(line["commit"] == "abc1234" for line in lines.values())
    met = {name: (line["value"], line["met"]) for name, line in lines.items()}
    assert met == {"goal-mfu": (0.362, True), "goal-vs-hf-marian": (1.8, False), "goal-real-token-share": (0.985, True),
                   "goal-ms-per-update": (2.7, True), "goal-end-to-end-s": (None, None),
                   "goal-test-bleu-3-seeds": (None, None), "goal-captures-per-run": (1, True),
                   "goal-capture-compile-s": (4.2, True)}
    assert lines["goal-test-bleu-3-seeds"]["open"] == "no multi30k-en-de-seed3 figure in the logs"
    assert lines["goal-end-to-end-s"]["open"] == "multi30k-en-de did not measure it (a stopped or resumed run)"
    (out / "multi30k-seed3.log").write_text(json.dumps({"figure": "multi30k-en-de-seed3", "test_bleu": 41.2}) + "\n",
                                            encoding="utf-8")
    again = subprocess.run([sys.executable, str(BENCHMARKS / "goal_figures.py"), *map(str, sorted(out.glob("*.log")))],
                           capture_output=True, text=True, check=True)
    bleu = next(json.loads(x) for x in again.stdout.splitlines() if "goal-test-bleu-3-seeds" in x)
    assert (bleu["value"], bleu["met"]) == (41.13, True)
