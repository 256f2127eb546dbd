"""Training's speed paths compute what the plain ones do: packing, accumulation, padding, bucketing, FLOPs."""

import dataclasses
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.helpers import REPO, TINY_PAIRS, make_trainer, tiny_config
from transformer_mt.config.loading import config_from_dict
from transformer_mt.config.schema import ModelConfig, TrainConfig
from transformer_mt.core.distributed import Distributed
from transformer_mt.core.errors import ConfigError
from transformer_mt.core.runtime import Precision
from transformer_mt.data.batching import Batch, make_batch, sorted_batches
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
from transformer_mt.model.transformer import Transformer
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train import interval as interval_module
from transformer_mt.train.batches import activation_bytes_per_token, device_batch_tokens, resolve_batch_tokens
from transformer_mt.train.interval import peak_flops_of, peak_flops_per_s
from transformer_mt.train.loss import StepLoss
from transformer_mt.train.trainer import Trainer


def test_two_accumulated_half_batches_make_the_same_update_as_one_batch(tiny_corpus: Path, tmp_path: Path):
    whole = make_trainer(tiny_corpus, tmp_path / "whole")
    halves = make_trainer(tiny_corpus, tmp_path / "halves", accum_steps=2)
    indices = list(range(8))
    one = whole.train_step.run(whole.train_step.batches.load(indices))
    two = halves.train_step.run([halves.train_step.batches.load(indices[:3]), halves.train_step.batches.load(indices[3:])])
    # The loss is normalised by the target tokens of both halves: the whole batch's loss per token.
    assert two.loss.item() == pytest.approx(one.loss.item(), rel=1e-5)
    assert two.grad_norm.item() == pytest.approx(one.grad_norm.item(), rel=1e-4)
    # Compare gradients, not the updated weights: Adam's first update is about lr·sign(g), so a
    # parameter whose true gradient is 0 (the key bias: softmax ignores it) moves by rounding noise.
    for (name, a), b in zip(whole.model.named_parameters(), halves.model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name


def test_a_packed_step_makes_the_update_of_a_padded_step(tiny_corpus: Path, tmp_path: Path):
    packed = make_trainer(tiny_corpus, tmp_path / "packed")
    padded = make_trainer(tiny_corpus, tmp_path / "padded")
    assert packed.train_step.pack  # the eager default on every device
    padded.train_step.pack = False  # every position, as the captured and the compiled step compute
    batch = packed.train_step.batches.load(list(range(8)))
    assert batch.n_tgt_tokens < batch.tgt_out_ids.numel()  # there is padding to skip
    one = padded.train_step.run(batch)
    two = packed.train_step.run(batch)
    assert two.loss.item() == pytest.approx(one.loss.item(), rel=1e-5)
    assert two.grad_norm.item() == pytest.approx(one.grad_norm.item(), rel=1e-4)
    for (name, a), b in zip(padded.model.named_parameters(), packed.model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name


def pairs_of(trainer: Trainer) -> tuple[list[list[int]], list[list[int]]]:
    return trainer.train_data.ids(range(len(trainer.train_data)))


@torch.no_grad()
def loss_per_token(model, batches) -> float:
    total, tokens = 0.0, 0
    for batch in batches:
        total += StepLoss(model)(batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids, 0.1, pack=False).item()
        tokens += batch.n_tgt_tokens
    return total / tokens


def test_a_bf16_step_on_the_cpu_follows_the_fp32_step(tiny_corpus: Path, tmp_path: Path):
    fp32 = make_trainer(tiny_corpus, tmp_path / "fp32", precision="fp32")
    bf16 = make_trainer(tiny_corpus, tmp_path / "bf16", precision="bf16")
    assert bf16.precision.name == "bf16" and fp32.precision.name == "fp32"
    batch = fp32.train_step.batches.load(list(range(8)))
    one, two = fp32.train_step.run(batch), bf16.train_step.run(batch)
    # bf16 keeps 8 bits of mantissa: the same loss to about 1%, gradients pointing the same way;
    # the weights and Adam's moments stay fp32 (autocast casts per product).
    assert two.loss.item() == pytest.approx(one.loss.item(), rel=0.02)
    assert two.loss.item() != one.loss.item()  # but not bit for bit: bf16 products did run
    a = torch.cat([p.grad.flatten() for p in fp32.model.parameters()])
    b = torch.cat([p.grad.flatten() for p in bf16.model.parameters()])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())


def test_training_in_bf16_on_a_cpu_without_bf16_instructions_is_warned_about(tiny_corpus: Path, tmp_path: Path,
                                                                            monkeypatch, caplog):
    from transformer_mt.core import runtime

    assert runtime.pick_precision("auto", torch.device("cpu")).name == "fp32"  # bf16 is never chosen for you
    for emulated in (True, False):
        caplog.clear()
        monkeypatch.setattr(runtime, "cpu_bf16_emulated", lambda: emulated)
        with caplog.at_level("WARNING", logger="transformer_mt.core.runtime"):
            make_trainer(tiny_corpus, tmp_path / f"run{emulated}", precision="bf16")
        assert ("emulated and may well be slower than fp32" in caplog.text) == emulated


def test_padding_to_a_multiple_of_8_does_not_change_the_loss_per_token(tiny_corpus: Path, tmp_path: Path):
    trainer = make_trainer(tiny_corpus, tmp_path / "run")
    model = trainer.model.eval()
    src, tgt = pairs_of(trainer)
    plain = make_batch(src, tgt, PAD_ID, BOS_ID, EOS_ID)
    padded = make_batch(src, tgt, PAD_ID, BOS_ID, EOS_ID, pad_to_multiple=8)
    assert padded.src_ids.shape[1] % 8 == 0 and padded.src_ids.shape[1] > plain.src_ids.shape[1]
    assert loss_per_token(model, [padded]) == pytest.approx(loss_per_token(model, [plain]), rel=1e-5)


def test_length_bucketed_batches_give_the_loss_per_token_of_one_unbucketed_batch(tiny_corpus: Path, tmp_path: Path):
    trainer = make_trainer(tiny_corpus, tmp_path / "run", batch_tokens=64)
    model = trainer.model.eval()
    data = trainer.train_data
    buckets = sorted_batches(data.lengths(), 64)
    assert len(buckets) > 1
    bucketed = [data.batch(b, pad_to_multiple=8) for b in buckets]
    src, tgt = pairs_of(trainer)
    unbucketed = make_batch(src, tgt, PAD_ID, BOS_ID, EOS_ID)
    assert loss_per_token(model, bucketed) == pytest.approx(loss_per_token(model, [unbucketed]), rel=1e-5)
    # ...and bucketing is what keeps the padding low.
    slots = lambda batches: sum(b.tgt_out_ids.numel() for b in batches)  # noqa: E731
    assert slots([data.batch(b) for b in buckets]) < slots([unbucketed])


def test_flop_formula_matches_a_hand_computation():
    cfg = ModelConfig(d_model=4, n_heads=2, n_layers=2, d_ff=8)
    train_flops = Transformer(cfg, 10, 10, pad_id=0).train_flops
    # One sentence, S = 3 source and T = 2 target tokens; V = 10.
    # encoder matmuls:  6·2·(4·16 + 2·4·8)·3 = 12·128·3 = 4608
    # decoder matmuls:  6·2·(6·16 + 2·4·8)·2 = 12·160·2 = 3840
    # cross K/V:        6·2·(2·16)·3         = 12·32·3  = 1152
    # output:           6·4·10·2                        =  480
    # attention:        12·2·4·(9 + 4 + 6)   = 96·19    = 1824
    assert train_flops([3], [2]) == 4608 + 3840 + 1152 + 480 + 1824
    # Sentences add up: two copies cost twice one.
    assert train_flops(np.array([3, 3]), np.array([2, 2])) == 2 * train_flops([3], [2])


def test_flop_formula_counts_each_side_with_its_own_depth():
    cfg = ModelConfig(d_model=4, n_heads=2, n_layers=2, encoder_layers=3, decoder_layers=1, d_ff=8)
    train_flops = Transformer(cfg, 10, 10, pad_id=0).train_flops
    # The sentence of the test above (S = 3, T = 2, V = 10) with 3 encoder and 1 decoder layers:
    # encoder matmuls:  6·3·(4·16 + 2·4·8)·3  = 18·128·3       = 6912
    # decoder matmuls:  6·1·(6·16 + 2·4·8)·2  = 6·160·2        = 1920
    # cross K/V:        6·1·(2·16)·3          = 6·32·3         =  576  (per decoder layer)
    # output:           6·4·10·2                               =  480
    # attention:        12·4·(3·9 + 1·(4 + 6)) = 48·37          = 1776  (encoder S², decoder T² and T·S)
    assert train_flops([3], [2]) == 6912 + 1920 + 576 + 480 + 1776


def test_peak_flops_follow_the_device_name_and_whether_fp32_may_use_tf32():
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "bf16") == 989e12  # the SXM part
    assert peak_flops_of("NVIDIA H100 NVL", "bf16") == 835e12
    assert peak_flops_of("NVIDIA H200 NVL", "bf16") == 835e12  # not the SXM H200's 989e12
    assert peak_flops_of("NVIDIA H200", "bf16") == 989e12
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "fp32") == 67e12  # torch's default: no TF32
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 494e12
    assert peak_flops_of("NVIDIA GeForce GTX 1080", "fp32") is None  # unknown: no MFU
    assert peak_flops_of("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "bf16") is None  # a slice: its share is unknown
    assert peak_flops_per_s(torch.device("cpu"), "fp32") is None


compile_opt_in = pytest.mark.skipif(not os.environ.get("TMT_TEST_COMPILE"), reason="torch.compile needs a C++ "
                                    "compiler and minutes here; set TMT_TEST_COMPILE=1")


@compile_opt_in
def test_a_compiled_step_makes_the_same_update_as_an_eager_one(tiny_corpus: Path, tmp_path: Path):
    eager = make_trainer(tiny_corpus, tmp_path / "eager")
    compiled = make_trainer(tiny_corpus, tmp_path / "compiled", compile=True)
    indices = list(range(6))
    one = eager.train_step.run(eager.train_step.batches.load(indices))
    two = compiled.train_step.run(compiled.train_step.batches.load(indices))
    assert two.loss.item() == pytest.approx(one.loss.item(), rel=1e-4)
    for (name, a), b in zip(eager.model.named_parameters(), compiled.model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-3, atol=1e-6), name
    assert all(not k.startswith("_orig_mod") for k in compiled.checkpoint.state_dict()["model"])  # plain module saved


@compile_opt_in
def test_the_compiled_step_inside_the_gpu_engine_trains_like_the_plain_step(tiny_corpus: Path, tmp_path: Path,
                                                                          monkeypatch):
    # The GPU engine with train.compile, its functions run eagerly on the CPU (what a graph
    # captures: inductor's kernels for forward and backward, one static-shape compile per batch
    # shape, then clipping and the capturable AdamW) against the plain uncompiled step on the same
    # padded batches. Tolerances, fp32: inductor fuses ops and reorders their sums (LayerNorm
    # statistics, softmax, the loss, bias gradients), a few ulps per op that compound through the
    # layers and backward; AdamW at eps 1e-4, as in tests/test_gpu.py, so that a gradient that is 0
    # up to rounding (the key bias) does not turn rounding into a step of ±lr.
    from transformer_mt.train import step as train_step_module

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: other tests' compiles would count
    settings = {"clip_grad_norm": 0.5, "warmup_steps": 3, "lr": 3e-3, "weight_decay": 0.01}
    with monkeypatch.context() as patch:
        patch.setattr(train_step_module, "graphs_apply", lambda *args, **kwargs: True)
        compiled = make_trainer(tiny_corpus, tmp_path / "compiled", compile=True, **settings)
    plain = make_trainer(tiny_corpus, tmp_path / "plain", **settings)
    plain.train_step.pack = False
    graphs = compiled.train_step.graphs
    assert graphs is not None and graphs.compiled and not graphs.capture
    for trainer in (compiled, plain):
        trainer.train_step.optimizer.param_groups[0]["eps"] = 1e-4
    updates = [[[0, 1, 2]], [[3, 4, 5, 6, 7]], [[8, 9, 10]], [[0, 11], [5, 6]]]
    shapes, norms = set(), []
    for step, indices in enumerate(updates, 1):
        batches = [compiled.train_step.batches.load(i) for i in indices]  # padded to 8, filler rows
        shapes |= {(b.src_ids.shape, b.tgt_in_ids.shape) for b in batches}
        one, two = compiled.train_step.run(batches), plain.train_step.run(batches)
        assert one.updated and two.updated and compiled.state.step == plain.state.step == step
        assert one.loss.item() == pytest.approx(two.loss.item(), rel=1e-5)
        assert one.grad_norm.item() == pytest.approx(two.grad_norm.item(), rel=1e-4)
        norms.append(two.grad_norm.item())
        for (name, a), b in zip(compiled.model.named_parameters(), plain.model.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=f"update {step}: {name}")
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"update {step}: {name}")
    assert max(norms) > 0.5  # clipping was active
    # Inductor ran, once per batch shape (dynamic=False), not dynamo's silent uncompiled fallback.
    assert 2 <= len(shapes) == torch._dynamo.utils.counters["stats"]["unique_graphs"]


