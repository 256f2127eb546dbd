import json
import math
import os
import shutil
import signal
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import REPO, TINY_PAIRS, read_scalars, run_cli, stop_at_first_validation, tiny_config, write_corpus
from transformer_mt.config.schema import TrainConfig
from transformer_mt.core.distributed import Distributed
from transformer_mt.core.errors import CheckpointError, ConfigError, DataError, TrainingStopped, UsageError
from transformer_mt.core.files import temp_file_target
from transformer_mt.core.run_layout import RunDir
from transformer_mt.data.batching import Batch, TokenBatchSampler
from transformer_mt.decode.translator import Translator
from transformer_mt.runs import summary as summary_module
from transformer_mt.runs.checkpoint import load_checkpoint, save_atomic
from transformer_mt.runs.run_dir import MARKER, check_saved_config, prepare_run_dir
from transformer_mt.train import interval as interval_module
from transformer_mt.train.schedule import lr_at
from transformer_mt.train.trainer import Trainer, train


def schedule(name: str = "inverse_sqrt", **train) -> TrainConfig:
    return TrainConfig(**{"lr": 1.0, "warmup_steps": 4, "max_steps": 12, "lr_schedule": name, **train})


def test_learning_rate_warms_up_linearly_then_decays_with_inverse_sqrt():
    assert lr_at(1, schedule()) == 0.25
    assert lr_at(4, schedule()) == 1.0  # the peak is train.lr, reached at the end of warmup
    assert lr_at(16, schedule()) == 0.5  # sqrt(4 / 16)
    assert lr_at(16, schedule(min_lr=0.6)) == 0.6  # the floor: sqrt(4 / 16) = 0.5 is below it
    assert lr_at(2, schedule(min_lr=0.6)) == 0.5  # warmup starts below the floor all the same


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_linear_and_cosine_warm_up_then_decay_to_the_floor_at_max_steps(name: str):
    # lr 1, warmup 4, max_steps 12, min_lr 0.1: the decay runs over steps 4..12, 8 steps.
    train = schedule(name, min_lr=0.1)
    assert [lr_at(step, train) for step in (1, 2, 4)] == [0.25, 0.5, 1.0]  # linear warmup to the peak
    assert lr_at(12, train) == pytest.approx(0.1)  # the floor, used by the last update
    # Halfway (step 8), both are halfway between peak and floor: 0.1 + 0.9 · 0.5 = 0.55.
    assert lr_at(8, train) == pytest.approx(0.55)
    # A quarter of the way (step 6): linear 0.1 + 0.9 · 0.75 = 0.775;
    # cosine 0.1 + 0.9 · (1 + cos(π/4)) / 2 = 0.1 + 0.45 · 1.7071 = 0.86820.
    assert lr_at(6, train) == pytest.approx({"linear": 0.775, "cosine": 0.1 + 0.45 * (1 + math.sqrt(0.5))}[name])
    # No warmup: the decay (to 0 here) starts at step 0, so step 1 is 1/12 of the way down.
    no_warmup = {"linear": 1 - 1 / 12, "cosine": (1 + math.cos(math.pi / 12)) / 2}
    assert lr_at(1, schedule(name, warmup_steps=0)) == pytest.approx(no_warmup[name])


def test_every_lr_schedule_choice_has_a_schedule():
    choices = typing.get_args(typing.get_type_hints(TrainConfig)["lr_schedule"])
    assert all(0 < lr_at(5, schedule(name)) < 1 for name in choices)  # each decays after warmup


def test_a_tiny_model_overfits_a_tiny_corpus(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS, "test": TINY_PAIRS[:2]})
    cfg = tiny_config(corpus, tokenizer={"vocab_size": 120},
                      model={"d_model": 32, "d_ff": 64, "dropout": 0.0},
                      train={"max_steps": 250, "lr": 3e-3, "warmup_steps": 20, "batch_tokens": 200,
                             "label_smoothing": 0.0, "eval_every_steps": 250, "save_every_steps": 250,
                             "log_every_steps": 50})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    state = train(cfg, tmp_path / "run", progress=False)
    assert state.best_bleu > 90


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_resume_continues_exactly_like_an_uninterrupted_run(tiny_corpus: Path, tmp_path: Path, accum_steps: int):
    # dropout 0.1 and several epochs over 12 pairs: resume must restore RNG and data position.
    cfg = tiny_config(tiny_corpus, train={"max_steps": 8, "eval_every_steps": 4, "save_every_steps": 4,
                                          "accum_steps": accum_steps})
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(cfg, straight, progress=False)

    prepare_run_dir(interrupted, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 3, "eval_every_steps": 4, "save_every_steps": 3,
                                          "accum_steps": accum_steps}),
          interrupted, progress=False)
    if accum_steps == 1:  # 2 batches per epoch: step 3 stops in the middle of the second epoch
        assert load_checkpoint(interrupted / "checkpoints" / "step_00000003.pt")["sampler"]["position"] == 1
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    state = train(cfg, interrupted, resume=True, progress=False)
    assert state.step == 8

    expected, resumed = read_scalars(straight, "train/loss"), read_scalars(interrupted, "train/loss")
    assert sorted(resumed) == list(range(1, 9))
    for step in range(4, 9):
        assert abs(resumed[step] - expected[step]) < 1e-6, step
    final_a = load_checkpoint(straight / "checkpoints" / "step_00000008.pt")
    final_b = load_checkpoint(interrupted / "checkpoints" / "step_00000008.pt")
    for name, tensor in final_a["model"].items():
        assert torch.equal(tensor, final_b["model"][name]), name
    assert final_a["sampler"] == final_b["sampler"]


