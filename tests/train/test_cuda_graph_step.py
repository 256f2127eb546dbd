"""The GPU engine (`train.cuda_graphs`): where it runs, and on the CPU that its functions, run eagerly
(`capture=False`), make the plain step's updates: clipping and AdamW inside the update, the
device-held learning rate, the device-side skip of a non-finite update, exact resume, out of
memory. That replaying them as CUDA graphs changes nothing is tested on a GPU, in tests/test_gpu.py."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import make_trainer, tiny_config
from transformer_mt.config.schema import ModelConfig
from transformer_mt.core.errors import TrainingError
from transformer_mt.core.runtime import AttentionKernels, Precision
from transformer_mt.model.transformer import Transformer
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train import step as train_step_module
from transformer_mt.train.batches import packed_batches
from transformer_mt.train.cuda_graphs import MAX_GRAPHS, GraphedStep, compiled_for_graphs, graphs_apply
from transformer_mt.train.schedule import lr_at
from transformer_mt.train.loss import StepLoss
from transformer_mt.train.trainer import train

CUDA = torch.device("cuda")


def test_the_captured_step_runs_on_one_cuda_process_without_fp16_scaling_compiled_or_not():
    assert graphs_apply(CUDA, distributed=False, grad_scaler=False)  # train.compile: its kernels are captured
    assert not graphs_apply(torch.device("cpu"), distributed=False, grad_scaler=False)
    assert not graphs_apply(CUDA, distributed=True, grad_scaler=False)  # DDP hooks in backward
    assert not graphs_apply(CUDA, distributed=False, grad_scaler=True)  # fp16's changing scale


@pytest.mark.parametrize(("device", "train", "model", "packed"), [
    ("cuda", {}, {"attention_dropout": 0.0}, True),
    ("cuda", {}, {"dropout": 0.1}, False),  # attention dropout from model.dropout: the kernel has none
    ("cuda", {"precision": "fp32"}, {"attention_dropout": 0.0}, False),  # the kernel is fp16/bf16 only
    ("cpu", {}, {"attention_dropout": 0.0}, False),
    ("cpu", {"batching": "packed"}, {}, True),
    ("cuda", {"batching": "padded"}, {"attention_dropout": 0.0}, False)])
def test_auto_batching_packs_on_cuda_where_the_variable_length_kernel_runs(tmp_path: Path, device, train, model,
                                                                            packed):
    cfg = tiny_config(tmp_path, model=model, train={"precision": "auto", **train})
    assert packed_batches(cfg, torch.device(device)) == packed


def test_the_engine_compiles_static_shapes_without_inductors_own_cuda_graphs(monkeypatch):
    # GraphedStep captures the update itself: inductor must not capture its kernels again
    # (mode="reduce-overhead" / triton.cudagraphs), and a replayed graph has one shape, so the
    # kernels are specialised to it (dynamic=False), one dynamo entry per shape: the recompile
    # limit must cover the shapes captured, or dynamo would run new shapes uncompiled.
    calls = []
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: calls.append(kwargs) or module)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    module = torch.nn.Linear(2, 2)
    assert compiled_for_graphs(module, 40) is module
    assert calls == [{"dynamic": False, "options": {"triton.cudagraphs": False}}]
    assert torch._dynamo.config.recompile_limit == 40
    compiled_for_graphs(module, 4)
    assert torch._dynamo.config.recompile_limit == 40  # never lowered


def test_with_compile_the_engine_is_given_the_compiled_module_and_the_plain_one(engine_on_the_cpu, monkeypatch,
                                                                              tiny_corpus: Path, tmp_path: Path):
    wrapped = []

    def compiled_for_graphs_spy(module, max_graphs=MAX_GRAPHS):
        wrapped.append((module, max_graphs))
        return StepLoss(module.model)  # a stand-in for the compiled module: another object

    monkeypatch.setattr(train_step_module, "compiled_for_graphs", compiled_for_graphs_spy)
    monkeypatch.setattr(train_step_module.torch, "compile", lambda *args, **kwargs: pytest.fail("not the engine's"))
    step = make_trainer(tiny_corpus, tmp_path / "run", compile=True).train_step
    assert step.graphs is not None and step.graphs.compiled
    assert wrapped == [(step.graphs.uncaptured_loss, MAX_GRAPHS)]  # the plain StepLoss, for shapes past max_graphs
    assert step.graphs.step_loss is step.step_model is not step.graphs.uncaptured_loss
    assert not step.pack  # every position: fixed shapes, as on the GPU
    assert step.engine_report()["compile_seconds"] == 0.0  # nothing captured on a CPU


def test_on_a_cpu_the_step_and_its_batches_are_the_eager_ones(tiny_corpus: Path, tmp_path: Path):
    trainer = make_trainer(tiny_corpus, tmp_path / "run", cuda_graphs=True)
    assert trainer.train_step.graphs is None and trainer.train_step.lr is None  # the plain path, a float rate
    assert not trainer.train_step.optimizer.param_groups[0]["capturable"]
    batch = trainer.train_step.batches.load([0, 1, 2])
    assert batch.src_ids.shape[0] == 3  # no filler rows


@pytest.fixture
def engine_on_the_cpu(monkeypatch):
    """Trainers built while this is active take the GPU engine's path on the CPU, run eagerly."""
    monkeypatch.setattr(train_step_module, "graphs_apply", lambda *args, **kwargs: True)