# --- train.batch_tokens: auto ------------------------------------------------------------------

BASE = ModelConfig(d_model=512, n_heads=8, n_layers=6, d_ff=2048, max_len=256)  # benchmarks/train.py's base preset


def test_the_activation_estimate_matches_the_base_model_measured_on_an_h100():
    # eccf7fe, H100, eager bf16: peak 7,355 MB at 16,384 tokens per batch and 27,477 MB at 65,536.
    measured = (27_477 - 7_355) * 2**20 / (65_536 - 16_384)
    assert activation_bytes_per_token(BASE, 8000, 2) == pytest.approx(measured, rel=0.05)


def test_the_auto_budget_follows_device_memory_and_model_size():
    gib = 2**30
    assert device_batch_tokens(80 * gib, BASE, 8000, 2) == 65_536  # an H100: half its memory holds more; capped
    assert device_batch_tokens(24 * gib, BASE, 8000, 2) == 16_384
    assert device_batch_tokens(8 * gib, BASE, 8000, 2) == 8_192
    assert device_batch_tokens(80 * gib, BASE, 8000, 4) == 32_768  # fp32 activations take twice the bytes
    bigger = dataclasses.replace(BASE, d_model=1024, d_ff=4096)
    assert device_batch_tokens(24 * gib, bigger, 32_000, 2) < device_batch_tokens(24 * gib, BASE, 8000, 2)
    for memory in (1 * gib, 40 * gib, 200 * gib):  # powers of two between one sequence and the cap
        tokens = device_batch_tokens(memory, BASE, 8000, 2)
        assert tokens & (tokens - 1) == 0 and BASE.max_len <= tokens <= 65_536
    assert device_batch_tokens(0, dataclasses.replace(BASE, max_len=300), 8000, 2) == 512  # one sequence fits