def test_a_deep_encoder_shallow_decoder_model_trains_resumes_exactly_and_translates(tiny_corpus: Path,
                                                                                    tmp_path: Path):
    depths = {"encoder_layers": 2, "decoder_layers": 1}
    cfg = tiny_config(tiny_corpus, model=depths, train={"max_steps": 6, "eval_every_steps": 3,
                                                        "attention_figures": True})
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(cfg, straight, progress=False)  # validates at steps 3 and 6: attention pictures of its one decoder layer
    prepare_run_dir(interrupted, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, model=depths, train={"max_steps": 3, "eval_every_steps": 3}), interrupted,
          progress=False)
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    train(cfg, interrupted, resume=True, progress=False)

    final = load_checkpoint(straight / "checkpoints" / "step_00000006.pt")
    layers = {name.split(".")[0] + "." + name.split(".")[1] for name in final["model"] if "_layers." in name}
    assert layers == {"encoder_layers.0", "encoder_layers.1", "decoder_layers.0"}
    resumed = load_checkpoint(interrupted / "checkpoints" / "step_00000006.pt")
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    events = EventAccumulator(str(straight / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert set(events.Tags()["images"]) == {"valid/attention_layer_1"}
    # Its first part drew none (tiny_config's train.attention_figures is off), its resumed part did; drawing
    # them changed nothing of training (the weights above are equal).
    assert [image.step for image in events.Images("valid/attention_layer_1")] == [3, 6]
    events = EventAccumulator(str(interrupted / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [image.step for image in events.Images("valid/attention_layer_1")] == [6]
    translator = Translator.from_run(straight, device="cpu", engine="torch")
    assert (len(translator.engine.model.encoder_layers), len(translator.engine.model.decoder_layers)) == (2, 1)
    assert len(translator.translate([TINY_PAIRS[0][0]])) == 1


def test_the_loop_trains_the_sampler_batches_in_order_and_checkpoints_their_end(tiny_corpus: Path, tmp_path: Path):
    # The loop loads the next update's batches while the device works on this one (inside
    # train_step): the batches trained must still be the sampler's, in order, and a checkpoint
    # must record where the trained ones end, not the one drawn ahead.
    cfg = tiny_config(tiny_corpus, train={"max_steps": 5, "accum_steps": 2, "eval_every_steps": 5,
                                          "save_every_steps": 3})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    expected = iter(TokenBatchSampler(trainer.train_data.lengths(), cfg.train.batch_tokens, cfg.seed,
                                      tie_break=trainer.train_data.tgt_len))
    expected = [[next(expected).tolist() for _ in range(2)] for _ in range(5)]
    indices_of, trained = {}, []
    real_load, real_step = trainer.train_step.batches.load, trainer.train_step.run

    def load_batch(indices):
        batch = real_load(indices)
        indices_of[id(batch)] = indices.tolist()
        return batch

    def train_step(batches, *args, **kwargs):
        trained.append([indices_of[id(batch)] for batch in batches])
        return real_step(batches, *args, **kwargs)

    trainer.train_step.batches.load, trainer.train_step.run = load_batch, train_step
    trainer.run()
    assert trained == expected
    position = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000003.pt")["sampler"]
    sampler = TokenBatchSampler(trainer.train_data.lengths(), cfg.train.batch_tokens, cfg.seed)
    sampler.load_state_dict(position)
    epoch_length = len(sampler.epoch_batches(0))
    assert position["epoch"] * epoch_length + position["position"] == 6  # 3 updates of 2 batches


def test_a_pause_for_validation_or_a_checkpoint_is_not_training_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(interval_module.time, "perf_counter", lambda: now[0])
    interval = interval_module.Interval(TrainConfig(), torch.device("cpu"), Distributed())
    batch = Batch(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
                  torch.ones(2, 4, dtype=torch.long), n_src_tokens=10, n_tgt_tokens=8)
    now[0] += 2.0  # a step of 2 s
    interval.add(torch.tensor(1.0), [batch])
    interval.pause()
    now[0] += 30.0  # validation and a checkpoint
    interval.resume()
    now[0] += 2.0  # another step
    interval.add(torch.tensor(1.0), [batch])
    assert interval.read_and_reset().tgt_tokens_per_s == pytest.approx(16 / 4.0)


def test_time_left_is_at_the_recent_pace_with_validations_counted(monkeypatch):
    # 100 s to start (compiling, say), then 1 s a step and a 20 s validation after every 30th step.
    now = [0.0]
    monkeypatch.setattr(interval_module.time, "monotonic", lambda: now[0])
    time_left = interval_module.TimeLeft(max_steps=300, window=30, step=0)
    now[0] += 100.0
    estimates = {}
    for step in range(10, 301, 10):  # a log line every 10 steps
        now[0] += 10.0
        estimates[step] = time_left.at(step)
        if step % 30 == 0:
            now[0] += 20.0
    assert estimates[10] == pytest.approx(110 / 10 * 290)  # the start is all there is to go by
    assert estimates[150] == pytest.approx(50 / 30 * 150)  # 30 steps and one validation: 50 s
    assert estimates[290] == pytest.approx(50 / 30 * 10) and estimates[300] == 0


def test_only_the_last_checkpoints_and_the_best_are_kept(tiny_corpus: Path, tmp_path: Path):
    cfg = tiny_config(tiny_corpus, train={"max_steps": 8, "eval_every_steps": 2, "save_every_steps": 2,
                                          "keep_last": 2})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    state = train(cfg, tmp_path / "run", progress=False)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["best.pt", "step_00000006.pt", "step_00000008.pt"]
    best = load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")
    assert best["train_state"]["best_bleu"] == state.best_bleu


def test_the_first_update_uses_the_first_warmup_rate_and_loss_is_per_target_token(tiny_corpus: Path, tmp_path: Path):
    cfg = tiny_config(tiny_corpus, model={"dropout": 0.0}, train={"lr": 1e-3, "warmup_steps": 4})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    assert trainer.train_step.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)  # 1e-3 · 1/4
    batch = trainer.train_data.batch([0, 1, 2])
    with torch.no_grad():
        logits = trainer.model(batch.src_ids, batch.tgt_in_ids, pack=False)  # (B·T, V)
        summed = F.cross_entropy(logits, batch.tgt_out_ids.flatten(), ignore_index=0, label_smoothing=0.1,
                                 reduction="sum")
    loss = trainer.train_step.run(batch).loss
    assert loss.item() == pytest.approx(summed.item() / batch.n_tgt_tokens, rel=1e-6)
    assert trainer.train_step.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)  # 1e-3 · 2/4


def test_resume_applies_a_changed_learning_rate(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 4}), run, progress=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 6, "lr": 1e-2, "weight_decay": 0.5})
    trainer = Trainer(cfg, run, progress=False)
    trainer.checkpoint.resume()
    group = trainer.train_step.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-2 * math.sqrt(2 / 5))  # the next (5th) update, on the new peak
    assert group["weight_decay"] == 0.5


