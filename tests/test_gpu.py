"""The GPU paths compute what the CPU paths do.

On a CUDA device the trainer takes other paths than on a CPU: batches padded to a multiple of 8
and copied from pinned memory without blocking, the padded (B, T, V) logits instead of the real
positions only, the fused CUDA AdamW, bf16 autocast, and the GPU's attention kernels. These
tests run only where there is a CUDA GPU (CI has none). `TMT_TEST_DEVICE=cpu` runs them on the
CPU instead, which checks the tests themselves, not the GPU paths.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import (BOS, EOS, PAD, TINY_PAIRS, assert_same_hypotheses, make_trainer, random_model,
                           random_prefixes, random_sources, random_terms, read_scalars, run_cli, tiny_config,
                           write_corpus)
from transformer_mt.decode.generator import StepGraphs, beam_search, greedy_decode
from transformer_mt.model import transformer
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train import step as train_step_module
from transformer_mt.train.trainer import Trainer, train

DEVICE = os.environ.get("TMT_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(DEVICE is None, reason="no CUDA GPU (TMT_TEST_DEVICE=cpu runs these on the CPU)")


def gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float().cpu() for name, p in trainer.model.named_parameters()}


def test_a_step_on_the_device_makes_the_update_of_a_cpu_step(tiny_corpus: Path, tmp_path: Path):
    # fp32 without TF32 (torch's default for matmuls): the same sums in another order.
    assert not torch.backends.cuda.matmul.allow_tf32
    cpu = make_trainer(tiny_corpus, tmp_path / "cpu", device="cpu")
    device = make_trainer(tiny_corpus, tmp_path / "device", device=DEVICE)
    indices = list(range(8))
    on_cpu = cpu.train_step.run(cpu.train_step.batches.load(indices))
    batch = device.train_step.batches.load(indices)
    if DEVICE == "cuda":  # the GPU's own path, not the CPU's
        assert batch.src_ids.shape[1] % 8 == 0 and batch.tgt_in_ids.shape[1] % 8 == 0
        assert device.train_step.pack == (device.train_step.graphs is None) and device.train_step.optimizer.defaults["fused"]
    on_device = device.train_step.run(batch)
    assert on_device.loss.item() == pytest.approx(on_cpu.loss.item(), rel=1e-5)
    assert on_device.grad_norm.item() == pytest.approx(on_cpu.grad_norm.item(), rel=1e-4)
    expected = gradients(cpu)
    for name, grad in gradients(device).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_fused_optimizer_on_the_device_updates_like_the_plain_one(tiny_corpus: Path, tmp_path: Path):
    trainer = make_trainer(tiny_corpus, tmp_path / "run", device=DEVICE, weight_decay=0.01)
    assert trainer.train_step.optimizer.defaults["fused"] == (DEVICE in ("cuda", "cpu"))
    fused = list(trainer.model.parameters())
    copies = [p.detach().clone().requires_grad_() for p in fused]
    d = trainer.train_step.optimizer.param_groups[0]  # lr: the first step's warmup rate, set by the schedule
    plain = torch.optim.AdamW(copies, lr=float(d["lr"]), betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                              foreach=False)  # the per-parameter loop: the reference implementation
    gen = torch.Generator(DEVICE).manual_seed(0)
    for step in range(4):  # the same random gradients for both: no gradient is exactly 0 (see Adam's sign)
        for a, b in zip(fused, copies):
            a.grad = torch.randn(a.shape, generator=gen, device=DEVICE)
            b.grad = a.grad.clone()
        trainer.train_step.optimizer.step()
        plain.step()
        for (name, a), b in zip(trainer.model.named_parameters(), copies):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step + 1}: {name}")


def test_a_bf16_step_is_close_to_the_fp32_step(tiny_corpus: Path, tmp_path: Path):
    fp32 = make_trainer(tiny_corpus, tmp_path / "fp32", device=DEVICE)
    bf16 = make_trainer(tiny_corpus, tmp_path / "bf16", device=DEVICE, precision="bf16")
    indices = list(range(12))
    exact = fp32.train_step.run(fp32.train_step.batches.load(indices))
    mixed = bf16.train_step.run(bf16.train_step.batches.load(indices))
    assert mixed.updated
    assert mixed.loss.item() == pytest.approx(exact.loss.item(), rel=1e-2)  # 8 mantissa bits in the matmuls
    flat = lambda grads: torch.cat([g.flatten() for g in grads.values()])  # noqa: E731
    a, b = flat(gradients(fp32)), flat(gradients(bf16))
    assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() > 0.99
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # autocast keeps fp32 master weights


@pytest.mark.parametrize("seed", range(3))
def test_decoding_on_the_device_gives_the_cpu_translations(seed):
    model, src = random_model(seed), random_sources(seed)
    args = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    greedy = greedy_decode(model, src, **args)
    beams = beam_search(model, src, beam_size=4, n_best=2, **args)
    model, src = model.to(DEVICE), src.to(DEVICE)
    assert greedy_decode(model, src, **args) == greedy
    device_beams = beam_search(model, src, beam_size=4, n_best=2, **args)
    assert [[h.ids for h in hyps] for hyps in device_beams] == [[h.ids for h in hyps] for hyps in beams]
    for hyps, expected in zip(device_beams, beams):
        for h, e in zip(hyps, expected):
            assert h.log_prob == pytest.approx(e.log_prob, abs=1e-4)


def test_training_on_the_device_resumes_like_an_uninterrupted_run(tiny_corpus: Path, tmp_path: Path):
    # Dropout on, bf16 where the device has it: resume must restore the CUDA RNG and the scaler-free
    # mixed-precision state. GPU kernels may sum in another order from run to run (atomics in
    # attention backward), so the check is closeness; `bit_identical` is printed for the record.
    precision = "bf16" if DEVICE == "cuda" else "fp32"
    def cfg(max_steps: int):
        return tiny_config(tiny_corpus, train={"max_steps": max_steps, "eval_every_steps": 4, "save_every_steps": 4,
                                               "device": DEVICE, "precision": precision})
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    prepare_run_dir(straight, resume=False, overwrite=False)
    train(cfg(8), straight, progress=False)
    prepare_run_dir(interrupted, resume=False, overwrite=False)
    train(cfg(4), interrupted, progress=False)
    prepare_run_dir(interrupted, resume=True, overwrite=False)
    assert train(cfg(8), interrupted, resume=True, progress=False).step == 8

    expected, resumed = read_scalars(straight, "train/loss"), read_scalars(interrupted, "train/loss")
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-4), step
    final_a = load_checkpoint(straight / "checkpoints" / "step_00000008.pt")
    final_b = load_checkpoint(interrupted / "checkpoints" / "step_00000008.pt")
    identical = all(torch.equal(t, final_b["model"][name]) for name, t in final_a["model"].items())
    print(f"resume on {DEVICE}: bit_identical={identical}")
    for name, tensor in final_a["model"].items():
        torch.testing.assert_close(final_b["model"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert final_a["sampler"] == final_b["sampler"]


def write_tiny_config(tmp_path: Path) -> None:
    """gpu.yaml in tmp_path: a model that learns TINY_PAIRS by heart in 300 steps, on DEVICE."""
    corpus = write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS, "test": TINY_PAIRS[:4]})
    raw = {"name": "gpu", "seed": 1, "data": {"format": "text", "path": str(corpus)},
           "tokenizer": {"vocab_size": 120, "min_frequency": 1},
           "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "dropout": 0.0, "max_len": 64},
           "train": {"max_steps": 300, "batch_tokens": 200, "lr": 3e-3, "warmup_steps": 20, "label_smoothing": 0.0,
                     "log_every_steps": 50, "eval_every_steps": 300, "save_every_steps": 300,
                     "device": DEVICE, "precision": "auto"}}
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")


def test_tmt_trains_and_translates_on_the_device(tmp_path: Path, monkeypatch, capsys):
    write_tiny_config(tmp_path)
    code, _, err = run_cli(["train", "--config", "gpu.yaml", "--run-dir", "run"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")["train_state"]["best_bleu"] > 90
    engine = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))["cuda_graphs"]
    if DEVICE == "cuda":  # the trainer measures the GPU: memory and, on a known GPU, MFU
        assert "precision bf16" in err
        assert max(read_scalars(tmp_path / "run", "train/perf/peak_memory_mb").values()) > 0
        # Capturing is reported on its own, not in the steady-state rates.
        assert "s capturing CUDA graphs, not counted in these rates" in err
        assert engine["captured_shapes"] >= 1 and engine["capture_seconds"] > 0
    else:
        assert engine is None
    known_gpu = DEVICE == "cuda" and "NVIDIA H" in torch.cuda.get_device_name()
    mfu = read_scalars(tmp_path / "run", "train/perf/mfu") if known_gpu else "not measured on this device"
    with capsys.disabled():  # to the terminal (gpu_runbook.sh runs pytest -s), not into the stdout compared below
        print(f"\nMFU of the tiny model on {DEVICE}: {mfu}")
    code, out, err = run_cli(["translate", "--run", "run", "--device", DEVICE, "Good morning."],
                             monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert out.strip() == "Buongiorno."


def test_decoding_on_cudnn_attention_forced_translates_on_the_device(tmp_path: Path, monkeypatch, capsys):
    # cuDNN's SDPA failed `tmt translate` with "Invalid backend" when it was the only kernel enabled
    # (H100, eccf7fe): forced now, math stays enabled behind it. Validation decodes with it too.
    write_tiny_config(tmp_path)
    code, _, err = run_cli(["train", "--config", "gpu.yaml", "--run-dir", "run", "--set",
                            "decode.attention_backend=cudnn", "--set", "train.test_at_end=false"],
                           monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")["train_state"]["best_bleu"] > 90
    for beam in ("1", "4"):  # `tmt translate` reads decode.attention_backend from the run's config
        code, out, err = run_cli(["translate", "--run", "run", "--device", DEVICE, "--engine", "torch", "--beam", beam,
                                  "Good morning."], monkeypatch, capsys, tmp_path)  # torch's attention kernels
        assert code == 0, err
        # Greedy gives the learnt sentence; beam search ranks close rivals by length penalty, and the
        # tiny model's best beam may be another spelling: a translation, not an error, is the point.
        if beam == "1":
            assert out.strip() == "Buongiorno."
        else:
            assert len(out.splitlines()) == 1 and out.strip()
        # A GPU of compute capability 8.0 or later runs cuDNN's kernel: no fallback, no warning.
        cudnn_runs = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 8
        assert ("decode.attention_backend: cudnn" in err) == (not cudnn_runs), err


# Four updates of three batch shapes, one shape twice (a replay with other data), one update of
# two accumulated batches.
UPDATES = [[[0, 1, 2]], [[3, 4, 5, 6, 7]], [[8, 9, 10]], [[0, 11], [5, 6]]]


def same_updates(graphed: Trainer, eager: Trainer, updates: list) -> list[float]:
    """Run `updates` (lists of batches' row indices) on both trainers and check, after each, the
    same loss, norm, clipped gradients, weights and AdamW state -> the gradient norms.

    A gradient that is 0 up to rounding (the key projection's bias: it shifts every score of a
    query alike) gets a step of ±lr from Adam at eps 1e-9 whatever its size, so rounding apart
    would show as lr apart in the weights; at eps 1e-4 such a step is ~0 and the weights compare."""
    for trainer in (graphed, eager):
        trainer.train_step.optimizer.param_groups[0]["eps"] = 1e-4
    norms = []
    # AdamW's moments compare as the gradients they average do: exp_avg, a weighted mean of them,
    # to the same tolerance (a gradient of ~1e-7 may round apart by 1e-8 in either step; on an H200
    # at 1e4fab4 an atol of 1e-9 failed there); exp_avg_sq, of their squares, at twice the relative one.
    moments = {"step": (0.0, 0.0), "exp_avg": (1e-4, 1e-6), "exp_avg_sq": (2e-4, 1e-9)}
    for step, indices in enumerate(updates, 1):
        one = graphed.train_step.run([graphed.train_step.batches.load(i) for i in indices])
        two = eager.train_step.run([eager.train_step.batches.load(i) for i in indices])
        assert one.updated and two.updated and graphed.state.step == eager.state.step == step
        assert one.loss.item() == pytest.approx(two.loss.item(), rel=1e-5)
        assert one.grad_norm.item() == pytest.approx(two.grad_norm.item(), rel=1e-4)
        norms.append(two.grad_norm.item())
        expected = gradients(eager)  # after the update: the clipped gradients the optimizer took
        for name, grad in gradients(graphed).items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=f"update {step}: {name}")
        for (name, a), b in zip(graphed.model.named_parameters(), eager.model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"update {step}: {name}")
            for key, (rtol, atol) in moments.items():
                torch.testing.assert_close(graphed.train_step.optimizer.state[a][key],
                                           eager.train_step.optimizer.state[b][key], rtol=rtol, atol=atol,
                                           msg=lambda detail: f"update {step}: {name} {key}: {detail}")
    return norms


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_the_captured_update_makes_the_eager_steps_updates(tiny_corpus: Path, tmp_path: Path, clip: float):
    # The CUDA-graph update (forward, backward, clipping, AdamW at the scheduled rate, all
    # replayed) against the eager one over `UPDATES`, fp32, with and without clipping.
    settings = {"batch_tokens": 64, "clip_grad_norm": clip, "warmup_steps": 3}
    graphed = make_trainer(tiny_corpus, tmp_path / "graphed", device=DEVICE, **settings)
    eager = make_trainer(tiny_corpus, tmp_path / "eager", device=DEVICE, cuda_graphs=False, **settings)
    assert eager.train_step.graphs is None
    assert (graphed.train_step.graphs is not None) == (DEVICE == "cuda")  # elsewhere both run eagerly
    norms = same_updates(graphed, eager, UPDATES)
    assert not clip or max(norms) > clip  # with clipping, it did clip
    if DEVICE == "cuda":
        assert 2 <= len(graphed.train_step.graphs.captured) <= len(UPDATES) + 1
        batch = graphed.train_step.batches.load([0, 1, 2])
        assert batch.src_ids.shape[0] == 64 // max(batch.src_ids.shape[1], batch.tgt_in_ids.shape[1])  # filler rows


def engine_trainer(tiny_corpus: Path, run: Path, monkeypatch, **train) -> Trainer:
    """A trainer on the GPU engine: captured on CUDA, its functions run eagerly elsewhere."""
    if DEVICE != "cuda":
        monkeypatch.setattr(train_step_module, "graphs_apply", lambda *args, **kwargs: True)
    trainer = make_trainer(tiny_corpus, run, device=DEVICE, **train)
    assert trainer.train_step.graphs is not None
    return trainer


def test_packed_updates_replay_one_captured_graph_and_make_the_padded_updates(tiny_corpus: Path, tmp_path: Path,
                                                                            monkeypatch):
    # Packs (sentences end to end, attention within each sentence: FlashAttention's variable-length
    # kernel on CUDA, dropout 0) on the engine against eager padded batches of the same sentences.
    settings = {"batch_tokens": 64, "clip_grad_norm": 0.5, "warmup_steps": 3}
    packed = engine_trainer(tiny_corpus, tmp_path / "packed", monkeypatch, batching="packed", **settings)
    padded = make_trainer(tiny_corpus, tmp_path / "padded", device=DEVICE, cuda_graphs=False, batching="padded",
                          **settings)
    assert packed.train_step.batches.pack is not None and padded.train_step.batches.pack is None
    shapes = {(b.src_ids.shape, b.tgt_in_ids.shape, b.src_offsets.shape, b.longest)
              for b in (packed.train_step.batches.load(i) for update in UPDATES for i in update)}
    assert len(shapes) == 1  # every pack one shape
    same_updates(packed, padded, UPDATES)
    if DEVICE == "cuda":  # one graph for the last micro-batch of an update, one for the others (accumulation)
        assert len(packed.train_step.graphs.captured) == 2


def test_bf16_packs_replay_one_captured_update_through_the_variable_length_kernel(tiny_corpus: Path, tmp_path: Path,
                                                                                  monkeypatch):
    # What a GPU run takes by default: bf16, attention dropout 0, `train.batching: auto`.
    trainer = engine_trainer(tiny_corpus, tmp_path / "run", monkeypatch, precision="bf16", batching="auto")
    step = trainer.train_step
    assert (step.batches.pack is not None) == (DEVICE == "cuda")
    backends = []
    monkeypatch.setattr(transformer, "varlen_backend", lambda *args, real=transformer.varlen_backend:
                        backends.append(real(*args)) or backends[-1])
    losses = [step.run(step.batches.load(indices)).loss.item() for indices in ([0, 1, 2], [3, 4, 5, 6, 7], [8, 9])]
    assert all(math.isfinite(loss) for loss in losses) and trainer.state.step == 3
    if DEVICE == "cuda":
        assert len(step.graphs.captured) == 1  # three updates, one shape
        assert set(backends) == {transformer._flash_varlen}  # traced in the warm-up runs and the capture


@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_on_the_device_computes_the_reference_per_segment(causal: bool):
    # bf16 on CUDA: FlashAttention's variable-length kernel, against the SDPA reference in fp32;
    # empty segments (a static pack's unused slots) and a cross-attention's other key offsets included.
    device = torch.device(DEVICE)
    backend = transformer.varlen_backend(device, 0.0, torch.bfloat16)
    assert (backend is transformer._flash_varlen) == (DEVICE == "cuda")
    gen = torch.Generator().manual_seed(0)
    q_offsets = torch.tensor([0, 3, 9, 10, 16, 16, 16], dtype=torch.int32, device=device)
    k_offsets = q_offsets if causal else torch.tensor([0, 5, 7, 12, 16, 20, 20], dtype=torch.int32, device=device)
    q_pack = transformer.Packing.packed(q_offsets, 16, 6)
    k_pack = transformer.Packing.packed(k_offsets, int(k_offsets[-1]), 6)
    q, k, v = (torch.randn(n, 2, 8, generator=gen).to(device).requires_grad_() for n in (16, len(k_pack.mask[0]),
                                                                                         len(k_pack.mask[0])))
    expected = transformer._reference_varlen(q, k, v, q_pack, k_pack, causal, 0.0)
    expected.square().sum().backward()
    expected_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    halves = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    got = backend(*halves, q_pack, k_pack, causal, 0.0)
    got.float().square().sum().backward()
    torch.testing.assert_close(got.float(), expected.detach(), rtol=2e-2, atol=2e-2)
    for half, grad in zip(halves, expected_grads):
        torch.testing.assert_close(half.grad.float(), grad, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not os.environ.get("TMT_TEST_COMPILE"),
                    reason="torch.compile takes minutes here; set TMT_TEST_COMPILE=1 (gpu_runbook.sh check does)")
def test_the_compiled_and_captured_update_makes_the_compiled_eager_steps_updates(tiny_corpus: Path, tmp_path: Path,
                                                                                monkeypatch):
    # train.compile under the GPU engine: each shape's inductor kernels (static shapes, compiled in
    # the warm-up runs) captured with clipping and AdamW and replayed, against the compiled step
    # run eagerly (torch.compile's own shape-generic kernels after the first shape, no graphs).
    # Both are inductor's fused kernels, but not the same ones: sums may run in another order,
    # hence the tolerances of the uncompiled test above.
    torch._dynamo.reset()
    settings = {"batch_tokens": 64, "clip_grad_norm": 0.5, "warmup_steps": 3, "compile": True}
    graphed = engine_trainer(tiny_corpus, tmp_path / "graphed", monkeypatch, **settings)
    eager = make_trainer(tiny_corpus, tmp_path / "eager", device=DEVICE, cuda_graphs=False, **settings)
    assert eager.train_step.graphs is None and graphed.train_step.graphs.compiled
    norms = same_updates(graphed, eager, UPDATES)
    assert max(norms) > 0.5  # it clipped
    report = graphed.train_step.engine_report()
    if DEVICE == "cuda":  # each shape compiled in its warm-up, then captured: compiling is part of capturing
        assert 2 <= report["captured_shapes"] <= len(UPDATES) + 1
        assert 0 < report["compile_seconds"] < report["capture_seconds"]
        print(f"\ncompiled and captured: {report}")  # gpu_runbook.sh runs pytest -s: for the log


def test_a_replayed_update_with_a_non_finite_loss_changes_nothing(tiny_corpus: Path, tmp_path: Path, monkeypatch):
    trainer = engine_trainer(tiny_corpus, tmp_path / "run", monkeypatch, clip_grad_norm=1.0)
    step, graphs = trainer.train_step, trainer.train_step.graphs
    batch = step.batches.load(list(range(6)))
    assert step.run(batch).updated  # captures this shape's update
    before = [p.detach().clone() for p in trainer.model.parameters()]
    moments = [dict((k, v.clone()) for k, v in step.optimizer.state[p].items()) for p in trainer.model.parameters()]
    graphs.start_update()
    graphs.run(batch, 0, last=True)  # the same graph, replayed with 0 target tokens: the loss is inf / NaN
    assert graphs.nonfinite.item() == 1.0 and not torch.isfinite(graphs.loss_sum)
    for p, old, state in zip(trainer.model.parameters(), before, moments):
        assert torch.equal(p, old) and all(torch.equal(step.optimizer.state[p][k], v) for k, v in state.items())
    assert step.run(batch).updated and trainer.state.step == 2  # and the next update is a normal one
    assert not all(torch.equal(p, old) for p, old in zip(trainer.model.parameters(), before))


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.skipif(
    not os.environ.get("TMT_TEST_COMPILE"), reason="torch.compile: set TMT_TEST_COMPILE=1"))])
def test_a_replayed_step_draws_new_dropout_masks(tiny_corpus: Path, tmp_path: Path, compile: bool):
    # Compiled, dropout is inductor's: seeds drawn by a kernel inside the graph (aten.randint from
    # the CUDA generator, whose offset moves on at each replay), not frozen at capture.
    torch._dynamo.reset()
    cfg = tiny_config(tiny_corpus, model={"dropout": 0.3}, train={"device": DEVICE, "max_steps": 2, "compile": compile})
    prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    batch = trainer.train_step.batches.load(list(range(6)))
    losses = []
    for _ in range(3):  # the same batch: only the dropout masks differ
        if trainer.train_step.graphs is not None:
            trainer.train_step.graphs.start_update()
            trainer.train_step.graphs.run(batch, batch.n_tgt_tokens, last=False)  # no update: the same weights
            losses.append(trainer.train_step.graphs.loss_sum.item())
        else:
            trainer.model.train()
            losses.append(trainer.train_step.run(batch).loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) == 3


def test_greedy_decoding_replayed_from_a_cuda_graph_gives_the_eager_output():
    settings = {"bos_id": BOS, "eos_id": EOS, "max_len_a": 1.5, "max_len_b": 5}
    for seed in range(3):
        model, src = random_model(seed).to(DEVICE), random_sources(seed).to(DEVICE)
        expected = greedy_decode(model, src, **settings)
        assert greedy_decode(model, src, graphs=StepGraphs(), capture=DEVICE == "cuda", **settings) == expected


def test_beam_search_replayed_from_a_cuda_graph_gives_the_eager_output():

    for seed in range(3):
        model, src = random_model(seed).to(DEVICE), random_sources(seed, batch=5, max_len=20).to(DEVICE)
        for alpha, beam, n_best in [(0.0, 4, 2), (1.0, 5, 5), (0.6, 1, 1)]:
            settings = {"bos_id": BOS, "eos_id": EOS, "beam_size": beam, "max_len_a": 1.5, "max_len_b": 5,
                        "alpha": alpha, "n_best": n_best}
            expected = beam_search(model, src, **settings)
            assert_same_hypotheses(beam_search(model, src, graphs=StepGraphs(), capture=DEVICE == "cuda", **settings),
                                   expected)
    if DEVICE == "cuda":  # captured under bf16 autocast, as `translate_ids` runs it there
        settings = {"bos_id": BOS, "eos_id": EOS, "beam_size": 4, "max_len_a": 1.5, "max_len_b": 5, "n_best": 2}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mixed = beam_search(model, src, capture=True, **settings)
            eager = beam_search(model, src, **settings)
        assert all(len(hyps) == 2 for hyps in mixed)
        # Other attention kernels (masked over the whole cache) round bf16 otherwise: close
        # candidates may swap, but most sentences keep their best translation.
        assert sum(a[0].ids == b[0].ids for a, b in zip(mixed, eager)) >= 3


def test_prefixes_replayed_from_a_cuda_graph_give_the_eager_output():
    for seed in range(2):
        model, src = random_model(seed).to(DEVICE), random_sources(seed, batch=5, max_len=20).to(DEVICE)
        prefixes = random_prefixes(seed, batch=5).to(DEVICE)
        for beam, n_best in [(1, 1), (4, 2)]:
            settings = {"bos_id": BOS, "eos_id": EOS, "beam_size": beam, "max_len_a": 1.5, "max_len_b": 5,
                        "n_best": n_best, "prefixes": prefixes}
            expected = beam_search(model, src, **settings)
            got = beam_search(model, src, graphs=StepGraphs(), capture=DEVICE == "cuda", **settings)
            assert_same_hypotheses(got, expected)
            assert all(h.ids[:3] == prefixes[0].tolist() for h in got[0])  # the first sentence's, 3 tokens


def test_constraints_replayed_from_a_cuda_graph_give_the_eager_output():
    for seed in range(2):
        model, src = random_model(seed).to(DEVICE), random_sources(seed, batch=5, max_len=20).to(DEVICE)
        terms, prefixes = random_terms(seed, batch=5).to(DEVICE), random_prefixes(seed, batch=5, max_len=3).to(DEVICE)
        for extra in ({}, {"prefixes": prefixes}):
            settings = {"bos_id": BOS, "eos_id": EOS, "beam_size": 4, "max_len_a": 1.5, "max_len_b": 8, "n_best": 2,
                        "terms": terms, **extra}
            expected = beam_search(model, src, **settings)
            got = beam_search(model, src, graphs=StepGraphs(), capture=DEVICE == "cuda", **settings)
            assert_same_hypotheses(got, expected)
            first = terms[1][0][terms[1][0] != PAD].tolist()  # the second sentence's term
            assert all(any(h.ids[i:i + len(first)] == first for i in range(len(h.ids))) for h in got[1])


def test_batches_of_one_padded_shape_replay_one_captured_step_on_the_device():

    model = random_model(5).to(DEVICE)
    batches = [random_sources(seed, batch=batch, max_len=8, min_len=3).to(DEVICE)
               for seed, batch in [(0, 5), (1, 8), (2, 7), (3, 9)]]  # three of one padded shape, then another
    settings = {"bos_id": BOS, "eos_id": EOS, "max_len_a": 1.5, "max_len_b": 5}
    greedy_graphs, beam_graphs, captured = StepGraphs(), StepGraphs(), []
    for src in batches:
        got = greedy_decode(model, src, capture=DEVICE == "cuda", graphs=greedy_graphs, **settings)
        assert got == greedy_decode(model, src, **settings)
        hyps = beam_search(model, src, beam_size=3, n_best=2, capture=DEVICE == "cuda", graphs=beam_graphs,
                                  **settings)
        assert_same_hypotheses(hyps, beam_search(model, src, beam_size=3, n_best=2, **settings))
        captured.append(next(iter(beam_graphs.captured.values()))[1])  # the step: a graph's replay on CUDA
    assert captured[0] is captured[1] is captured[2] and captured[3] is not captured[2]
