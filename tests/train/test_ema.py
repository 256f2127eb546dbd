"""train.ema_decay: the weights' exponential moving average, its resume, validation, final test and use."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import stop_at_first_validation, tiny_config
from transformer_mt.config.loading import config_from_dict
from transformer_mt.core.errors import ConfigError
from transformer_mt.decode.translator import Translator
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.ema import WeightEMA
from transformer_mt.train.step import StepResult, TrainStep
from transformer_mt.train.trainer import Trainer, train


def test_ema_decay_must_lie_in_zero_to_one():
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError) as err:
            config_from_dict({"data": {"path": "x"}, "train": {"ema_decay": bad}})
        assert err.value.problems == [f"train.ema_decay: must be in [0, 1) (0 = no EMA; 0.999 or 0.9999 are usual), "
                                      f"got {bad}"]
    assert config_from_dict({"data": {"path": "x"}}).train.ema_decay == 0.0  # off by default


def test_the_decay_warms_up_and_each_update_is_the_plain_weighted_mean():
    # d_n = min(decay, (1 + n) / (10 + n)): 2/11 at the first update, 0.5 at n = 8, then the cap 0.6.
    trained = nn.Linear(3, 2)
    ema = WeightEMA(trained, 0.6)
    assert [ema.decay_at(n) for n in (1, 8, 20)] == [2 / 11, 0.5, 0.6]
    expected = [p.detach().clone() for p in trained.parameters()]
    for n in range(1, 4):
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        d = min(0.6, (1 + n) / (10 + n))
        expected = [d * e + (1 - d) * p.detach() for e, p in zip(expected, trained.parameters())]
        for average, plain in zip(ema.model.parameters(), expected):  # the fused lerp, the plain formula
            torch.testing.assert_close(average, plain, rtol=1e-6, atol=1e-7)
    assert ema.updates == 3 and not any(p.requires_grad for p in ema.model.parameters())


def ema_run(tiny_corpus: Path, **train_settings):
    return tiny_config(tiny_corpus, train={"max_steps": 8, "eval_every_steps": 4, "save_every_steps": 4,
                                           "ema_decay": 0.9, **train_settings})


def test_a_resumed_run_ends_with_the_uninterrupted_runs_ema(tiny_corpus: Path, tmp_path: Path, monkeypatch):
    cfg = ema_run(tiny_corpus)
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(cfg, straight, progress=False)
    stop_at_first_validation(cfg, interrupted, monkeypatch)  # at step 4's validation: a checkpoint at 4
    assert load_checkpoint(interrupted / "checkpoints" / "step_00000004.pt")["ema"]["updates"] == 4
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    train(cfg, interrupted, resume=True, progress=False)

    a = load_checkpoint(straight / "checkpoints" / "step_00000008.pt")
    b = load_checkpoint(interrupted / "checkpoints" / "step_00000008.pt")
    assert a["ema"]["updates"] == b["ema"]["updates"] == 8
    for name, tensor in a["ema"]["model"].items():
        assert torch.equal(tensor, b["ema"]["model"][name]), name
        assert tensor.dtype == torch.float32
    assert any(not torch.equal(tensor, a["model"][name]) for name, tensor in a["ema"]["model"].items())


def test_a_skipped_update_leaves_the_ema_alone(tiny_corpus: Path, tmp_path: Path, monkeypatch):
    run_or_skip, calls = TrainStep.run_or_skip, []

    def nonfinite_second(self, batches, step_tgt_tokens, while_device_works, stop_signal):
        calls.append(1)
        if len(calls) == 2:  # as a NaN loss would: no update, the step count unchanged
            while_device_works()
            nan = torch.tensor(float("nan"))
            return StepResult(nan, nan, False)
        return run_or_skip(self, batches, step_tgt_tokens, while_device_works, stop_signal)

    monkeypatch.setattr(TrainStep, "run_or_skip", nonfinite_second)
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    state = train(ema_run(tiny_corpus, max_steps=3, test_at_end=False), run, progress=False)
    assert (state.step, state.skipped_nonfinite) == (3, 1)
    assert load_checkpoint(run / "checkpoints" / "step_00000003.pt")["ema"]["updates"] == 3


def test_validation_scores_the_ema_and_translate_uses_it(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    cfg = ema_run(tiny_corpus, max_steps=4, test_at_end=False)
    train(cfg, run, progress=False)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_valid"]["weights"] == "ema"

    trainer = Trainer(cfg, run, progress=False)
    trainer.checkpoint.resume()
    ckpt = load_checkpoint(run / "checkpoints" / "step_00000004.pt")
    assert trainer.evaluator.validation_loss() == pytest.approx(summary["last_valid"]["loss"], abs=1e-4)
    trainer.evaluator.model.load_state_dict(ckpt["model"])  # the trained weights score otherwise
    assert trainer.evaluator.validation_loss() != pytest.approx(summary["last_valid"]["loss"], abs=1e-4)

    translator = Translator.from_run(run, device="cpu", engine="torch")  # best.pt: its EMA weights
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    for name, tensor in translator.engine.model.state_dict().items():
        assert torch.equal(tensor, best["ema"]["model"][name]), name


def test_the_final_test_scores_the_average_and_the_ema_side_by_side(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(ema_run(tiny_corpus, max_steps=4, save_every_steps=2, average_last=2), run, progress=False)
    report = json.loads((run / "evaluation" / "test_scores.json").read_text())
    assert (report["checkpoint"], report["weights"]) == ("average_steps_00000002-00000004.pt", "model")
    ema = report["ema"]
    assert (ema["checkpoint"], ema["weights"], ema["checkpoint_steps"]) == ("best.pt", "ema", [4])
    assert (run / "evaluation" / ema["hypotheses"]).is_file() and "bleu" in ema
    assert json.loads((run / "summary.json").read_text())["test"] == report
    averaged = load_checkpoint(run / "checkpoints" / report["checkpoint"])
    assert "ema" not in averaged  # an average of the trained weights


def test_ema_turned_on_at_a_resume_starts_from_the_resumed_weights(tiny_corpus: Path, tmp_path: Path, caplog):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 3, "test_at_end": False}), run, progress=False)
    trainer = Trainer(ema_run(tiny_corpus), run, progress=False)
    with caplog.at_level("INFO", logger="transformer_mt"):
        trainer.checkpoint.resume()
    assert "holds no EMA of the weights: it starts from the weights of step 3" in caplog.text
    assert trainer.ema.updates == 0
    for average, trained in zip(trainer.ema.model.parameters(), trainer.model.parameters()):
        assert torch.equal(average, trained)


def test_the_ema_leaves_training_itself_alone(tiny_corpus: Path, tmp_path: Path):
    """The average is read from the trained weights, never written back, and draws no random numbers:
    a run with an EMA trains the same weights, update by update, as the run without."""
    runs = {}
    for decay in (0.0, 0.9):
        runs[decay] = tmp_path / f"ema{decay}"
        prepare_run_dir(runs[decay], resume=False, overwrite=False)
        train(ema_run(tiny_corpus, ema_decay=decay), runs[decay], progress=False)
    plain, with_ema = (load_checkpoint(runs[d] / "checkpoints" / "step_00000008.pt") for d in (0.0, 0.9))
    for name, tensor in plain["model"].items():
        assert torch.equal(tensor, with_ema["model"][name]), name