def fake_gpu(monkeypatch, total_memory: int, name: str = "NVIDIA H100 80GB HBM3") -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=total_memory, name=name))
    return torch.device("cuda")


def test_auto_is_sized_for_the_gpu_and_said_and_a_set_budget_is_kept(tiny_corpus: Path, monkeypatch):
    cuda = fake_gpu(monkeypatch, 80 * 2**30)
    auto = tiny_config(tiny_corpus, model=dataclasses.asdict(BASE) | {"encoder_layers": None, "decoder_layers": None},
                       tokenizer={"vocab_size": 8000}, train={"batch_tokens": "auto"})
    chosen, note = resolve_batch_tokens(auto, cuda, Precision(torch.bfloat16, "cuda"))
    assert chosen.train.batch_tokens == 65_536
    assert note == ("train.batch_tokens 65,536 chosen for the 80 GiB of the NVIDIA H100 80GB HBM3 and this model "
                    "(set train.batch_tokens to override)")
    assert resolve_batch_tokens(auto, torch.device("cpu"), Precision(None, "cpu")) == (
        dataclasses.replace(auto, train=dataclasses.replace(auto.train, batch_tokens=4096)), None)  # today's default
    user = tiny_config(tiny_corpus, train={"batch_tokens": 8192})
    assert resolve_batch_tokens(user, cuda, Precision(torch.bfloat16, "cuda")) == (user, None)