def test_the_update_inside_the_engine_is_the_plain_clip_and_adamw_update():
    # Random gradients through both: clipping that bites on some steps only, a warmup-then-decay
    # rate, weight decay, and a non-finite step in the middle that both must skip.
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16), 20, 20, pad_id=0)
    plain_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    train = tiny_config(Path("."), train={"lr": 1e-2, "warmup_steps": 3, "weight_decay": 0.01}).train
    lr = torch.zeros((), dtype=torch.float64)  # as TrainStep makes it on a CPU (fp32 on CUDA, which needs it)
    engine_opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=train.betas, eps=1e-9,
                                   weight_decay=train.weight_decay, fused=True, capturable=True)
    plain_opt = torch.optim.AdamW(plain_params, lr=0.0, betas=train.betas, eps=1e-9,
                                  weight_decay=train.weight_decay, fused=True)
    engine = GraphedStep(StepLoss(model), list(model.parameters()), engine_opt, precision=Precision(None, "cpu"),
                         attention=AttentionKernels(), label_smoothing=0.1, max_norm=1.5, capture=False)
    clipped, done = 0, 0  # updates made
    for step in range(1, 9):
        engine.start_update()
        grads = [torch.randn_like(p) * (0.3 if step % 2 else 0.01) for p in plain_params]
        if step == 4:
            grads[1][0, 0] = float("nan")
        for buffer, plain, grad in zip(engine.grads, plain_params, grads):
            buffer.copy_(grad)
            plain.grad = grad.clone()
        engine.loss_sum.fill_(2.5)
        lr.fill_(lr_at(done + 1, train))
        engine.clip_and_update()

        norm = torch.nn.utils.clip_grad_norm_(plain_params, 1.5)
        clipped += int(norm > 1.5)
        torch.testing.assert_close(engine.grad_norm, norm, rtol=0, atol=0, equal_nan=True)
        assert bool(engine.nonfinite) == (step == 4)
        if step != 4:  # what TrainStep.run does: no optimizer step on a non-finite norm
            plain_opt.param_groups[0]["lr"] = lr_at(done + 1, train)
            plain_opt.step()
            done += 1
        for name, (engine_p, plain_p) in zip([n for n, _ in model.named_parameters()],
                                             zip(model.parameters(), plain_params)):
            assert torch.equal(engine_p, plain_p), f"step {step}: {name}"
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(engine_opt.state[engine_p][key], plain_opt.state[plain_p][key]), (step, name, key)
    assert 0 < clipped < 7  # clipping was active on some steps, not all


