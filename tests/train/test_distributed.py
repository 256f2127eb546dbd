"""Several processes under torchrun (gloo on CPU): the same updates as one process, exact resume,
rank-0-only writes, and a world-size change refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import PYTHONPATH, TINY_PAIRS, read_scalars, tiny_config, write_corpus
from transformer_mt.config.loading import save_config
from transformer_mt.core.distributed import Distributed, interleave
from transformer_mt.core.errors import DataError, UsageError
from transformer_mt.data.batching import TokenBatchSampler
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.preparation import prepare_data
from transformer_mt.train.trainer import Trainer, train

# 24 pairs make several 64-token batches, so a step of 2 ranks takes two different batches.
PAIRS = TINY_PAIRS + [(f"{s} {s}", f"{t} {t}") for s, t in TINY_PAIRS]


def torchrun(config: Path, run_dir: Path, *extra: str, wait: bool = True):
    """`torchrun --nproc_per_node 2 -m transformer_mt train ...` on the CPU (gloo)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "transformer_mt", "train", "--config", str(config), "--run-dir", str(run_dir),
               "--no-progress", *extra]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def write_config(root: Path, name: str, **train_settings) -> Path:
    corpus = write_corpus(root / "corpus", {"train": PAIRS, "valid": PAIRS[:6], "test": PAIRS[6:8]})
    cfg = tiny_config(corpus, train={"test_at_end": False, **train_settings})
    save_config(cfg, root / name)
    return root / name


def files_of(directory: Path) -> dict[str, int]:
    """Every file under `directory` with its modification time (ns)."""
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*")) if p.is_file()}


def test_other_ranks_train_on_the_data_rank_0_prepared_without_reading_their_own_copy(tmp_path):
    # Rank 0 reads its machine's copy of the corpus; another machine's copy of the same files has
    # another path and modification time, which would make that rank read, filter and write the
    # corpus again, into the folder it shares with every other rank of its machine.
    run_dir = tmp_path / "run"
    rank0_copy = write_corpus(tmp_path / "node0" / "corpus", {"train": PAIRS, "test": PAIRS[:2]})
    tokenizers, train_data, valid_data, _ = prepare_data(tiny_config(rank0_copy), run_dir)
    other_copy = write_corpus(tmp_path / "node1" / "corpus", {"train": PAIRS, "test": PAIRS[:2]})
    written = files_of(run_dir)

    assert prepare_data(tiny_config(other_copy), run_dir) is not None  # what a rank did before: it rebuilt
    assert files_of(run_dir) != written
    written = files_of(run_dir)
    for path in other_copy.iterdir():  # a prepared rank does not open its sources at all
        path.unlink()
    other_tokenizers, other_train, other_valid, report = prepare_data(tiny_config(other_copy), run_dir, prepared=True)
    assert report is None  # rank 0 reports the data
    assert files_of(run_dir) == written  # nothing written
    assert other_tokenizers.src.to_str() == tokenizers.src.to_str()
    assert other_train.ids(range(len(train_data))) == train_data.ids(range(len(train_data)))
    assert other_valid.src_text == valid_data.src_text


