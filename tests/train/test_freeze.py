"""train.freeze: parts of the model that are not trained: no gradient, no optimizer state, the same
weights bit for bit, kept on resume."""

import re
from pathlib import Path

import pytest
import torch

from tests.helpers import run_cli, tiny_config
from transformer_mt.config.loading import config_from_dict, load_config, save_config
from transformer_mt.config.schema import config_to_dict
from transformer_mt.core.errors import ConfigError
from transformer_mt.data.report import FrozenParts
from transformer_mt.model.transformer import build_model
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.run_dir import check_saved_config, prepare_run_dir
from transformer_mt.train import step as train_step_module
from transformer_mt.train.trainer import Trainer, train


def frozen_trainer(tiny_corpus: Path, run: Path, freeze: list[str], model: dict | None = None, **train_options):
    cfg = tiny_config(tiny_corpus, model=model or {}, train={"freeze": freeze, "max_steps": 4, **train_options})
    prepare_run_dir(run, resume=False, overwrite=False)
    return Trainer(cfg, run, progress=False)


@pytest.mark.parametrize(("freeze", "model", "frozen_prefixes"), [
    (["embeddings"], {}, ["src_embed."]),  # shared source and target tables, and the tied output
    (["encoder"], {}, ["encoder_layers.", "encoder_norm."]),
    (["encoder.layers.0-1", "decoder.layers.1"], {}, ["encoder_layers.0.", "encoder_layers.1.", "decoder_layers.1."]),
    (["output"], {"tie_output": False, "output_bias": True}, ["output_proj."]),
])
def test_frozen_parameters_stay_bit_identical_and_have_no_gradient_or_optimizer_state(
        tiny_corpus: Path, tmp_path: Path, caplog, freeze, model, frozen_prefixes):
    trainer = frozen_trainer(tiny_corpus, tmp_path / "run", freeze, model, ema_decay=0.9)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with caplog.at_level("INFO", logger="transformer_mt"):
        trainer.run()
    frozen = {name for name in before if name.startswith(tuple(frozen_prefixes))}
    assert frozen
    params = dict(trainer.model.named_parameters())
    for name, tensor in before.items():
        if name in frozen:
            assert torch.equal(params[name], tensor) and not params[name].requires_grad, name
            assert params[name].grad is None and params[name] not in trainer.train_step.optimizer.state, name
            assert torch.equal(dict(trainer.ema.model.named_parameters())[name], tensor), name  # the average too
        else:
            assert not torch.equal(params[name], tensor), name
            assert params[name] in trainer.train_step.optimizer.state, name
    n_frozen = sum(before[name].numel() for name in frozen)
    total = trainer.model.num_parameters()
    assert f"train.freeze {', '.join(freeze)}: {n_frozen:,} of the {total:,} parameters frozen, " \
           f"{total - n_frozen:,} trained" in caplog.text
    # The data report, logged before the first step, says so too (counted on a model without memory).
    report = trainer.data_report
    assert report.frozen == FrozenParts(tuple(freeze), n_frozen, total)
    assert report.to_dict()["frozen"] == {"parts": tuple(freeze), "parameters": n_frozen, "total": total}
    shown = f"{', '.join(freeze)}: {n_frozen:,} of {total:,} parameters ({100 * n_frozen / total:.1f}%), " \
            f"{total - n_frozen:,} trained"
    assert re.search(rf"^frozen \(train\.freeze\) +{re.escape(shown)}$", report.render(), re.M)


