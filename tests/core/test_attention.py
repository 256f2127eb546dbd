"""The attention kernels are chosen per use (`train.attention_backend`, `decode.attention_backend`),
entered where attention runs, never cuDNN's by default on CUDA, and always end in math."""

import logging
import typing
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from tests.helpers import (BOS, EOS, TINY_PAIRS, make_trainer, random_model, random_sources, run_cli, tiny_config,
                           write_corpus)
from transformer_mt.config.loading import config_from_dict
from transformer_mt.config.schema import DecodeConfig, TrainConfig
from transformer_mt.core import runtime
from transformer_mt.core.errors import ConfigError
from transformer_mt.core.runtime import AttentionKernels, attention_fallback, pick_attention, pick_precision
from transformer_mt.decode.torch_engine import translate_ids
from transformer_mt.decode.translator import Translator
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.trainer import train

CHOICES = typing.get_args(typing.get_type_hints(TrainConfig)["attention_backend"])
CPU = torch.device("cpu")


def enabled_kernels() -> tuple[bool, bool, bool, bool]:
    """Which SDPA kernels may run now: flash, memory-efficient, cuDNN, math (global flags, also on a CPU)."""
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled()


MATH_ONLY = (False, False, False, True)


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[tuple[bool, bool, bool, bool]]:
    """The kernels enabled at each `F.scaled_dot_product_attention` call the model makes."""
    calls = []
    original = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(enabled_kernels())
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