def test_each_update_and_its_log_line_use_the_schedules_rate(tiny_corpus: Path, tmp_path: Path):
    # lr 1e-3, warmup 2, max_steps 6, cosine to 1e-4: the decay runs over steps 2..6.
    # step 1: 1e-3 · 1/2 = 5e-4; 2: 1e-3; 4 (halfway): 1e-4 + 9e-4 / 2 = 5.5e-4; 6: 1e-4;
    # 3 and 5 (a quarter from each end): 1e-4 + 4.5e-4 · (1 ± cos(π/4)).
    expected = {1: 5e-4, 2: 1e-3, 3: 1e-4 + 4.5e-4 * (1 + math.sqrt(0.5)), 4: 5.5e-4,
                5: 1e-4 + 4.5e-4 * (1 - math.sqrt(0.5)), 6: 1e-4}
    cfg = tiny_config(tiny_corpus, model={"dropout": 0.0},
                      train={"lr": 1e-3, "warmup_steps": 2, "lr_schedule": "cosine", "min_lr": 1e-4})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    for step in range(1, 7):
        assert trainer.train_step.optimizer.param_groups[0]["lr"] == pytest.approx(expected[step], rel=1e-12), step
        trainer.train_step.run(trainer.train_data.batch([0, 1, 2]))
    prepare_run_dir(tmp_path / "logged", resume=False, overwrite=False)
    train(cfg, tmp_path / "logged", progress=False)
    logged = read_scalars(tmp_path / "logged", "train/lr")
    assert logged == pytest.approx(expected, rel=1e-6)  # TensorBoard keeps fp32


def test_a_signal_on_a_save_step_writes_that_checkpoint_once(tiny_corpus: Path, tmp_path: Path, monkeypatch):
    """Step 3 validates and saves; SIGTERM during its validation then stops without saving it again."""
    saved = []
    save = Trainer.save
    monkeypatch.setattr(Trainer, "save", lambda self, is_best: saved.append(self.state.step) or save(self, is_best=is_best))
    cfg = tiny_config(tiny_corpus, train={"max_steps": 6, "eval_every_steps": 3, "save_every_steps": 3})
    stop_at_first_validation(cfg, tmp_path / "run", monkeypatch)
    assert saved == [3]
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000003.pt")["train_state"]["step"] == 3


def test_a_signal_after_a_skipped_batch_saves_the_position_past_it(tiny_corpus: Path, tmp_path: Path, monkeypatch):
    """Saved at step 3, then a batch skipped (out of memory) with SIGTERM on the way: the step is
    still 3 but the data position moved on, so the stop saves step 3 again with that position."""
    from transformer_mt.train.step import TrainStep

    saved, run_or_skip = [], TrainStep.run_or_skip
    save = Trainer.save
    monkeypatch.setattr(Trainer, "save", lambda self, is_best: saved.append(self.checkpoint.sampler_state["position"])
                        or save(self, is_best=is_best))

    def skipped_after_the_save(self, *args, **kwargs):
        if saved and not getattr(self, "skipped", False):
            self.skipped = True
            os.kill(os.getpid(), signal.SIGTERM)
            return None  # as an out-of-memory batch is skipped
        return run_or_skip(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "run_or_skip", skipped_after_the_save)
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    with pytest.raises(TrainingStopped):
        train(tiny_config(tiny_corpus, train={"max_steps": 6, "eval_every_steps": 3, "save_every_steps": 3}), run,
              progress=False)
    assert len(saved) == 2 and saved[1] == saved[0] + 1  # the skipped batch is behind the resume point
    assert load_checkpoint(run / "checkpoints" / "step_00000003.pt")["sampler"]["position"] == saved[1]


