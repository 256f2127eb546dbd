"""A full disk (or quota, read-only or failing one) ends a run with one line naming the file and
the reason, never a traceback; the run stays resumable, and no temp file is left behind."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import PYTHONPATH, can_mount_a_small_filesystem, run_cli, tiny_config
from transformer_mt.config.loading import save_config
from transformer_mt.core.errors import CheckpointError
from transformer_mt.runs import summary
from transformer_mt.runs.checkpoint import load_checkpoint, save_atomic


@pytest.mark.skipif(not can_mount_a_small_filesystem(), reason="needs unshare -rm to mount a tmpfs")
def test_training_on_a_filesystem_that_fills_up_stops_with_the_file_and_resumes(tiny_corpus: Path, tmp_path: Path):
    config = tmp_path / "tiny.yaml"
    save_config(tiny_config(tiny_corpus, train={"max_steps": 9, "keep_last": 5}), config)
    small, after = tmp_path / "small", tmp_path / "after_full"
    small.mkdir()
    tmt = f"{sys.executable} -m transformer_mt train --config {config} --run-dir {small}/run --no-progress"
    # 500 KiB hold the data, the tokenizers and the first checkpoint (256 KiB), not the second.
    script = (f"mount -t tmpfs -o size=500k tmpfs {small} && {{ {tmt} 2>{tmp_path}/full.err; echo $? > {tmp_path}/rc; "
              f"cp -a {small}/run {after}; mount -o remount,size=20m {small} && {tmt} --resume; }}")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"})
    err = (tmp_path / "full.err").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1", err
    assert "Traceback" not in err and "internal error" not in err and "Logging error" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"tmt: error: could not write checkpoint {small}/run/checkpoints/step_00000006.pt: "
                           "No space left on device; "), err
    assert "bytes free there; earlier checkpoints are intact" in last
    leftovers = [p for p in after.rglob("*") if p.name.endswith((".tmp", ".skipped"))]
    assert leftovers == []
    assert load_checkpoint(after / "checkpoints" / "step_00000003.pt")["train_state"]["step"] == 3
    assert result.returncode == 0, result.stderr  # space freed: --resume finishes the run


def test_a_checkpoint_write_that_torch_reports_as_unexpected_pos_names_the_full_disk(tmp_path: Path, monkeypatch):
    """torch.save swallows the OSError of a failed write and raises `RuntimeError: ... unexpected pos`."""
    save_atomic({"weights": torch.zeros(10)}, tmp_path / "step_00000001.pt")
    (tmp_path / "first").mkdir()
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: (os.close(fd), real_fdopen(os.open("/dev/full", os.O_WRONLY),
                                                                                  mode))[1])
    with pytest.raises(CheckpointError, match=r"step_00000002.pt: No space left on device; [\d,]+ bytes free there; "
                                              "earlier checkpoints are intact$"):
        save_atomic({"weights": torch.zeros(10_000)}, tmp_path / "step_00000002.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "step_00000001.pt"]  # the temp file is gone
    with pytest.raises(CheckpointError, match=r"first/step_00000001.pt: No space left on device; [\d,]+ bytes free "
                                              "there$"):  # no earlier checkpoint to speak of
        save_atomic({"weights": torch.zeros(10_000)}, tmp_path / "first" / "step_00000001.pt")


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO])
def test_a_failed_write_outside_the_checkpoints_is_one_line_naming_the_file(number, tiny_corpus: Path,
                                                                             tmp_path: Path, monkeypatch, capsys):
    save_config(tiny_config(tiny_corpus), tmp_path / "tiny.yaml")

    def fail(*args, **kwargs):
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr("transformer_mt.core.files.os.fsync", fail)  # every atomic write: config.yaml first
    code, _, err = run_cli(["train", "--config", str(tmp_path / "tiny.yaml"), "--run-dir", str(tmp_path / "run"),
                            "--no-progress"], monkeypatch, capsys, tmp_path)
    assert code == 1
    assert err.strip().splitlines()[-1].startswith(f"tmt: error: {tmp_path / 'run' / 'config.yaml'}: "
                                                   f"{os.strerror(number)}"), err
    assert "Traceback" not in err and "internal error" not in err
    assert not (tmp_path / "run").exists()  # a failed first start leaves nothing, temp files included


def test_tensorboard_and_summary_failures_warn_once_and_training_goes_on(tiny_corpus: Path, tmp_path: Path,
                                                                         monkeypatch, capsys):
    save_config(tiny_config(tiny_corpus), tmp_path / "tiny.yaml")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(summary, "write_summary", no_space)
    monkeypatch.setattr(torch.utils.tensorboard.SummaryWriter, "add_scalar", no_space)
    code, _, err = run_cli(["train", "--config", str(tmp_path / "tiny.yaml"), "--run-dir", str(tmp_path / "run"),
                            "--no-progress"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert err.count("could not update summary.json (No space left on device); training goes on") == 1
    assert err.count("TensorBoard: cannot write") == 1
    assert (tmp_path / "run" / "checkpoints" / "step_00000006.pt").is_file()


def test_a_log_file_on_a_full_disk_warns_once_instead_of_a_traceback_per_line(capsys):
    from transformer_mt.train.optional_outputs import OptionalFileHandler

    logger = logging.getLogger("test_disk_full.log")
    console = logging.StreamHandler(sys.stderr)
    handler = OptionalFileHandler("/dev/full", encoding="utf-8")  # every flush: ENOSPC
    logger.addHandler(handler)
    logging.getLogger("transformer_mt.train.optional_outputs").addHandler(console)
    try:
        for step in range(3):
            logger.warning("step %d", step)
    finally:
        logger.removeHandler(handler)
        logging.getLogger("transformer_mt.train.optional_outputs").removeHandler(console)
        handler.close()
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err
    assert err.count("cannot write the log file /dev/full (No space left on device)") == 1, err
