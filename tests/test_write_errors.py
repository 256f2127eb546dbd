"""Every file tmt writes fails the same way: one line naming the file and the reason, exit 1, under a
file-size limit (`ulimit -f`: EFBIG) as on a full disk (ENOSPC); a first start of `tmt train` that
fails before training leaves no run directory behind."""

from __future__ import annotations

import errno
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import (LIMITED_ENV as ENV, TINY_PAIRS, can_mount_a_small_filesystem, forked, mount_tmpfs,
                           run_tmt, size_limited, tiny_config, tmt_limited, write_corpus)
from transformer_mt.config.loading import save_config
from transformer_mt.core.files import describe_os_error
from transformer_mt.runs import run_dir as run_dir_module

FILE_TOO_LARGE = "File too large (a file-size limit)"
NO_SPACE = r"No space left on device; [\d,]+ bytes free there"
needs_tmpfs = pytest.mark.skipif(not can_mount_a_small_filesystem(), reason="needs unshare -rm to mount a tmpfs")


def tmt_on_full_disk(*args: str, cwd: Path, disk: Path, size: str = "64k", fill: bool = True
                     ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`tmt ARGS` with a tmpfs of `size` mounted at `disk` (filled first, unless `fill` is false);
    and what it holds afterwards (relative paths, the filler left out)."""
    listing = cwd / "left_on_disk.txt"

    def on_a_small_disk() -> int:
        mount_tmpfs(disk, size, fill)
        code = run_tmt(*args)
        listing.write_text("\n".join(str(p.relative_to(disk)) for p in disk.rglob("*") if p.name != "filler"))
        return code
    result = forked(on_a_small_disk, cwd=cwd, namespace=True)
    return result, sorted(listing.read_text().split()) if listing.exists() else ["(not listed)"]


def assert_one_line(result: subprocess.CompletedProcess, pattern: str) -> None:
    """Exit 1, no traceback, and a last line on stderr matching `pattern` (a regex) from its start to its end."""
    err = result.stderr
    assert result.returncode == 1, err
    assert "Traceback" not in err and "internal error" not in err and "Logging error" not in err, err
    assert re.fullmatch(pattern, err.strip().splitlines()[-1]), err


def corpus_config(root: Path, copies: int = 1, **train) -> Path:
    """A tiny config over the tiny pairs, `copies` times over (numbered), saved as root/c<copies>.yaml."""
    pairs = [(f"{s} {i}", f"{t} {i}") for i in range(copies) for s, t in TINY_PAIRS] if copies > 1 else TINY_PAIRS
    corpus = write_corpus(root / f"corpus{copies}", {"train": pairs, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    config = root / f"c{copies}.yaml"
    save_config(tiny_config(corpus, train=train), config)
    return config


def train_args(config: Path, run: Path) -> list[str]:
    return ["train", "--config", str(config), "--run-dir", str(run), "--no-progress"]


# --- tmt train, as a user meets it -------------------------------------------------------------

def test_a_corpus_cache_past_a_file_size_limit_is_named_and_leaves_no_run(tmp_path: Path):
    config = corpus_config(tmp_path, copies=16)  # its corpus cache (9 KB) is the first file past 4 KB
    result = tmt_limited(*train_args(config, tmp_path / "run"), cwd=tmp_path, limit=4096)
    assert_one_line(result, rf"tmt: error: cannot write the corpus cache: {tmp_path}/run/\S+\.arrow: "
                            f"{re.escape(FILE_TOO_LARGE)}")
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_past_a_file_size_limit_is_named_and_leaves_no_run(tmp_path: Path):
    config = corpus_config(tmp_path)  # tokenizer.json (12 KB) is the first file past 4 KB
    result = tmt_limited(*train_args(config, tmp_path / "run"), cwd=tmp_path, limit=4096)
    assert_one_line(result, rf"tmt: error: {tmp_path}/run/tokenizer\.json: {re.escape(FILE_TOO_LARGE)}")
    assert not (tmp_path / "run").exists()


def test_a_config_past_a_file_size_limit_is_named_and_leaves_no_run(tmp_path: Path):
    config = corpus_config(tmp_path)
    result = tmt_limited(*train_args(config, tmp_path / "runs" / "run"), cwd=tmp_path, limit=1024)
    assert_one_line(result, rf"tmt: error: {tmp_path}/runs/run/config\.yaml: {re.escape(FILE_TOO_LARGE)}")
    assert not (tmp_path / "runs").exists()  # the folders this start created go with it


def test_a_token_cache_past_a_file_size_limit_is_named_and_leaves_no_run(tmp_path: Path):
    config = corpus_config(tmp_path, copies=16)  # corpus 9 KB, tokenizer 11 KB, token ids 16 KB
    result = tmt_limited(*train_args(config, tmp_path / "run"), cwd=tmp_path, limit=14_000)
    assert_one_line(result, rf"tmt: error: cannot write the token cache of the train split: {tmp_path}/run/\S+: "
                            f"{re.escape(FILE_TOO_LARGE)}")
    assert not (tmp_path / "run").exists()


def test_a_first_checkpoint_past_a_file_size_limit_says_no_earlier_ones_are_intact(tmp_path: Path):
    config = corpus_config(tmp_path)  # a checkpoint is 256 KB, TensorBoard's events under 100 KB
    result = tmt_limited(*train_args(config, tmp_path / "run"), cwd=tmp_path, limit=200_000)
    assert_one_line(result, rf"tmt: error: could not write checkpoint {tmp_path}/run/checkpoints/step_00000003\.pt: "
                            f"{re.escape(FILE_TOO_LARGE)}")
    assert not list((tmp_path / "run").rglob("*.tmp"))


@needs_tmpfs
def test_a_corpus_cache_on_a_full_disk_is_named_and_leaves_no_run(tmp_path: Path):
    config = corpus_config(tmp_path, copies=16)
    disk = tmp_path / "disk"  # 20 KB: the run's first files (4 KB each), not its corpus cache (9 KB)
    result, left = tmt_on_full_disk(*train_args(config, disk / "run"), cwd=tmp_path, disk=disk, size="20k", fill=False)
    assert_one_line(result, rf"tmt: error: cannot write the corpus cache: {disk}/run/\S+\.arrow: {NO_SPACE}")
    assert left == []


@needs_tmpfs
def test_a_first_start_on_a_disk_full_from_the_outset_is_named_and_leaves_no_run(tmp_path: Path):
    config = corpus_config(tmp_path)
    disk = tmp_path / "disk"
    result, left = tmt_on_full_disk(*train_args(config, disk / "run"), cwd=tmp_path, disk=disk)
    assert_one_line(result, rf"tmt: error: {disk}/run/\.tmt-(lock|run): {NO_SPACE}")
    assert left == []


@needs_tmpfs
def test_a_tokenizer_on_a_full_disk_is_named_and_leaves_no_run(tmp_path: Path):
    config = corpus_config(tmp_path)
    disk = tmp_path / "disk"  # 40 KB: the run's first files and its corpus cache, not its tokenizer (12 KB)
    result, left = tmt_on_full_disk(*train_args(config, disk / "run"), cwd=tmp_path, disk=disk, size="40k", fill=False)
    assert_one_line(result, rf"tmt: error: {disk}/run/tokenizer\.json: {NO_SPACE}")
    assert left == []


def train_with_a_full_folder(config: Path, run: Path, folder: str) -> int:
    """`tmt train` where `run/FOLDER` is a full tmpfs, mounted once the run directory is prepared (in a
    child `forked` with a namespace of its own: the patch is the child's alone)."""
    prepare = run_dir_module.prepare_run_dir

    def prepare_then_fill(*args, **kwargs):
        lock = prepare(*args, **kwargs)
        mount_tmpfs(run / folder, "4k", fill=True)
        return lock
    run_dir_module.prepare_run_dir = prepare_then_fill
    return run_tmt(*train_args(config, run))


@needs_tmpfs
@pytest.mark.parametrize("folder, what", [
    ("token_cache", "cannot write the token cache of the train split: "), ("validation", ""), ("evaluation", ""),
    ("checkpoints", "could not write checkpoint ")])
def test_a_folder_of_the_run_on_a_full_disk_stops_training_naming_the_file(folder, what, tmp_path: Path):
    config, run = corpus_config(tmp_path), tmp_path / "run"
    result = forked(lambda: train_with_a_full_folder(config, run, folder), cwd=tmp_path, namespace=True)
    # The line ends with the free bytes: the first checkpoint has no earlier ones to call intact.
    assert_one_line(result, rf"tmt: error: {what}{run}/{folder}/\S+: {NO_SPACE}")


@needs_tmpfs
def test_tensorboard_events_on_a_full_disk_warn_once_naming_them_and_training_goes_on(tmp_path: Path):
    config, run = corpus_config(tmp_path), tmp_path / "run"
    result = forked(lambda: train_with_a_full_folder(config, run, "tensorboard"), cwd=tmp_path, namespace=True)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(re.findall(rf"TensorBoard: cannot write {run}/tensorboard\S* \({NO_SPACE}\); training goes on",
                          result.stderr)) == 1, result.stderr


def test_ctrl_c_while_a_first_start_prepares_its_data_leaves_no_run(tmp_path: Path):
    config = corpus_config(tmp_path, copies=3000)  # seconds of data preparation
    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "transformer_mt", *train_args(config, run)], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not (run / "config.yaml").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not (run / "tokenizer.json").exists()  # still preparing its data
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "Traceback" not in err, err
    again = f"tmt train --config {config} --run-dir {run}"  # without --resume: no run to resume
    assert err.strip().splitlines()[-1] == f"tmt: interrupted; continue with: {again}"
    assert not run.exists()


# --- the other commands ------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["export", "--format", "ctranslate2"], ["export", "--format", "hf"],
    ["translate", "--output", "{out}", "--engine", "torch", "Good morning.", "Thank you very much."],
    ["evaluate", "--output", "{out}", "--bootstrap", "0", "--no-diagnostics", "--engine", "torch"]])
