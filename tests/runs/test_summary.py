"""`summary.json` (provenance, progress, metrics) and `tmt runs`."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import PYTHONPATH, REPO, TINY_PAIRS, run_cli, tiny_config
from transformer_mt.config.loading import save_config
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.trainer import train


def test_summary_records_provenance_metrics_and_throughput(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "runs" / "tiny"
    prepare_run_dir(run, resume=False, overwrite=False)
    state = train(tiny_config(tiny_corpus, train={"max_steps": 4}), run, progress=False, config_dir=REPO)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["step"] == summary["max_steps"] == 4
    assert summary["best_bleu"] == state.best_bleu and summary["last_valid"]["step"] == 4
    assert summary["test"]["checkpoint"] == "best.pt" and "bleu_signature" in summary["test"]
    assert summary["tgt_tokens_seen"] == state.tgt_tokens_seen > 0 and summary["tgt_tokens_per_s"] > 0
    data = summary["data"]  # the preflight data report, as the train log shows it
    assert data["pairs"] == {"train": len(TINY_PAIRS) - data["removed"]["too_many_tokens"], "valid": 4, "test": 2}
    assert data["batches_per_epoch"] >= 1
    assert data["lengths"]["train.src"]["p50"] <= data["lengths"]["train.src"]["max"]
    provenance = summary["provenance"]
    assert provenance["data"]["path"] == str(tiny_corpus) and provenance["split_seed"] == 3
    assert set(provenance["tokenizers_sha256"]) == {"tokenizer.json"}
    assert len(provenance["tokenizers_sha256"]["tokenizer.json"]) == 64
    assert provenance["versions"]["torch"] and provenance["device"].startswith("cpu") and provenance["processes"] == 1
    assert provenance["config_git_commit"] is None or len(provenance["config_git_commit"]) >= 40


def test_runs_lists_each_run_and_notices_a_dead_one(tiny_corpus: Path, tmp_path: Path, monkeypatch, capsys):
    run = tmp_path / "runs" / "tiny"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 2}), run, progress=False)
    dead = tmp_path / "runs" / "killed"
    dead.mkdir()
    summary = json.loads((run / "summary.json").read_text())
    (dead / "summary.json").write_text(json.dumps({**summary, "status": "running", "pid": 2 ** 22 + 12345}))

    code, out, err = run_cli(["runs"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["run", "status", "steps"]
    assert any(r.startswith("tiny") and "finished" in r and "2/2" in r for r in rows), out
    assert any(r.startswith("killed") and "died (process gone)" in r for r in rows), out

    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(["runs", "--dir", str(tmp_path / "empty")], monkeypatch, capsys, tmp_path)
    assert code == 0 and out.startswith("run ") and len(out.splitlines()) == 1 and "no runs" in err
    # A mistyped folder, or a file, is not "no runs yet".
    for wrong, problem in [("nothing", "no such folder"), ("runs/tiny/summary.json", "not a folder")]:
        code, out, err = run_cli(["runs", "--dir", str(tmp_path / wrong)], monkeypatch, capsys, tmp_path)
        assert code == 2 and out == "" and err.strip() == f"tmt: error: --dir {tmp_path / wrong}: {problem}"


def test_runs_lists_a_run_that_has_not_reached_training(tmp_path: Path, monkeypatch, capsys):
    """No summary.json before the first step: such a run used to be missing from the table."""
    for name in ("bad", "busy"):  # a start stopped before its first step (Ctrl-C while preparing), one still preparing
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        save_config(dataclasses.replace(tiny_config(tmp_path / "corpus"), name=name), run / "config.yaml")
        (run / ".tmt-run").touch()
    gone = subprocess.Popen(["true"])
    gone.wait()
    for name, pid in (("bad", gone.pid), ("busy", os.getpid())):  # the lock's owner: gone, or this live process
        (tmp_path / "runs" / name / ".tmt-lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    (tmp_path / "runs" / "notes").mkdir()  # a folder of the user's: no row

    code, out, err = run_cli(["runs"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == {"bad", "busy"}, out
    assert rows["bad"][1:5] == ["stopped", "before", "training", "0/6"], out
    assert rows["busy"][1:4] == ["preparing", "data", "0/6"], out


def test_runs_lists_every_run_even_beside_a_summary_of_the_wrong_shape(tmp_path: Path, monkeypatch, capsys):
    for name, text in [("list", "[1, 2]"), ("odd", '{"status": "finished", "test": 5, "provenance": 3, "pid": "x"}'),
                       ("good", '{"status": "finished", "step": 4, "max_steps": 4, "test": {"bleu": 12.5}}')]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(text, encoding="utf-8")
    code, out, err = run_cli(["runs", "--dir", str(tmp_path)], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "unreadable summary.json" in rows["list"] and "finished" in rows["odd"] and "12.50" in rows["good"]


def test_runs_lists_a_run_folder_itself_and_runs_grouped_one_folder_deeper(tmp_path: Path, monkeypatch, capsys):
    summary = '{"status": "finished", "step": 4, "max_steps": 4}'
    for run in ("runs/plain", "runs/ablation/lr1", "runs/ablation/lr2"):
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "summary.json").write_text(summary, encoding="utf-8")
    code, out, err = run_cli(["runs"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert sorted(line.split()[0] for line in out.splitlines()[1:]) == ["ablation/lr1", "ablation/lr2", "plain"]
    code, out, err = run_cli(["runs", "--dir", "runs/plain"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["plain"]


def test_the_config_folders_git_commit_is_recorded_with_dirty_marked(tmp_path: Path):
    import shutil
    import subprocess

    import pytest

    from transformer_mt.runs.summary import git_commit

    if shutil.which("git") is None:
        pytest.skip("no git on this machine")
    repo = tmp_path / "configs"
    repo.mkdir()
    git = lambda *args: subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,  # noqa: E731
                                       text=True, env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                                       "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
                                                       "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}).stdout
    git("init", "-q")
    (repo / "exp.yaml").write_text("name: exp\n")
    git("add", "exp.yaml")
    git("commit", "-q", "-m", "exp")
    head = git("rev-parse", "HEAD").strip()
    assert git_commit(repo) == head and len(head) == 40
    (repo / "exp.yaml").write_text("name: exp2\n")
    assert git_commit(repo) == head + "-dirty"
    (tmp_path / "plain").mkdir()
    assert git_commit(tmp_path / "plain") is None  # not in a repository


def test_translate_without_run_finds_the_newest_run_also_in_a_group(tmp_path: Path):
    import os

    from transformer_mt.core.run_layout import latest_run

    for run, mtime in (("runs/plain", 100), ("runs/ablation/lr1", 300), ("runs/ablation/lr2", 200)):
        checkpoint = tmp_path / run / "checkpoints" / "best.pt"
        checkpoint.parent.mkdir(parents=True)
        checkpoint.write_bytes(b"")
        os.utime(checkpoint, (mtime, mtime))
    assert latest_run(tmp_path / "runs") == tmp_path / "runs" / "ablation" / "lr1"
    os.utime(tmp_path / "runs" / "plain" / "checkpoints" / "best.pt", (400, 400))
    assert latest_run(tmp_path / "runs") == tmp_path / "runs" / "plain"


def test_runs_inside_a_run_folder_names_it(tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "summary.json").write_text('{"status": "finished"}', encoding="utf-8")
    code, out, err = run_cli(["runs", "--dir", "."], monkeypatch, capsys, tmp_path / "demo")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["demo"]


def test_listing_runs_imports_nothing_that_only_training_translating_or_scoring_needs(tmp_path: Path):
    # `tmt runs` reads a few JSON files: torch alone used to make it take seconds.
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"status": "running", "step": 2, "max_steps": 4, "pid": os.getpid(),
                                                  "provenance": {"host": socket.gethostname()}}))
    heavy = ["torch", "datasets", "tensorboard", "torch.utils.tensorboard", "sacrebleu", "tokenizers"]
    code = ("import sys; from transformer_mt.cli import main as cli; code = cli.main(['runs']); "
            f"print(code, [m for m in {heavy!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "tiny  running  2/4" in result.stdout and result.stdout.splitlines()[-1] == "0 []", result.stdout


def test_a_failed_run_keeps_the_table_in_80_columns_and_its_reason_below(tmp_path: Path, monkeypatch, capsys):
    reason = ("could not write checkpoint runs/demo-full/checkpoints/step_00000600.pt: File too large (a file-size "
              "limit); earlier checkpoints are intact")
    for name, status in [("demo", "finished"), ("demo-full", f"failed: {reason}")]:
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(
            {"status": status, "step": 600, "max_steps": 1200, "best_bleu": 41.5, "test": {"bleu": 40.25}}))
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(["runs"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    header, *rows = out.splitlines()
    assert all(len(line) <= 80 for line in out.splitlines()), out
    columns = [header.index(name) for name in ("status", "steps", "valid BLEU", "test BLEU", "updated")]
    for row in rows:  # every figure under its header
        assert [row[column - 2:column] for column in columns] == ["  "] * 5 and row[columns[0]] != " ", out
    failed = next(row for row in rows if row.startswith("demo-full"))
    assert failed.split()[1:4] == ["failed", "600/1200", "41.50"], out
    assert all(len(line) <= 80 for line in err.splitlines()), err
    assert " ".join(err.split()) == f"tmt: demo-full failed: {reason}", err