def test_a_frozen_run_resumes_exactly_and_may_not_change_what_is_frozen(tiny_corpus: Path, tmp_path: Path):
    options = {"freeze": ["decoder", "embeddings"], "eval_every_steps": 4, "save_every_steps": 3}
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={**options, "max_steps": 6}), straight, progress=False)
    prepare_run_dir(interrupted, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={**options, "max_steps": 3}), interrupted, progress=False)
    assert len(load_checkpoint(interrupted / "checkpoints" / "step_00000003.pt")["optimizer"]["state"]) == \
        len([name for name, _ in Trainer(tiny_config(tiny_corpus, train=options), tmp_path / "scratch",
                                         progress=False).model.named_parameters()
             if name.startswith(("encoder_layers.", "encoder_norm."))])  # the trained parameters' state only

    changed = tiny_config(tiny_corpus, train={**options, "max_steps": 6, "freeze": ["decoder"]})
    with pytest.raises(ConfigError) as err:
        check_saved_config(changed, interrupted)  # what `tmt train --resume` checks first
    assert err.value.problems[1:] == ["train.freeze: ['decoder', 'embeddings'] -> ['decoder']"]
    reordered = tiny_config(tiny_corpus, train={**options, "max_steps": 6, "freeze": ["embeddings", "decoder"]})
    assert not [line for line in check_saved_config(reordered, interrupted) if "freeze" in line]  # the same parts

    prepare_run_dir(interrupted, resume=True, overwrite=False)
    train(tiny_config(tiny_corpus, train={**options, "max_steps": 6}), interrupted, resume=True, progress=False)
    a = load_checkpoint(straight / "checkpoints" / "step_00000006.pt")
    b = load_checkpoint(interrupted / "checkpoints" / "step_00000006.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], b["optimizer"]["state"][index]["exp_avg"]), index


def test_tmt_data_names_what_train_freeze_freezes_and_refuses_to_freeze_everything(tiny_corpus: Path,
                                                                                    tmp_path: Path, monkeypatch, capsys):
    config = tmp_path / "frozen.yaml"
    save_config(tiny_config(tiny_corpus, train={"freeze": ["encoder"]}), config)
    code, out, err = run_cli(["data", "--config", str(config), "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    encoder = sum(p.numel() for name, p in build_model(load_config(config).model, 8, 8, 0).named_parameters()
                  if name.startswith(("encoder_layers.", "encoder_norm.")))  # no embedding: any vocabulary's
    assert re.search(rf"^frozen \(train\.freeze\) +encoder: {encoder:,} of [\d,]+ parameters \(\d+\.\d%\), "
                     r"[\d,]+ trained$", out, re.M), out
    save_config(tiny_config(tiny_corpus, train={"freeze": ["embeddings", "encoder", "decoder"]}), config)
    code, out, err = run_cli(["data", "--config", str(config), "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 2 and not out and "freezes every parameter of the model; nothing would be trained" in err


def test_unknown_or_impossible_freeze_names_are_refused_with_did_you_mean(tiny_corpus: Path):
    raw = config_to_dict(tiny_config(tiny_corpus))
    raw["train"]["freeze"] = ["embedding", "encoder.layers.2", "decoder.layers.1-0", "decoder.layer.0", "encoder"]
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert err.value.problems == [
        "train.freeze: 'embedding' is not a part of the model (did you mean 'embeddings'?)",
        "train.freeze: 'encoder.layers.2': the encoder has layers 0-1",
        "train.freeze: 'decoder.layers.1-0': a range goes from the lower layer to the higher, e.g. decoder.layers.0-1",
        "train.freeze: 'decoder.layer.0' is not a part of the model (did you mean 'decoder.layers.0'?)"]
    raw["train"]["freeze"] = "encoder"
    with pytest.raises(ConfigError, match=r"train.freeze: expected a list"):
        config_from_dict(raw)


def test_freezing_every_parameter_is_refused_and_leaves_no_run_behind(tiny_corpus: Path, tmp_path: Path,
                                                                      monkeypatch, capsys):
    """The output projection is tied to the embeddings: with them, the encoder and the decoder, nothing is left."""
    config = tmp_path / "tiny.yaml"
    save_config(tiny_config(tiny_corpus, train={"freeze": ["embeddings", "encoder", "decoder"]}), config)
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--quiet"],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and not (tmp_path / "run").exists()
    assert err.endswith("tmt: error: invalid configuration: train.freeze: embeddings, encoder, decoder freezes every "
                        "parameter of the model; nothing would be trained\n")
    # Found before the run directory is claimed: --overwrite of a run there deletes nothing.
    save_config(tiny_config(tiny_corpus, train={"max_steps": 2, "eval_every_steps": 2, "save_every_steps": 2}),
                tmp_path / "plain.yaml")
    code, _, err = run_cli(["train", "--config", str(tmp_path / "plain.yaml"), "--run-dir", str(tmp_path / "run"),
                            "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    kept = sorted(str(path.relative_to(tmp_path / "run")) for path in (tmp_path / "run").rglob("*"))
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--overwrite",
                            "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "freezes every parameter" in err
    assert sorted(str(path.relative_to(tmp_path / "run")) for path in (tmp_path / "run").rglob("*")) == kept


def test_the_gpu_engines_update_run_eagerly_trains_only_what_is_not_frozen(tiny_corpus: Path, tmp_path: Path,
                                                                          monkeypatch):
    """The captured update (`train.cuda_graphs`) differentiates, clips and steps the trainable parameters only."""
    monkeypatch.setattr(train_step_module, "graphs_apply", lambda *args, **kwargs: True)  # its path, on the CPU
    trainer = frozen_trainer(tiny_corpus, tmp_path / "run", ["decoder", "embeddings"], clip_grad_norm=0.5)
    assert trainer.train_step.graphs is not None
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.run()
    for name, param in trainer.model.named_parameters():
        frozen = name.startswith(("src_embed.", "decoder_layers.", "decoder_norm."))
        assert torch.equal(param, before[name]) == frozen, name
        assert (param in trainer.train_step.optimizer.state) != frozen, name