@pytest.mark.parametrize("limit", ["file size", "full disk"])
def test_an_output_that_cannot_be_written_is_one_line_naming_it(command, limit, workdir: Path, tmp_path: Path):
    if limit == "full disk" and not can_mount_a_small_filesystem():
        pytest.skip("needs unshare -rm to mount a tmpfs")
    disk = tmp_path / "disk"
    out = disk / ("model" if command[0] == "export" else "hyp.txt")
    args = [word.replace("{out}", str(out)) for word in command] + ["--run", str(workdir / "runs" / "tiny")]
    if command[0] == "export":
        args += ["--output", str(out)]
    if limit == "file size":
        disk.mkdir()
        result, left = tmt_limited(*args, cwd=tmp_path, limit=10), [p.name for p in disk.iterdir()]
        reason = re.escape(FILE_TOO_LARGE)
    else:
        result, left = tmt_on_full_disk(*args, cwd=tmp_path, disk=disk)
        reason = NO_SPACE
    what = {"translate": "", "evaluate": "", "export": r"cannot write the (CTranslate2 model|model): "}[command[0]]
    inside = r"/model\.safetensors" if "hf" in command else ""  # CTranslate2's writer names no file: the folder
    assert_one_line(result, rf"tmt: error: {what}{out}{inside}: {reason}")
    assert left == []  # nothing half-written, no temp file