def test_a_linear_schedule_resumes_exactly_and_a_changed_schedule_applies_from_the_next_update(
        tiny_corpus: Path, tmp_path: Path, monkeypatch):
    linear = {"lr": 1e-3, "warmup_steps": 2, "lr_schedule": "linear", "min_lr": 1e-4}
    cfg = tiny_config(tiny_corpus, train={**linear, "max_steps": 6})
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(cfg, straight, progress=False)
    # Stopped by SIGTERM at step 3's validation: the same config throughout (the decay reads max_steps).
    stop_at_first_validation(cfg, interrupted, monkeypatch)
    assert load_checkpoint(interrupted / "checkpoints" / "step_00000003.pt")["train_state"]["step"] == 3
    trainer = Trainer(cfg, interrupted, progress=False)
    trainer.checkpoint.resume()
    # The 4th update of the 6-step run: halfway down from 1e-3 to 1e-4 (steps 2..6), not the 3-step run's end.
    assert trainer.train_step.optimizer.param_groups[0]["lr"] == pytest.approx(5.5e-4)
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    train(cfg, interrupted, resume=True, progress=False)
    final = load_checkpoint(straight / "checkpoints" / "step_00000006.pt")["model"]
    resumed = load_checkpoint(interrupted / "checkpoints" / "step_00000006.pt")["model"]
    assert all(torch.equal(tensor, resumed[name]) for name, tensor in final.items())

    cosine = tiny_config(tiny_corpus, train={**linear, "max_steps": 10, "lr_schedule": "cosine"})
    trainer = Trainer(cosine, interrupted, progress=False)
    trainer.checkpoint.resume()
    # Update 7 of 10 on the cosine from step 2: 5/8 of the way, 1e-4 + 4.5e-4 · (1 + cos(5π/8)).
    assert trainer.train_step.optimizer.param_groups[0]["lr"] == pytest.approx(
        1e-4 + 4.5e-4 * (1 + math.cos(5 * math.pi / 8)))


def test_a_checkpoint_from_before_a_config_key_existed_resumes_with_its_default(tiny_corpus: Path, tmp_path: Path,
                                                                                 caplog):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 3}), run, progress=False)
    path = run / "checkpoints" / "step_00000003.pt"
    ckpt = load_checkpoint(path)
    added_since = (("train", "lr_schedule"), ("train", "min_lr"), ("model", "encoder_layers"),
                   ("model", "decoder_layers"), ("train", "ema_decay"), ("train", "init_from"),
                   ("tokenizer", "bpe_dropout"), ("tokenizer", "bpe_dropout_variants"), ("data", "corpora"),
                   ("tokenizer", "bpe_dropout_start_epoch"), ("data", "filters"), ("data", "max_filtered_share"))
    saved_yaml = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    for section, key in added_since:
        del ckpt["config"][section][key]  # as an older tmt wrote it
        del saved_yaml[section][key]
    del ckpt["train_state"]["parent"]
    save_atomic(ckpt, path)
    (run / "config.yaml").write_text(yaml.safe_dump(saved_yaml), encoding="utf-8")
    resumed_cfg = tiny_config(tiny_corpus, train={"max_steps": 6})
    check_saved_config(resumed_cfg, run)  # what `tmt train --resume` checks before preparing the data
    trainer = Trainer(resumed_cfg, run, progress=False)
    with caplog.at_level("INFO", logger="transformer_mt"):
        trainer.checkpoint.resume()
    assert "settings changed since that checkpoint: train.max_steps: 3 -> 6\n" in caplog.text  # and nothing else
    assert trainer.train_step.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * math.sqrt(2 / 4))