def test_a_resuming_rank_that_does_not_find_the_run_says_the_run_dir_must_be_shared(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", {"train": PAIRS, "test": PAIRS[:2]})
    (tmp_path / "run").mkdir()  # another machine's folder of the same name: rank 0's files are not there
    with pytest.raises(DataError, match="on several machines, --run-dir must be on a filesystem they all share"):
        train(tiny_config(corpus), tmp_path / "run", resume=True, progress=False, dist=Distributed(1, 1, 2))


@pytest.mark.parametrize("missing", ["corpus_cache/corpus.json", "tokenizer.json", "token_cache"])
def test_a_rank_that_does_not_find_rank_0s_data_says_the_run_dir_must_be_shared(tmp_path, missing):
    corpus = write_corpus(tmp_path / "corpus", {"train": PAIRS, "test": PAIRS[:2]})
    run_dir = tmp_path / "run"
    prepare_data(tiny_config(corpus), run_dir)
    path = run_dir / missing
    if path.is_dir():
        for entry in path.iterdir():
            for file in entry.iterdir():
                file.unlink()
    else:
        path.unlink()
    before = files_of(run_dir)
    with pytest.raises(DataError, match="on several machines, --run-dir must be on a filesystem they all share") as error:
        prepare_data(tiny_config(corpus), run_dir, prepared=True)
    assert str(path) in str(error.value)
    assert files_of(run_dir) == before


def test_an_error_under_torchrun_is_said_by_the_rank_that_met_it_and_another_says_why_it_stopped(tmp_path):
    """A bad data path (found by rank 0, which prepares the data): the other rank's failed collective
    used to be reported first, as an internal error; the ranks' lines ran together."""
    config = write_config(tmp_path, "ddp.yaml")
    result = torchrun(config, tmp_path / "run", "--set", "data.path=/nonexistent")
    tmt_lines = [line for line in result.stderr.splitlines() if line.startswith("tmt")]
    assert result.returncode != 0 and "internal error" not in result.stderr, result.stderr[-3000:]
    assert sorted(tmt_lines) == ["tmt (rank 1): error: another process of this torchrun job stopped (its own line, "
                                 "or torchrun's report, says why), so this one stops too",
                                 "tmt: error: data.path: '/nonexistent' is not a directory (data.format: text)"]
    # Each rank's own error is kept (one machine may lack the memory another has), another rank's named.
    # (A model too large for this machine, found once torch is loaded: a config error found before it
    # ends rank 0 so soon that torchrun may stop rank 1 before it reads its config.)
    result = torchrun(config, tmp_path / "run", "--set", "model.d_model=5120000")
    lines = sorted(line for line in result.stderr.splitlines() if line.startswith("tmt"))
    problem = "error: invalid configuration: model.d_model: a model of model.d_model=5.12e+06"
    assert len(lines) == 2 and lines[0].startswith(f"tmt (rank 1): {problem}"), result.stderr[-3000:]
    assert lines[1] == lines[0].replace("tmt (rank 1):", "tmt:"), result.stderr[-3000:]


def test_rank_variables_left_by_a_launcher_do_not_silence_another_command(tmp_path):
    """Only `tmt train` runs distributed: RANK/WORLD_SIZE in the environment (a pod of a job, a
    subprocess of a torchrun job) silenced other commands' errors and interruptions."""
    result = subprocess.run([sys.executable, "-m", "transformer_mt", "data", "--config", str(tmp_path / "missing.yaml")],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": PYTHONPATH, "RANK": "1", "WORLD_SIZE": "2"})
    assert (result.returncode, result.stderr) == (
        2, f"tmt: error: invalid configuration: {tmp_path / 'missing.yaml'}: config file not found\n")


def test_interleave_undoes_a_strided_split():
    items = list(range(7))
    assert interleave([items[r::3] for r in range(3)]) == items
    assert interleave([items[r::1] for r in range(1)]) == items


def test_each_step_gives_every_rank_a_batch_of_neighbouring_length():
    lengths = torch.randint(1, 40, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    single = TokenBatchSampler(lengths, batch_tokens=120, seed=5).epoch_batches(0)
    batches = TokenBatchSampler(lengths, batch_tokens=120, seed=5, world_size=4).epoch_batches(0)
    assert len(batches) % 4 == 0 and len(batches) >= len(single)
    assert {i for b in batches for i in b} == set(range(300))  # the filled-up last group repeats, never drops
    spans = []  # (shortest, longest) batch of each step, by the batches' padded lengths
    for step in range(len(batches) // 4):
        longest = [max(lengths[i] for i in b) for b in batches[4 * step:4 * step + 4]]
        spans.append((min(longest), max(longest)))
    spans.remove(max(spans, key=lambda span: span[1]))  # the last group, filled up with the shortest batches
    spans.sort()
    # The batches of one step are neighbours in length order: the steps' length ranges never interleave.
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_a_ddp_step_equals_one_process_on_the_union_of_the_ranks_batches(tmp_path: Path):
    # Two ranks, each accumulating two micro-batches (gradients all-reduced after the second).
    config = write_config(tmp_path, "ddp.yaml", max_steps=3, eval_every_steps=3, save_every_steps=3)
    cfg_no_dropout = tiny_config(tmp_path / "corpus", model={"dropout": 0.0},
                                 train={"max_steps": 3, "eval_every_steps": 3, "save_every_steps": 3,
                                        "accum_steps": 2, "test_at_end": False})
    save_config(cfg_no_dropout, config)
    run = tmp_path / "run"
    result = torchrun(config, run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["provenance"]["processes"] == 2  # what --resume needs
    ddp_losses = read_scalars(run, "train/loss")
    assert sorted(ddp_losses) == [1, 2, 3]

    # One process, the same initial weights (same seed), each step on the union of the 2 x 2 batches.
    trainer = Trainer(cfg_no_dropout, run, progress=False)  # reuses the run's tokenizers and splits
    batches = iter(TokenBatchSampler(trainer.train_data.lengths(), cfg_no_dropout.train.batch_tokens,
                                     cfg_no_dropout.seed, tie_break=trainer.train_data.tgt_len, world_size=2))
    for step in (1, 2, 3):
        step_batches = [next(batches) for _ in range(4)]  # rank 0 trained on the 1st and 3rd, rank 1 on the others
        assert len({tuple(b) for b in step_batches}) > 1
        result = trainer.train_step.run(trainer.train_data.batch([i for b in step_batches for i in b]))
        assert abs(result.loss.item() - ddp_losses[step]) < 1e-5, (step, result.loss.item(), ddp_losses[step])
    ddp_weights = load_checkpoint(run / "checkpoints" / "step_00000003.pt")["model"]
    D = cfg_no_dropout.model.d_model
    for name, tensor in trainer.model.state_dict().items():
        expected = ddp_weights[name]
        if name.endswith("qkv_proj.bias") or name.endswith("kv_proj.bias"):
            # The key bias's true gradient is zero (q·(k + b) adds the same q·b to every score of a
            # query, which softmax ignores), so Adam amplifies rounding noise into full-size steps.
            key_slice = slice(D, 2 * D) if name.endswith("qkv_proj.bias") else slice(0, D)
            keep = torch.ones_like(tensor, dtype=torch.bool)
            keep[key_slice] = False
            tensor, expected = tensor[keep], expected[keep]
        assert torch.allclose(tensor, expected, atol=1e-5), name

    # Rank 0 alone wrote: one TensorBoard file, one log line per step, one validation file.
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    log = (run / "train.log").read_text(encoding="utf-8")
    assert log.count("transformer_mt.train.trainer: step 3/3 (100%") == 1
    assert [p.name for p in (run / "validation").iterdir()] == ["step_00000003.txt"]


@pytest.mark.longest
def test_ddp_stopped_by_sigterm_resumes_to_the_uninterrupted_result(tmp_path: Path):
    # Dropout on: each rank's own random stream must be saved and restored; so must the EMA.
    steps = 30
    config = write_config(tmp_path, "ddp.yaml", max_steps=steps, eval_every_steps=steps, save_every_steps=2,
                          log_every_steps=1, keep_last=100, ema_decay=0.9)
    straight = torchrun(config, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    run = tmp_path / "run"
    process = torchrun(config, run, wait=False)
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step_00000002.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)  # as a cluster scheduler would; torchrun passes it on
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "received SIGTERM: saving a checkpoint" in err, err[-3000:]
    stopped_at = max(load_checkpoint(p)["train_state"]["step"] for p in (run / "checkpoints").glob("step_*.pt"))
    assert stopped_at < steps, "the run ended before the signal arrived; nothing was resumed"
    # Rank 0 alone says it, as a stop, not an error.
    said = [line for line in err.splitlines() if line.startswith("tmt")]
    assert said == [f"tmt: interrupted by SIGTERM at step {stopped_at}; checkpoint saved; continue with: the same "
                    f"torchrun command with --resume"], err[-3000:]

    resumed = torchrun(config, run, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {stopped_at}," in resumed.stderr
    final = f"step_{steps:08d}.pt"
    a, b = (load_checkpoint(d / "checkpoints" / final) for d in (tmp_path / "straight", run))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
        assert torch.equal(a["ema"]["model"][name], b["ema"]["model"][name]), name
    assert a["ema"]["updates"] == b["ema"]["updates"] == steps
    expected, got = read_scalars(tmp_path / "straight", "train/loss"), read_scalars(run, "train/loss")
    for step in range(stopped_at + 1, steps + 1):
        assert abs(got[step] - expected[step]) < 1e-6, step


def test_resuming_with_another_number_of_processes_is_refused(tmp_path: Path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", {"train": PAIRS, "valid": PAIRS[:4], "test": PAIRS[4:6]})
    cfg = tiny_config(corpus, train={"max_steps": 2, "eval_every_steps": 2, "save_every_steps": 2,
                                     "test_at_end": False})
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(cfg, run, progress=False)  # one process

    # A second rank's view of the same run (no process group is needed to reach the check).
    trainer = Trainer(cfg, run, progress=False)
    monkeypatch.setattr(trainer.checkpoint, "dist", Distributed(rank=0, local_rank=0, world_size=2))
    before = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    with pytest.raises(UsageError, match=r"written by a run of 1 process\(es\); resume it with the same number"):
        trainer.checkpoint.resume()
    # Refused before anything was loaded (the batches' "cut differently" line came first before).
    assert all(torch.equal(tensor, before[name]) for name, tensor in trainer.model.state_dict().items())


def test_torchrun_environment_is_read_and_checked(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert Distributed.from_environment() == Distributed(0, 0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert Distributed.from_environment() == Distributed(1, 1, 2)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(UsageError, match="RANK=2, LOCAL_RANK=1, WORLD_SIZE=2"):
        Distributed.from_environment()
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(UsageError, match="WORLD_SIZE=None"):
        Distributed.from_environment()


def test_ddp_trains_with_frozen_parts_and_leaves_them_as_they_were(tmp_path: Path):
    """DDP all-reduces the trainable parameters only: frozen ones have no gradient to wait for."""
    config = write_config(tmp_path, "ddp.yaml", max_steps=2, eval_every_steps=2, save_every_steps=2,
                          freeze=["embeddings", "encoder.layers.0"])
    run = tmp_path / "run"
    result = torchrun(config, run)
    assert result.returncode == 0, result.stderr[-3000:]
    initial = Trainer(tiny_config(tmp_path / "corpus"), tmp_path / "initial", progress=False).model.state_dict()
    trained = load_checkpoint(run / "checkpoints" / "step_00000002.pt")["model"]
    for name, tensor in initial.items():
        frozen = name.startswith(("src_embed.", "tgt_embed.", "output_proj.", "encoder_layers.0."))
        assert torch.equal(trained[name], tensor) == frozen, name