# --- what training can lose and go on: warned once, named ---------------------------------------

def run_python(code: str, cwd: Path, limit: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=ENV, preexec_fn=size_limited(limit))


def test_a_log_file_past_a_file_size_limit_warns_once_naming_it(tmp_path: Path):
    result = run_python("""
        import logging, sys
        from transformer_mt.train.optional_outputs import OptionalFileHandler
        logging.getLogger("transformer_mt").addHandler(logging.StreamHandler(sys.stderr))
        log = logging.getLogger("run")
        log.addHandler(OptionalFileHandler("train.log", encoding="utf-8"))
        for step in range(50):
            log.warning("step %d of a run whose log passes the limit", step)
        """, tmp_path, limit=300)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "Logging error" not in result.stderr, result.stderr
    assert result.stderr.count(f"cannot write the log file {tmp_path}/train.log ({FILE_TOO_LARGE})") == 1, \
        result.stderr


def test_tensorboard_events_past_a_file_size_limit_warn_once_naming_them(tmp_path: Path):
    result = run_python("""
        import logging, sys
        from torch.utils.tensorboard import SummaryWriter
        from transformer_mt.train.optional_outputs import OptionalWriter, quiet_tensorboard_thread
        logging.getLogger("transformer_mt").addHandler(logging.StreamHandler(sys.stderr))
        with quiet_tensorboard_thread():
            writer = OptionalWriter(lambda: SummaryWriter("tb"), "tb")
            for step in range(200):
                writer.add_scalar("train/loss", 1.0 / (step + 1), step)
                writer.flush()
            writer.close()
        """, tmp_path, limit=1000)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(re.findall(rf"TensorBoard: cannot write tb\S* \({re.escape(FILE_TOO_LARGE)}\); training goes on",
                          result.stderr)) == 1, result.stderr


# --- the wording, decided in one place ----------------------------------------------------------

@pytest.mark.parametrize("number, reason", [
    (errno.EFBIG, FILE_TOO_LARGE), (errno.EDQUOT, "Disk quota exceeded; "), (errno.ENOSPC, "No space left on device; "),
    (errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied"), (errno.EIO, "Input/output error")])
def test_each_write_error_is_worded_once(number, reason, tmp_path: Path):
    # pyarrow's wording ("Error writing bytes to file. Detail: [errno 27] ...") is replaced by the reason
    err = OSError(number, "Error writing bytes to file")
    assert describe_os_error(err, tmp_path / "x.arrow").startswith(f"{tmp_path / 'x.arrow'}: {reason}")