def test_the_engine_run_eagerly_trains_like_the_plain_step(engine_on_the_cpu, tiny_corpus: Path, tmp_path: Path):
    # Clipping active, a warmup rate, accumulation; the same padded batches (filler rows included)
    # through both, the plain step at every position too (packed rows sum in another order).
    settings = {"clip_grad_norm": 0.5, "warmup_steps": 3, "lr": 3e-3, "weight_decay": 0.01}
    engine = make_trainer(tiny_corpus, tmp_path / "engine", **settings)
    assert engine.train_step.graphs is not None and not engine.train_step.graphs.capture
    assert engine.train_step.optimizer.param_groups[0]["capturable"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_step_module, "graphs_apply", lambda *args, **kwargs: False)
        plain = make_trainer(tiny_corpus, tmp_path / "plain", **settings)
    plain.train_step.pack = False
    updates = [[[0, 1, 2]], [[3, 4, 5, 6, 7]], [[8, 9, 10]], [[0, 11], [5, 6]], [[1, 2, 3, 4]]]
    norms = []
    for step, indices in enumerate(updates, 1):
        batches = [engine.train_step.batches.load(i) for i in indices]
        assert batches[0].src_ids.shape[0] > len(indices[0])  # filler rows, as on the GPU
        one, two = engine.train_step.run(batches), plain.train_step.run(batches)
        assert one.updated and two.updated and engine.state.step == plain.state.step == step
        assert engine.train_step.lr.item() == pytest.approx(lr_at(step + 1, engine.cfg.train))
        assert one.loss.item() == two.loss.item()
        assert one.grad_norm.item() == two.grad_norm.item()
        norms.append(one.grad_norm.item())
        for (name, a), b in zip(engine.model.named_parameters(), plain.model.parameters()):
            assert torch.equal(a.grad, b.grad), f"update {step}: {name}"  # clipped, as the optimizer took them
            assert torch.equal(a, b), f"update {step}: {name}"
    assert max(norms) > 0.5  # clipping was active


def test_packs_on_the_engine_have_one_shape_and_train_like_the_plain_step(engine_on_the_cpu, tiny_corpus: Path,
                                                                          tmp_path: Path):
    # Static packs (offsets of the pack's slots, the longest segment the longest pair's): one graph's
    # shapes; the engine's functions run eagerly make the plain step's updates on them.
    settings = {"clip_grad_norm": 0.5, "warmup_steps": 3, "lr": 3e-3, "batching": "packed"}
    engine = make_trainer(tiny_corpus, tmp_path / "engine", **settings)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_step_module, "graphs_apply", lambda *args, **kwargs: False)
        plain = make_trainer(tiny_corpus, tmp_path / "plain", **settings)
    updates = [[[0, 1, 2]], [[3, 4, 5, 6, 7]], [[0, 11], [5, 6]], [[1]]]
    shapes = set()
    for step, indices in enumerate(updates, 1):
        batches = [engine.train_step.batches.load(i) for i in indices]
        shapes |= {(b.src_ids.shape, b.tgt_in_ids.shape, b.src_offsets.shape, b.longest) for b in batches}
        assert len(plain.train_step.batches.load(indices[0]).src_offsets) < len(batches[0].src_offsets)  # eager: own
        one, two = engine.train_step.run(batches), plain.train_step.run(batches)
        assert one.updated and two.updated and one.loss.item() == two.loss.item(), step
        for (name, a), b in zip(engine.model.named_parameters(), plain.model.parameters()):
            assert torch.equal(a, b), f"update {step}: {name}"
    ((src, tgt, offsets, longest),) = shapes
    pack = engine.train_step.batches.pack
    assert (src[1], tgt[1], offsets[0], longest) == (pack.src_tokens, 64, pack.slots + 1, pack.longest)


def test_a_non_finite_update_is_skipped_on_the_device(engine_on_the_cpu, tiny_corpus: Path, tmp_path: Path):
    trainer = make_trainer(tiny_corpus, tmp_path / "run", clip_grad_norm=1.0)
    step = trainer.train_step
    batch = step.batches.load([0, 1, 2, 3])
    assert step.run(batch).updated
    before = [p.detach().clone() for p in trainer.model.parameters()]
    moments = {k: [step.optimizer.state[p][k].clone() for p in trainer.model.parameters()]
               for k in ("step", "exp_avg", "exp_avg_sq")}
    rate = step.lr.item()
    real_forward = step.step_model.forward
    step.step_model.forward = lambda *args: real_forward(*args) * float("inf")
    result = step.run(batch)
    assert not result.updated and not torch.isfinite(result.loss)
    assert trainer.state.step == 1 and step.lr.item() == rate  # neither the counter nor the rate moved
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), before))
    for key, values in moments.items():
        assert all(torch.equal(step.optimizer.state[p][key], v) for p, v in zip(trainer.model.parameters(), values))
    step.step_model.forward = real_forward
    assert step.run(batch).updated and trainer.state.step == 2