@pytest.fixture
def an_h100(monkeypatch):
    """`pick_attention` on a CUDA device of compute capability 9.0 with cuDNN (no GPU is used)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    return torch.device("cuda")


# --- the config keys ---------------------------------------------------------------------------

def test_both_keys_offer_the_same_choices_and_a_wrong_one_is_named_with_them():
    assert CHOICES == typing.get_args(typing.get_type_hints(DecodeConfig)["attention_backend"])
    assert set(CHOICES) == {"auto", *runtime._CHOSEN}  # every choice has its kernels
    cfg = config_from_dict({"data": {"path": "x"}, "train": {"attention_backend": "math"},
                            "decode": {"attention_backend": "cudnn"}})
    assert (cfg.train.attention_backend, cfg.decode.attention_backend) == ("math", "cudnn")
    with pytest.raises(ConfigError) as err:
        config_from_dict({"data": {"path": "x"}, "train": {"attention_backend": "flash2"},
                          "decode": {"attention_backend": None}})
    assert err.value.problems == [
        "train.attention_backend: 'flash2' (str) is not one of auto, flash, efficient, cudnn, math",
        "decode.attention_backend: None (NoneType) is not one of auto, flash, efficient, cudnn, math"]


# --- what each choice enables ------------------------------------------------------------------

def test_auto_on_cuda_never_enables_cudnn_and_puts_the_measured_best_kernel_first(an_h100):
    train_kernels = pick_attention("auto", an_h100, "train").backends
    decode_kernels = pick_attention("auto", an_h100, "decode").backends
    assert train_kernels == (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)
    assert decode_kernels == (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


@pytest.mark.parametrize("use", ["train", "decode"])
@pytest.mark.parametrize("choice", CHOICES)
def test_every_choice_on_cuda_keeps_math_last_so_any_input_has_a_kernel(choice, use, an_h100):
    kernels = pick_attention(choice, an_h100, use).backends
    assert kernels[-1] == SDPBackend.MATH
    assert attention_fallback(choice, an_h100) is None
    if choice not in ("auto", "math"):
        assert kernels[0].name.lower().startswith(choice)  # FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION


def test_flash_or_cudnn_on_a_gpu_older_than_ampere_falls_back_to_auto_saying_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    cuda = torch.device("cuda")
    for choice in ("flash", "cudnn"):
        assert "compute capability 8.0 or later, this one is 7.5" in attention_fallback(choice, cuda)
        assert pick_attention(choice, cuda, "decode") == pick_attention("auto", cuda, "decode")
    assert attention_fallback("efficient", cuda) is None


def test_on_a_cpu_auto_leaves_pytorch_its_choice_and_math_is_honoured():
    before = enabled_kernels()
    assert pick_attention("auto", CPU, "train") == AttentionKernels(())
    with pick_attention("auto", CPU, "train").enabled():
        assert enabled_kernels() == before
    with pick_attention("math", CPU, "train").enabled():
        assert enabled_kernels() == MATH_ONLY
    assert enabled_kernels() == before  # restored on exit
    for choice in ("flash", "efficient", "cudnn"):
        assert "is a CUDA kernel" in attention_fallback(choice, CPU)
        assert pick_attention(choice, CPU, "decode") == AttentionKernels(())


def test_the_listed_kernels_are_the_only_ones_enabled_inside(an_h100):
    with pick_attention("auto", an_h100, "train").enabled():
        assert enabled_kernels() == (True, True, False, True)
    with pick_attention("cudnn", an_h100, "decode").enabled():
        assert enabled_kernels() == (False, False, True, True)


# --- entered where attention runs --------------------------------------------------------------

def test_a_training_step_and_the_validation_loss_run_attention_on_the_trains_kernels(tiny_corpus: Path,
                                                                                     tmp_path: Path, sdpa_calls):
    trainer = make_trainer(tiny_corpus, tmp_path / "run", attention_backend="math")
    trainer.train_step.run(trainer.train_step.batches.load(list(range(8))))
    trainer.evaluator.validation_loss()
    # forward of encoder self-, decoder self- and cross-attention in 2 layers, then the validation batches
    assert len(sdpa_calls) >= 6 and set(sdpa_calls) == {MATH_ONLY}


def test_decoding_runs_attention_on_the_decode_kernels(sdpa_calls):
    model, src = random_model(0), random_sources(0)
    seqs = [[t for t in row if t not in (0, EOS)] for row in src.tolist()]
    for beam in (1, 3):
        translate_ids(model, seqs, DecodeConfig(attention_backend="math"), bos_id=BOS, eos_id=EOS, device=CPU,
                      precision=pick_precision("fp32", CPU), beam_size=beam)
    assert len(sdpa_calls) > 10 and set(sdpa_calls) == {MATH_ONLY}


# --- a choice the CPU cannot run: one warning, auto's results ----------------------------------

@pytest.mark.parametrize("choice", ["cudnn", "flash", "efficient", "math"])
def test_training_with_a_named_kernel_on_a_cpu_computes_the_loss_of_auto(choice, tiny_corpus: Path, tmp_path: Path,
                                                                         caplog):
    auto = make_trainer(tiny_corpus, tmp_path / "auto")
    with caplog.at_level(logging.WARNING, logger="transformer_mt"):
        named = make_trainer(tiny_corpus, tmp_path / "named", attention_backend=choice)
    warnings = [r.getMessage() for r in caplog.records if "attention_backend" in r.getMessage()]
    assert warnings == ([] if choice == "math" else
                        [f"train.attention_backend: {choice} is a CUDA kernel; on cpu PyTorch picks the attention "
                         "kernel itself (as with auto)"])
    indices = list(range(8))
    expected = auto.train_step.run(auto.train_step.batches.load(indices))
    got = named.train_step.run(named.train_step.batches.load(indices))
    if choice == "math":  # PyTorch's CPU flash kernel sums in another order than math: rounding apart
        assert got.loss.item() == pytest.approx(expected.loss.item(), rel=1e-6)
        assert got.grad_norm.item() == pytest.approx(expected.grad_norm.item(), rel=1e-5)
    else:  # the fallback is auto itself
        assert torch.equal(got.loss, expected.loss) and torch.equal(got.grad_norm, expected.grad_norm)


@pytest.fixture(scope="module")
def cudnn_run(tmp_path_factory) -> Path:
    """A tiny run trained on the CPU whose config asks for cuDNN attention in decoding."""
    tmp = tmp_path_factory.mktemp("cudnn_run")
    corpus = write_corpus(tmp / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    run_dir = tmp / "run"
    prepare_run_dir(run_dir, resume=False, overwrite=False)
    cfg = tiny_config(corpus, train={"max_steps": 30, "eval_every_steps": 30, "save_every_steps": 30,
                                     "test_at_end": False, "lr": 3e-3},
                      decode={"attention_backend": "cudnn"})
    train(cfg, run_dir, progress=False)
    return run_dir


def test_tmt_translate_with_cudnn_asked_on_a_cpu_warns_once_and_translates_as_auto(cudnn_run: Path, monkeypatch,
                                                                                     capsys):
    lines = [src for src, _ in TINY_PAIRS]
    code, out, err = run_cli(["translate", "--run", str(cudnn_run), "--device", "cpu", "--engine", "torch", "--beam", "2",
                              *lines],
                             monkeypatch, capsys, cudnn_run.parent)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "attention_backend" in line]
    assert len(warnings) == 1 and "decode.attention_backend: cudnn is a CUDA kernel; on cpu" in warnings[0]
    translator = Translator.from_run(cudnn_run, device="cpu", engine="torch")
    translator.set_decoding(attention_backend="auto")
    assert out.splitlines() == translator.translate(lines, beam_size=2)