def test_auto_is_the_default_and_every_recipe_sets_its_budget(tiny_corpus: Path):
    assert TrainConfig().batch_tokens == "auto"
    for recipe in sorted((REPO / "configs").glob("*.yaml")):
        # A recipe's tokens per update must not depend on the GPU it runs on.
        raw = yaml.safe_load(recipe.read_text(encoding="utf-8"))
        assert isinstance(raw["train"]["batch_tokens"], int), recipe.name


def test_a_cpu_run_with_auto_batches_keeps_todays_budget(tiny_corpus: Path, tmp_path: Path):
    trainer = make_trainer(tiny_corpus, tmp_path / "run", batch_tokens="auto")
    assert trainer.cfg.train.batch_tokens == 4096 and trainer.sampler.cut["batch_tokens"] == 4096
    assert trainer.train_step.cfg.train.batch_tokens == 4096


def test_batch_tokens_takes_a_number_or_auto():
    assert config_from_dict({"data": {"path": "x"}, "train": {"batch_tokens": "1e4"}}).train.batch_tokens == 10_000
    with pytest.raises(ConfigError, match=r"train.batch_tokens: expected an integer or auto, got 'big' \(str\)"):
        config_from_dict({"data": {"path": "x"}, "train": {"batch_tokens": "big"}})