@pytest.mark.parametrize("batching", ["padded", "packed"])
def test_out_of_memory_on_the_engine_skips_once_then_names_the_key(engine_on_the_cpu, tiny_corpus: Path,
                                                                   tmp_path: Path, batching: str):
    trainer = make_trainer(tiny_corpus, tmp_path / "run", batching=batching)
    step = trainer.train_step
    batch = step.batches.load([0, 1, 2, 3])
    real_forward = step.step_model.forward

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    step.step_model.forward = out_of_memory
    assert step.run_or_skip([batch], batch.n_tgt_tokens, None, 0) is None
    assert all(p.grad is None for p in trainer.model.parameters())  # freed
    step.step_model.forward = real_forward
    assert step.run(batch).updated  # the buffers are linked again
    assert all(p.grad is g for p, g in zip(trainer.model.parameters(), step.graphs.grads))
    step.step_model.forward = out_of_memory
    size = r"a pack of \d+ source and 64 target tokens" if batching == "packed" else r"\d+ sentences"
    with pytest.raises(TrainingError, match=rf"out of memory again at step 2 \({size}.*lower train.batch_tokens \(now 64\)"):
        step.run_or_skip([batch], batch.n_tgt_tokens, None, 0)


@pytest.mark.parametrize("batching", ["padded", "packed"])
def test_training_on_the_engine_resumes_exactly(engine_on_the_cpu, tiny_corpus: Path, tmp_path: Path, batching: str):
    # Dropout on; the optimizer's state (device step counts, the rate tensor) through a checkpoint;
    # packs: the same packs after the resume, mid-epoch.
    def cfg(max_steps: int):
        return tiny_config(tiny_corpus, train={"max_steps": max_steps, "eval_every_steps": 4, "save_every_steps": 4,
                                               "clip_grad_norm": 0.5, "batching": batching})
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(cfg(8), straight, progress=False)
    prepare_run_dir(interrupted, resume=False, overwrite=False)
    train(cfg(4), interrupted, progress=False)
    saved = load_checkpoint(interrupted / "checkpoints" / "step_00000004.pt")
    assert all(isinstance(g["lr"], float) for g in saved["optimizer"]["param_groups"])  # a plain number
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    assert train(cfg(8), interrupted, resume=True, progress=False).step == 8
    final_a = load_checkpoint(straight / "checkpoints" / "step_00000008.pt")
    final_b = load_checkpoint(interrupted / "checkpoints" / "step_00000008.pt")
    for name, tensor in final_a["model"].items():
        assert torch.equal(final_b["model"][name], tensor), name
    for a, b in zip(final_a["optimizer"]["state"].values(), final_b["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_a_checkpoint_of_the_engine_resumes_on_the_plain_path(engine_on_the_cpu, tiny_corpus: Path, tmp_path: Path):
    engine = make_trainer(tiny_corpus, tmp_path / "engine")
    batch = engine.train_step.batches.load([0, 1, 2])
    engine.train_step.run(batch)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_step_module, "graphs_apply", lambda *args, **kwargs: False)
        plain = make_trainer(tiny_corpus, tmp_path / "plain")
    plain.state.step = engine.state.step
    plain.train_step.load_state_dict(engine.train_step.state_dict())
    group = plain.train_step.optimizer.param_groups[0]
    assert not group["capturable"] and group["lr"] == lr_at(2, plain.cfg.train)


def test_capture_time_goes_to_the_log_and_summary_apart_from_the_rates(engine_on_the_cpu, tiny_corpus: Path,
                                                                       tmp_path: Path, monkeypatch, caplog):
    # On the CPU nothing is captured: a first update that "captured" for 1.5 s stands in for a GPU's.
    real_start = GraphedStep.start_update

    def start_update(self):
        if not self.capture_seconds:
            self.capture_seconds = 1.5
        real_start(self)

    monkeypatch.setattr(GraphedStep, "start_update", start_update)
    cfg = tiny_config(tiny_corpus, train={"max_steps": 2, "log_every_steps": 1, "eval_every_steps": 2,
                                          "save_every_steps": 2, "test_at_end": False})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    with caplog.at_level("INFO", logger="transformer_mt.train.trainer"):
        train(cfg, tmp_path / "run", progress=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert "1.5s capturing CUDA graphs, not counted in these rates" in lines[0]
    assert "capturing" not in lines[1]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    assert summary["cuda_graphs"] == {"captured_shapes": 0, "capture_seconds": 1.5, "compile_seconds": 0.0}
