"""`tmt average`: the mean of a run's last step checkpoints, usable by translate and evaluate."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import run_cli, tiny_config
from transformer_mt.core.errors import CheckpointError
from transformer_mt.runs.checkpoint import average_checkpoints, load_checkpoint
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.trainer import train


def test_average_of_the_last_checkpoints_is_their_mean_and_translates(tiny_corpus: Path, tmp_path: Path,
                                                                      monkeypatch, capsys):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 8, "save_every_steps": 2, "eval_every_steps": 8,
                                          "keep_last": 3}), run, progress=False)
    code, _, err = run_cli(["average", "--run", str(run), "--last", "3"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    averaged = load_checkpoint(run / "checkpoints" / "average_steps_00000004-00000008.pt")
    parts = [load_checkpoint(run / "checkpoints" / f"step_{s:08d}.pt")["model"] for s in (4, 6, 8)]
    for name, tensor in averaged["model"].items():
        torch.testing.assert_close(tensor, (parts[0][name] + parts[1][name] + parts[2][name]) / 3)
    assert averaged["averaged_from"] == ["step_00000004.pt", "step_00000006.pt", "step_00000008.pt"]
    assert averaged["tokenizers"] == load_checkpoint(run / "checkpoints" / "step_00000008.pt")["tokenizers"]
    other = load_checkpoint(run / "checkpoints" / "step_00000004.pt")
    other["tokenizers"] = "0" * 32  # another run's checkpoint, copied in
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="only checkpoints of one run can be averaged"):
        average_checkpoints([tmp_path / "other.pt", run / "checkpoints" / "step_00000008.pt"])

    code, out, err = run_cli(["translate", "--checkpoint", str(run / "checkpoints" / "average_steps_00000004-00000008.pt"),
                              "Good morning."], monkeypatch, capsys, tmp_path)
    assert code == 0 and len(out.splitlines()) == 1, err

    # Evaluating a named checkpoint writes its own hypotheses file beside the run's default one.
    evaluation = run / "evaluation"
    code, _, err = run_cli(["evaluate", "--run", str(run), "--split", "valid", "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    default = (evaluation / "valid.best.beam1.txt").read_text("utf-8")
    code, out, err = run_cli(["evaluate", "--checkpoint", str(run / "checkpoints" / "average_steps_00000004-00000008.pt"),
                              "--split", "valid", "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0 and out.startswith("BLEU = "), err
    assert (evaluation / "valid.average_steps_00000004-00000008.beam1.txt").is_file()
    assert (evaluation / "valid.best.beam1.txt").read_text("utf-8") == default

    code, _, err = run_cli(["average", "--run", str(run), "--last", "5"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "3 step checkpoint(s) on disk, fewer than --last 5" in err
    # No run there, a file, no checkpoint: said as translate, evaluate and export say it (exit 1).
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    for where, said in (("nothere", "nothere: no such run directory"),
                        (str(run / "summary.json"), "not a run directory (a file)"),
                        ("empty", "empty: no checkpoint found in")):
        code, _, err = run_cli(["average", "--run", where], monkeypatch, capsys, tmp_path)
        assert code == 1 and said in err, err


def test_a_run_resumed_with_its_depths_written_another_way_still_averages(tiny_corpus: Path, tmp_path: Path):
    """A resume accepts `n_layers: 2` rewritten as 2 encoder and 2 decoder layers (the same model), and
    a checkpoint saved before the depth keys existed; the end-of-training average must accept them too."""
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    steps = {"save_every_steps": 1, "eval_every_steps": 2, "keep_last": 4}
    train(tiny_config(tiny_corpus, train={"max_steps": 2, **steps}), run, progress=False)
    older = load_checkpoint(run / "checkpoints" / "step_00000001.pt")
    for key in ("encoder_layers", "decoder_layers"):  # as a tmt from before these keys saved it
        del older["config"]["model"][key]
    torch.save(older, run / "checkpoints" / "step_00000001.pt")
    prepare_run_dir(run, resume=True, overwrite=False)
    rewritten = tiny_config(tiny_corpus, model={"n_layers": 6, "encoder_layers": 2, "decoder_layers": 2},
                            train={"max_steps": 4, "average_last": 4, **steps})
    train(rewritten, run, resume=True, progress=False)  # ends with the test of the average of steps 1-4
    averaged = load_checkpoint(run / "checkpoints" / "average_steps_00000001-00000004.pt")
    assert averaged["averaged_from"] == [f"step_{s:08d}.pt" for s in (1, 2, 3, 4)]
    # A model that really differs is still refused.
    other = load_checkpoint(run / "checkpoints" / "step_00000003.pt")
    other["config"]["model"]["decoder_layers"] = 1
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="only checkpoints of one run can be averaged"):
        average_checkpoints([tmp_path / "other.pt", run / "checkpoints" / "step_00000004.pt"])


def test_average_never_writes_over_a_checkpoint_or_a_users_file(tiny_corpus: Path, tmp_path: Path,
                                                                monkeypatch, capsys):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 4, "save_every_steps": 2, "test_at_end": False})
    train(cfg, run, progress=False)
    (tmp_path / "notes.txt").write_text("mine", encoding="utf-8")
    for output in (tmp_path / "notes.txt", run / "checkpoints" / "step_00000004.pt", run / "checkpoints" / "best.pt"):
        before = output.read_bytes()
        code, _, err = run_cli(["average", "--run", str(run), "--last", "2", "--output", str(output)],
                               monkeypatch, capsys, tmp_path)
        assert code == 2 and "already exists" in err and output.read_bytes() == before, err
    # The name tmt gives averages is not enough to be replaced: the file must be an average tmt wrote.
    (tmp_path / "average_steps_mine.pt").write_text("mine", encoding="utf-8")
    shutil.copyfile(run / "checkpoints" / "step_00000004.pt", tmp_path / "average_steps_copy.pt")
    for output in (tmp_path / "average_steps_mine.pt", tmp_path / "average_steps_copy.pt"):
        before = output.read_bytes()
        code, _, err = run_cli(["average", "--run", str(run), "--last", "2", "--output", str(output)],
                               monkeypatch, capsys, tmp_path)
        assert code == 2 and "already exists" in err and output.read_bytes() == before, err
    for _ in range(2):  # the second run replaces the first one's average
        code, _, err = run_cli(["average", "--run", str(run), "--last", "2"], monkeypatch, capsys, tmp_path)
        assert code == 0, err
    (average,) = (run / "checkpoints").glob("average_steps_*.pt")
    assert "averaged_from" in load_checkpoint(average)
    # Nor an average of other steps (the final test's, say) under its name: the name would lie,
    # and the run's test_scores.json would point at other weights.
    before = average.read_bytes()
    code, _, err = run_cli(["average", "--run", str(run), "--last", "1", "--output", str(average)],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and "already exists" in err and average.read_bytes() == before, err
    # Nor another run's average of the same name, through --output into that run's checkpoints/.
    other = tmp_path / "other"
    shutil.copytree(run, other)
    code, _, err = run_cli(["average", "--run", str(other), "--last", "2", "--output", str(average)],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and f"that is {run}'s checkpoints folder, not {other}'s" in err, err
    assert average.read_bytes() == before

    code, _, err = run_cli(["average", "--run", str(run), "--last", "2", "--output", "notes.txt/a.pt"],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and "--output notes.txt/a.pt: notes.txt is not a directory" in err, err
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / ".a.pt.tmp").write_text("mine", encoding="utf-8")  # named as a fixed temp file would be
    code, _, err = run_cli(["average", "--run", str(run), "--last", "2", "--output", str(tmp_path / "new" / "a.pt")],
                           monkeypatch, capsys, tmp_path)
    assert code == 0 and (tmp_path / "new" / "a.pt").is_file(), err
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [".a.pt.tmp", "a.pt"]  # written through its own
    assert (tmp_path / "new" / ".a.pt.tmp").read_text(encoding="utf-8") == "mine"
    code, _, err = run_cli(["average", "--run", str(run), "--last", "2", "--output", str(tmp_path / "new2" / "a.pt")],
                           monkeypatch, capsys, tmp_path)
    assert code == 0 and (tmp_path / "new2" / "a.pt").is_file(), err  # its folder is created

    # An averaged checkpoint holds weights only: put where a step checkpoint was, resume says so.
    path = run / "checkpoints" / "step_00000004.pt"
    path.write_bytes((tmp_path / "new2" / "a.pt").read_bytes())
    prepare_run_dir(run, resume=True, overwrite=False)
    trainer_state = train(tiny_config(tiny_corpus, train={"max_steps": 5, "save_every_steps": 2, "test_at_end": False}),
                          run, resume=True, progress=False)
    assert trainer_state.step == 5  # resumed from step 2, the newest step checkpoint with training state