def test_overwrite_deletes_only_what_tmt_wrote(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 2}), run, progress=False)
    with pytest.raises(UsageError, match="already holds a trained run"):
        prepare_run_dir(run, resume=False, overwrite=False)
    (run / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(UsageError, match="files that are not part of a tmt run \\(notes.txt\\)"):
        prepare_run_dir(run, resume=False, overwrite=True)
    assert (run / "notes.txt").is_file() and (run / "checkpoints").is_dir()
    (run / "notes.txt").unlink()
    prepare_run_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [RunDir.LOCK, MARKER]  # the lock file: tmt's own


def test_a_start_that_failed_before_its_first_checkpoint_can_be_retried(tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    with pytest.raises(DataError):  # no corpus at that path
        train(tiny_config(tmp_path / "missing"), run, progress=False)
    assert (run / "config.yaml").is_file()
    prepare_run_dir(run, resume=False, overwrite=False)  # no --overwrite needed
    assert sorted(p.name for p in run.iterdir()) == [RunDir.LOCK, MARKER]  # the lock file: tmt's own


def test_packed_training_refuses_a_pair_longer_than_the_pack_before_any_step(tmp_path: Path):
    # Short sources, long targets: the source side of a pack is sized by that ratio, too small for
    # the one long source sentence (no truncation: refused, naming its length and the key).
    words = "uno due tre quattro cinque sei sette otto nove dieci".split()
    pairs = [(words[i % 10], " ".join(words)) for i in range(20)] + [(" ".join(words * 3), " ".join(words))]
    corpus = write_corpus(tmp_path / "corpus", {"train": pairs, "valid": pairs[:2], "test": pairs[:2]})
    cfg = tiny_config(corpus, data={"max_length_ratio": 10.0}, tokenizer={"vocab_size": 60},
                      train={"batching": "packed"})
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    with pytest.raises(DataError, match=r"^train.batch_tokens: training pair \d+ has \d+ source tokens, more than a "
                                        r"pack's \d+ .*raise train.batch_tokens to at least \d+$") as err:
        train(cfg, run, progress=False)
    assert "\n" not in str(err.value)
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


KILLED_WRITING_THE_SUMMARY = """
import os, signal, sys
from pathlib import Path
os.replace = lambda source, target: os.kill(os.getpid(), signal.SIGKILL)
from transformer_mt.runs.summary import write_summary
write_summary(Path(sys.argv[1]), {"status": "running"})
"""


def test_a_start_killed_while_writing_a_text_file_can_be_retried(tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    # A process SIGKILLed between writing summary.json's temp file and renaming it.
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITING_THE_SUMMARY, str(run)], cwd=REPO)
    assert killed.returncode == -signal.SIGKILL
    assert [temp_file_target(p.name) for p in run.iterdir() if p.name not in (MARKER, RunDir.LOCK)] == ["summary.json"]
    prepare_run_dir(run, resume=False, overwrite=False)  # tmt's own leftover: no --overwrite needed
    assert sorted(p.name for p in run.iterdir()) == [RunDir.LOCK, MARKER]  # the lock file: tmt's own
    (run / ".notes.txt.abcd1234.tmp").write_text("not tmt's", encoding="utf-8")  # a temp file of another name
    (run / ".config.yaml.bak.tmp").write_text("not tmt's", encoding="utf-8")  # not the form of tmt's temp files
    with pytest.raises(UsageError, match="files that are not part of a tmt run") as refused:
        prepare_run_dir(run, resume=False, overwrite=True)
    assert ".config.yaml.bak.tmp" in str(refused.value) and ".notes.txt.abcd1234.tmp" in str(refused.value)


def test_a_users_own_config_in_the_run_directory_is_never_deleted(tmp_path: Path):
    run = tmp_path / "exp1"
    run.mkdir()
    (run / "config.yaml").write_text("# my notes\nname: exp1\n", encoding="utf-8")
    for overwrite in (False, True):
        with pytest.raises(UsageError, match="config.yaml, which tmt did not write there"):
            prepare_run_dir(run, resume=False, overwrite=overwrite)
    assert (run / "config.yaml").read_text(encoding="utf-8") == "# my notes\nname: exp1\n"


def test_a_finished_run_whose_checkpoints_were_removed_needs_overwrite(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 2}), run, progress=False)
    shutil.rmtree(run / "checkpoints")  # to save disk; the scores and the summary stay
    kept = sorted(p.name for p in run.iterdir())
    with pytest.raises(UsageError, match="holds a finished run \\(evaluation, summary.json\\) without checkpoints"):
        prepare_run_dir(run, resume=False, overwrite=False)
    assert sorted(p.name for p in run.iterdir()) == kept
    prepare_run_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [RunDir.LOCK, MARKER]  # the lock file: tmt's own


def test_resume_skips_a_truncated_checkpoint_and_uses_the_previous_one(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 6, "save_every_steps": 2, "eval_every_steps": 6})
    train(cfg, run, progress=False)
    newest = run / "checkpoints" / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a write cut short by a crash
    trainer = Trainer(cfg, run, progress=False)
    trainer.checkpoint.resume()
    assert trainer.state.step == 4


def test_a_checkpoint_skipped_on_resume_is_set_aside_and_never_outranks_the_new_ones(tiny_corpus: Path,
                                                                                      tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 6, "save_every_steps": 2, "eval_every_steps": 6,
                                          "keep_last": 2, "test_at_end": False})
    train(cfg, run, progress=False)
    checkpoints = run / "checkpoints"
    newest = checkpoints / "step_00000006.pt"
    assert os.path.samefile(newest, checkpoints / "best.pt")  # step 6 was the best: best.pt is the same file
    newest.write_bytes(newest.read_bytes()[:1000])  # the disk damaged it (best.pt with it)
    # Resumed from step 4, saving at 5 and 7: left in place, the damaged step 6 would outrank step 5
    # under keep_last 2, step 5 would be deleted and the run left with a file it cannot load.
    again = tiny_config(tiny_corpus, train={"max_steps": 7, "save_every_steps": 5, "eval_every_steps": 7,
                                            "keep_last": 2, "test_at_end": False})
    train(again, run, resume=True, progress=False)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best.pt", "best.pt.skipped", "step_00000005.pt", "step_00000006.pt.skipped", "step_00000007.pt"]
    assert len((checkpoints / "step_00000006.pt.skipped").read_bytes()) == 1000  # kept as it was, not deleted
    assert os.path.samefile(checkpoints / "best.pt", checkpoints / "step_00000007.pt")  # the new run's best