def test_time_spent_capturing_cuda_graphs_is_reported_apart_from_the_rates(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(interval_module.time, "perf_counter", lambda: now[0])
    interval = interval_module.Interval(TrainConfig(), torch.device("cpu"), Distributed())
    batch = Batch(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
                  torch.ones(2, 4, dtype=torch.long), n_src_tokens=10, n_tgt_tokens=8)
    now[0] += 7.0  # a step of 2 s that first captured its shape for 5 s
    interval.add(torch.tensor(1.0), [batch], capture_seconds=5.0)
    now[0] += 2.0
    interval.add(torch.tensor(1.0), [batch])
    stats = interval.read_and_reset()
    assert stats.tgt_tokens_per_s == pytest.approx(16 / 4.0) and stats.capture_seconds == 5.0
    assert stats.perf()["capture_seconds"] == 5.0
    now[0] += 2.0
    interval.add(torch.tensor(1.0), [batch])
    later = interval.read_and_reset()
    assert later.capture_seconds == 0.0 and "capture_seconds" not in later.perf()


# --- bad input ----------------------------------------------------------------------------------

def test_a_pair_longer_than_the_longest_batch_length_is_left_out_not_cut_naming_the_key(tiny_corpus: Path,
                                                                                      tmp_path: Path, caplog):
    # model.max_len is the longest padded length a batch (and a captured shape) has; a training
    # pair past it is never cut to fit (it would teach the model to stop mid-sentence).
    with caplog.at_level("INFO", logger="transformer_mt.data.token_cache"):
        cfg = tiny_config(tiny_corpus, model={"max_len": 6}, train={"batch_tokens": 64})
        prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
        trainer = Trainer(cfg, tmp_path / "run", progress=False)
    data = trainer.train_data
    assert 0 < len(data) < len(TINY_PAIRS)  # some fit in 5 tokens a side, some do not
    assert max(data.src_len.max(), data.tgt_len.max()) <= 5  # the kept ones whole: no pair was cut
    removed = [r.getMessage() for r in caplog.records if "too_many_tokens" in r.getMessage()]
    assert removed == [f"filter too_many_tokens: removed {len(TINY_PAIRS) - len(data)} train pairs with a side longer than 5 "
                       "tokens, the most model.max_len=6 leaves (not truncated; raise model.max_len to train on them)"]