def test_tensorboard_has_scalars_examples_attention_images_and_hparams(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 3, "eval_every_steps": 3, "attention_figures": True}), run,
          progress=False)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    for tag in ("train/loss", "train/grad_norm", "train/lr", "train/perf/tgt_tokens_per_s",
                "train/perf/src_tokens_per_s", "train/perf/src_padding_efficiency",
                "train/perf/tgt_padding_efficiency", "valid/loss", "valid/perplexity",
                "valid/bleu", "valid/chrf", "valid/chrf++", "valid/ter", "valid_diag/copies", "valid_diag/untranslated",
                "valid_diag/wrong_script", "valid_diag/loops", "valid_diag/length_outliers", "valid_diag/numbers",
                "valid_diag/urls", "valid_diag/punctuation", "valid_diag/chrf_source_words_1-5"):
        assert tag in tags["scalars"], tag
    assert "train/perf/mfu" not in tags["scalars"]  # no MFU on a CPU: there is no peak to divide by
    for side in ("src", "tgt"):
        assert all(0 < e.value <= 1 for e in events.Scalars(f"train/perf/{side}_padding_efficiency"))
    assert "valid/examples/text_summary" in tags["tensors"]
    # tiny_config has 2 decoder layers and train.attention_layer 0: the first and the last.
    assert set(tags["images"]) == {"valid/attention_layer_1", "valid/attention_layer_2"}
    image = events.Images("valid/attention_layer_2")[0]
    assert image.step == 3 and image.encoded_image_string.startswith(b"\x89PNG")

    # One run in TensorBoard: the HParams session is in the run's own events, beside its metrics' scalars.
    assert [path.name for path in (run / "tensorboard").iterdir() if not path.is_file()] == []
    hparams = events.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"} <= set(hparams)
    assert b"valid/bleu" in hparams["_hparams_/experiment"] and b"valid/best_bleu" in hparams["_hparams_/experiment"]
    assert [e.step for e in events.Scalars("valid/best_bleu")] == [3]
    # The scalars are grouped by the name before the first "/", in alphabetical order: train/, valid/, then
    # valid_diag/ (TensorBoard opens on the losses, not on the diagnostics).
    assert sorted({tag.split("/")[0] for tag in tags["scalars"]}) == ["train", "valid", "valid_diag"]


def test_early_stopping_after_patience_validations_without_a_better_bleu(tiny_corpus: Path, tmp_path: Path,
                                                                        monkeypatch):
    scores = iter([5.0, 7.0, 6.0, 7.0, 1.0, 2.0, 3.0, 4.0])
    monkeypatch.setattr(Trainer, "validate", lambda self, writer: {"bleu": next(scores)})
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 8, "eval_every_steps": 1, "save_every_steps": 100,
                                          "patience": 2})
    state = train(cfg, run, progress=False)
    # Best 7.0 at step 2; steps 3 and 4 do not beat it (equal is not better): stop after step 4.
    assert (state.step, state.best_step, state.stopped_early) == (4, 2, True)
    assert load_checkpoint(run / "checkpoints" / "step_00000004.pt")["train_state"]["stopped_early"]

    prepare_run_dir(run, resume=True, overwrite=False)
    assert train(cfg, run, resume=True, progress=False).step == 4  # still out of patience: nothing to do
    no_patience = tiny_config(tiny_corpus, train={"max_steps": 8, "eval_every_steps": 1, "save_every_steps": 100})
    state = train(no_patience, run, resume=True, progress=False)
    assert (state.step, state.stopped_early) == (8, False)


# Each metric's best validation is at another step; patience 2 stops two validations after it.
VALIDATIONS = {"bleu": [1, 5, 4, 3, 2, 2], "chrf": [1, 2, 6, 5, 4, 0], "chrf++": [9, 1, 1, 1, 1, 1],
               "loss": [3, 2, 1.5, 1.0, 1.2, 1.3]}


@pytest.mark.parametrize("metric, best_step, stop_step", [("bleu", 2, 4), ("chrf", 3, 5), ("chrf++", 1, 3),
                                                          ("loss", 4, 6)])
def test_train_best_metric_chooses_best_pt_patience_and_the_final_test(metric, best_step, stop_step, tiny_corpus,
                                                                         tmp_path: Path, monkeypatch):
    rows = iter([{name: values[i] for name, values in VALIDATIONS.items()} for i in range(6)])
    monkeypatch.setattr(Trainer, "validate", lambda self, writer: next(rows))
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 6, "eval_every_steps": 1, "save_every_steps": 100,
                                          "patience": 2, "best_metric": metric})
    state = train(cfg, run, progress=False)
    assert (state.step, state.best_step, state.best_metric) == (stop_step, best_step, metric)
    assert state.best_value == VALIDATIONS[metric][best_step - 1] and state.best_bleu == VALIDATIONS["bleu"][best_step - 1]
    assert load_checkpoint(run / "checkpoints" / "best.pt")["train_state"]["step"] == best_step
    report = json.loads((run / "evaluation" / "test_scores.json").read_text())
    assert report["checkpoint"] == "best.pt" and report["checkpoint_steps"] == [best_step]


class ScriptedComet(types.ModuleType):
    """The comet package, whose model gives each call the next of `scores` (a stand-in for COMET's
    scores) and records what it was asked to score, on which devices, and where it was moved."""

    def __init__(self, scores: list[float]):
        super().__init__("comet")
        self.scores, self.calls, self.moves = iter(scores), [], []

    @staticmethod
    def download_model(name):
        raise ConnectionError(f"Cannot reach https://huggingface.co/{name}: offline")

    def load_from_checkpoint(self, path):
        package = self

        class Model:
            def predict(self, data, batch_size, gpus, devices, progress_bar):
                package.calls.append((data, gpus, devices))
                value = next(package.scores)
                return types.SimpleNamespace(system_score=value, scores=[value] * len(data))

            def to(self, device):
                package.moves.append(device)
                return self

        return Model()


def test_train_valid_comet_scores_each_validation_and_best_metric_comet_chooses_best_pt(tiny_corpus: Path,
                                                                                      tmp_path: Path, monkeypatch):
    comet = ScriptedComet([0.2, 0.7, 0.4])
    monkeypatch.setitem(sys.modules, "comet", comet)
    checkpoint = tmp_path / "comet-model" / "checkpoints" / "model.ckpt"  # a folder as COMET downloads them
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 3, "eval_every_steps": 1, "save_every_steps": 100,
                                          "valid_comet": str(tmp_path / "comet-model"), "best_metric": "comet"})
    state = train(cfg, run, progress=False)
    assert (state.best_step, state.best_metric, state.best_value) == (2, "comet", 0.7)
    assert load_checkpoint(run / "checkpoints" / "best.pt")["train_state"]["step"] == 2
    assert read_scalars(run, "valid/comet") == pytest.approx({1: 0.2, 2: 0.7, 3: 0.4})
    assert state.last_valid["comet"] == 0.4
    references = [tgt for _, tgt in TINY_PAIRS[:4]][:len(comet.calls[0][0])]
    for step, (data, gpus, devices) in enumerate(comet.calls, start=1):  # the validation's own translations
        hypotheses = RunDir(run).validation_hypotheses(step).read_text(encoding="utf-8").split("\n")[:-1]
        assert [row["mt"] for row in data] == hypotheses and (gpus, devices) == (0, None)
        assert sorted(row["ref"] for row in data) == sorted(references)
    assert comet.moves == ["cpu"] * 3  # back to the CPU after each validation


def test_every_new_best_is_also_a_step_checkpoint_so_a_resume_never_starts_before_it(tiny_corpus: Path,
                                                                                       tmp_path: Path, monkeypatch):
    scores = iter([5.0, 1.0, 1.0, 50.0, 1.0])
    monkeypatch.setattr(Trainer, "validate", lambda self, writer: {"bleu": next(scores)})
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 5, "eval_every_steps": 1, "save_every_steps": 3,
                                          "keep_last": 10, "test_at_end": False})
    train(cfg, run, progress=False)
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*.pt")) == [  # bests at 1 and 4, saves at 3 and 5
        "step_00000001.pt", "step_00000003.pt", "step_00000004.pt", "step_00000005.pt"]
    assert (checkpoints / "best.pt").samefile(checkpoints / "step_00000004.pt")


def test_a_run_that_died_in_its_final_test_is_tested_by_resume(tiny_corpus: Path, tmp_path: Path, monkeypatch):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 3})

    def interrupted(self):
        raise KeyboardInterrupt  # Ctrl-C, or out of memory in beam search

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "final_test", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, run, progress=False)
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert not (run / "evaluation").exists()

    train(cfg, run, resume=True, progress=False)  # nothing left to train: only the test
    summary = json.loads((run / "summary.json").read_text())
    scores = json.loads((run / "evaluation" / "test_scores.json").read_text())
    assert summary["status"] == "finished" and summary["test"] == scores and summary["step"] == 3

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "final_test", interrupted)  # tested already: a resume does not test again
        train(cfg, run, resume=True, progress=False)
    assert json.loads((run / "summary.json").read_text())["test"] == scores

    longer = tiny_config(tiny_corpus, train={"max_steps": 4})  # trained further, then died in its test:
    with monkeypatch.context() as patch:                       # the step-3 scores are not its test
        patch.setattr(Trainer, "final_test", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(longer, run, resume=True, progress=False)
    train(longer, run, resume=True, progress=False)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["test"]["step"] == 4
    assert json.loads((run / "evaluation" / "test_scores.json").read_text())["step"] == 4


def test_a_finished_run_resumed_with_another_average_or_bleu_tokenizer_is_tested_again(tiny_corpus: Path,
                                                                                      tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    settings = {"max_steps": 4, "save_every_steps": 2, "keep_last": 3}
    train(tiny_config(tiny_corpus, train=settings), run, progress=False)
    first = json.loads((run / "evaluation" / "test_scores.json").read_text())
    assert first["checkpoint"] == "best.pt"

    train(tiny_config(tiny_corpus, train={**settings, "average_last": 2}), run, resume=True, progress=False)
    averaged = json.loads((run / "evaluation" / "test_scores.json").read_text())
    assert averaged["checkpoint"] == "average_steps_00000003-00000004.pt" and averaged["checkpoint_steps"] == [3, 4]

    train(tiny_config(tiny_corpus, train={**settings, "average_last": 2, "bleu_tokenize": "char"}), run,
          resume=True, progress=False)
    rescored = json.loads((run / "evaluation" / "test_scores.json").read_text())
    assert "|tok:char|" in rescored["bleu_signature"] and rescored["checkpoint"] == averaged["checkpoint"]
    assert json.loads((run / "summary.json").read_text())["test"] == rescored


def test_a_run_resumed_with_train_max_steps_below_its_step_is_refused_and_left_as_it_was(tiny_corpus: Path,
                                                                                           tmp_path: Path):
    """It used to be tested again and recorded as finished at "4/2" steps, its config rewritten."""
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 4, "save_every_steps": 2}), run, progress=False)
    before = {name: (run / name).read_bytes() for name in ("summary.json", "config.yaml", "evaluation/test_scores.json")}
    with pytest.raises(ConfigError) as refused:
        train(tiny_config(tiny_corpus, train={"max_steps": 2, "save_every_steps": 2}), run, resume=True,
              progress=False)
    assert refused.value.problems == ["train.max_steps: 2 is below the run's step 4; a run cannot be shortened "
                                      "(its checkpoints are there for tmt average and evaluate); resume with "
                                      "--set train.max_steps=4 or more"]
    assert {name: (run / name).read_bytes() for name in before} == before
    train(tiny_config(tiny_corpus, train={"max_steps": 4, "save_every_steps": 2}), run, resume=True, progress=False)


def test_a_summary_that_cannot_be_written_does_not_hide_the_error_that_stopped_the_run(tiny_corpus: Path,
                                                                                      tmp_path: Path, monkeypatch):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)

    def disk_full_at_the_first_checkpoint(self):
        monkeypatch.setattr(summary_module, "write_summary", no_space)
        raise CheckpointError("step_00000003.pt: could not write checkpoint (No space left on device)")

    def no_space(run_dir, summary):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Trainer, "run", disk_full_at_the_first_checkpoint)
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
        train(tiny_config(tiny_corpus), run, progress=False)


@pytest.mark.parametrize("average_last, averaged", [(0, None), (2, [3, 4]), (5, [2, 3, 4])])
def test_training_ends_by_scoring_the_test_split_with_beam_search(average_last, averaged, tiny_corpus: Path,
                                                                   tmp_path: Path, monkeypatch, capsys, caplog):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 4, "save_every_steps": 2, "average_last": average_last,
                                          "keep_last": max(3, average_last)}, decode={"beam_size": 3})
    with caplog.at_level("WARNING", logger="transformer_mt.train.validation"):
        train(cfg, run, progress=False)
    report = json.loads((run / "evaluation" / "test_scores.json").read_text())
    # Saves at steps 2 and 4; the first validation, at step 3, is a new best and so a step checkpoint too.
    expected = f"average_steps_{averaged[0]:08d}-00000004.pt" if average_last else "best.pt"
    assert report["checkpoint"] == expected and (run / "checkpoints" / expected).is_file()
    best_step = json.loads((run / "summary.json").read_text())["best_step"]
    assert report["checkpoint_steps"] == (averaged or [best_step]) and report["step"] == 4
    # Fewer checkpoints on disk than train.average_last: an average of fewer, and a warning that says so.
    assert ("the run has only 3 step checkpoint(s)" in caplog.text) == (average_last == 5)
    assert report["sentences"] == 2 and report["beam_size"] == 3
    assert "tok:13a" in report["bleu_signature"] and "nc:6" in report["chrf_signature"]
    hypotheses = run / "evaluation" / report["hypotheses"]
    assert hypotheses.name == f"test.{Path(expected).stem}.beam3.txt"
    written = hypotheses.read_text("utf-8")
    assert len(written.splitlines()) == 2
    # Scoring best.pt afterwards (same split, same beam) leaves the reported hypotheses alone.
    code, out, err = run_cli(["evaluate", "--run", str(run), "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0 and out.startswith("BLEU = "), err
    assert (run / "evaluation" / "test.best.beam3.txt").is_file() and hypotheses.read_text("utf-8") == written


def test_a_run_directory_that_cannot_be_created_is_a_usage_error(tmp_path: Path):
    (tmp_path / "file").write_text("not a folder", encoding="utf-8")
    with pytest.raises(UsageError, match="cannot create the run directory"):
        prepare_run_dir(tmp_path / "file" / "run", resume=False, overwrite=False)


def test_a_resume_with_changed_settings_says_so_before_the_work_starts(tiny_corpus: Path, tmp_path: Path, caplog):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 3}), run, progress=False)
    with caplog.at_level("INFO", logger="transformer_mt"):
        train(tiny_config(tiny_corpus, train={"max_steps": 6, "lr": 2e-3}), run, resume=True, progress=False)
    messages = [(record.levelname, record.getMessage()) for record in caplog.records]
    first = messages[0]
    assert first == ("WARNING", "resuming with settings that differ from the run's config.yaml: "
                                "train.lr: 0.001 -> 0.002; train.max_steps: 3 -> 6"), messages[:3]
