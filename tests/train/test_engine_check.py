"""The GPU engine's self-check: before the first step, packed batches (the variable-length attention)
and the captured update run once on a tiny synthetic model beside their references; a kernel that
raises or computes something else falls back (packed -> padded, captured -> eager) with one warning,
recorded in summary.json. On the CPU the engine runs eagerly, so failures are injected here; a GPU
runs the check for real (benchmarks/gpu_runbook.sh check)."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import read_scalars, run_cli, tiny_config
from transformer_mt.config.loading import save_config
from transformer_mt.model import transformer
from transformer_mt.runs.checkpoint import load_checkpoint
from transformer_mt.train import cuda_graphs
from transformer_mt.train import step as train_step_module


def train_cli(tmp_path: Path, corpus: Path, monkeypatch, capsys, run: str = "run", **train) -> tuple[int, str, dict]:
    """`tmt train` of the tiny config (with these train.* settings) in-process: exit code, stderr, summary.json."""
    cfg = tiny_config(corpus, train={"max_steps": 4, "eval_every_steps": 4, "save_every_steps": 2, **train})
    save_config(cfg, tmp_path / "tiny.yaml")
    code, _, err = run_cli(["train", "--config", "tiny.yaml", "--run-dir", run], monkeypatch, capsys, tmp_path)
    summary_file = tmp_path / run / "summary.json"
    summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else {}
    return code, err, summary


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if "WARNING" in line]


@pytest.fixture
def engine_on_the_cpu(monkeypatch):
    """The captured path chosen as on one CUDA GPU; on the CPU its functions run eagerly."""
    monkeypatch.setattr(train_step_module, "graphs_apply", lambda *args, **kwargs: True)


def raising_backend(*args):
    raise RuntimeError("varlen_attn: cu_seqlens_q must be strictly increasing")


def wrong_backend(q, k, v, q_pack, k_pack, causal, dropout):
    # Attends over every row of the pack, not within each segment (what a kernel ignoring empty
    # segments' offsets could do): finite, plausible, wrong.
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                            v.transpose(0, 1)).transpose(0, 1)


@pytest.mark.parametrize(("backend", "why"), [(raising_backend, "RuntimeError: varlen_attn: cu_seqlens_q"),
                                              (wrong_backend, "differ")])
def test_a_failing_variable_length_attention_falls_back_to_padded_batches(tiny_corpus: Path, tmp_path: Path,
                                                                         monkeypatch, capsys, backend, why):
    monkeypatch.setattr(transformer, "varlen_backend", lambda *args: backend)
    code, err, summary = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys, batching="packed")
    assert code == 0, err
    assert summary["status"] == "finished" and summary["step"] == 4
    assert summary["data"]["pack_tokens"] is None  # the run trained on padded batches
    [warning] = warnings_in(err)
    assert "self-check" in warning and "packed batches" in warning and why in warning
    assert "training goes on with padded batches" in warning
    assert f"torch {torch.__version__}" in warning and "report" in warning  # what a bug report needs
    check = summary["engine_check"]
    assert check["packed"]["passed"] is False and check["packed"]["fallback"] == "padded batches"
    assert why in check["packed"]["error"]
    assert "captured" not in check  # not chosen on a CPU
    assert check["torch"] == torch.__version__ and check["device"].startswith("cpu")


def test_a_failing_capture_falls_back_to_the_eager_update(tiny_corpus: Path, tmp_path: Path, monkeypatch, capsys,
                                                          engine_on_the_cpu):
    def capture_fails(self, batch, n_tgt_tokens, last):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.GraphedStep, "run", capture_fails)
    code, err, summary = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys, batching="packed")
    assert code == 0, err
    assert summary["status"] == "finished" and summary["cuda_graphs"] is None  # trained without the engine
    [warning] = warnings_in(err)
    assert "captured update" in warning and "operation not permitted" in warning
    assert "training goes on with the eager update" in warning
    check = summary["engine_check"]
    assert check["packed"]["passed"] is True and check["captured"]["passed"] is False
    assert check["captured"]["fallback"] == "eager update" and "operation not permitted" in check["captured"]["error"]
    assert summary["data"]["pack_tokens"] is not None  # the packs passed: still packed


def test_a_captured_update_that_computes_another_gradient_falls_back(tiny_corpus: Path, tmp_path: Path,
                                                                     monkeypatch, capsys, engine_on_the_cpu):
    real = cuda_graphs.GraphedStep._micro_step

    def halved(self, inputs, denominator, last, step_loss=None):  # a graph that divides by a stale count
        return real(self, inputs, denominator * 2, last, step_loss)

    monkeypatch.setattr(cuda_graphs.GraphedStep, "_micro_step", halved)
    code, err, summary = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys)
    assert code == 0, err
    [warning] = warnings_in(err)
    assert "captured update" in warning and "differ" in warning
    check = summary["engine_check"]
    assert "packed" not in check and check["captured"]["passed"] is False
    assert summary["status"] == "finished" and summary["cuda_graphs"] is None


def test_both_failing_make_one_warning(tiny_corpus: Path, tmp_path: Path, monkeypatch, capsys, engine_on_the_cpu):
    monkeypatch.setattr(transformer, "varlen_backend", lambda *args: raising_backend)
    monkeypatch.setattr(cuda_graphs.GraphedStep, "run", lambda *args: raising_backend())
    code, err, summary = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys, batching="packed")
    assert code == 0, err
    [warning] = warnings_in(err)
    assert "training goes on with padded batches and the eager update" in warning
    assert not summary["engine_check"]["packed"]["passed"] and not summary["engine_check"]["captured"]["passed"]


def test_a_healthy_engine_passes_and_trains_what_it_trained_without_the_check(tiny_corpus: Path, tmp_path: Path,
                                                                              monkeypatch, capsys, engine_on_the_cpu):
    # Dropout on (tiny_config's 0.1): a check that drew from the run's random streams, or touched its
    # weights or optimizer, would change every step after it.
    code, err, summary = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys, run="checked", batching="packed")
    assert code == 0, err
    assert not warnings_in(err)
    check = summary["engine_check"]
    assert check["packed"]["passed"] is True and check["captured"]["passed"] is True
    for part in ("packed", "captured"):
        assert 0 <= check[part]["loss_error"] <= check[part]["tolerance"]
        assert 0 <= check[part]["grad_error"] <= check[part]["tolerance"]
    assert summary["cuda_graphs"] is not None and summary["data"]["pack_tokens"] is not None

    from transformer_mt.train import self_check
    monkeypatch.setattr(self_check, "run_checks", lambda engine, *args, **kwargs: {})  # nothing checked: as before
    code, err, unchecked = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys, run="unchecked", batching="packed")
    assert code == 0, err
    assert read_scalars(tmp_path / "checked", "train/loss") == read_scalars(tmp_path / "unchecked", "train/loss")
    a = load_checkpoint(tmp_path / "checked" / "checkpoints" / "step_00000004.pt")
    b = load_checkpoint(tmp_path / "unchecked" / "checkpoints" / "step_00000004.pt")
    assert all(torch.equal(t, b["model"][name]) for name, t in a["model"].items())
    assert torch.equal(a["rng"]["cpu"], b["rng"]["cpu"]) and a["sampler"] == b["sampler"]
    assert str(a["optimizer"]) == str(b["optimizer"])


def test_padded_eager_training_checks_nothing(tiny_corpus: Path, tmp_path: Path, monkeypatch, capsys):
    code, err, summary = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys)
    assert code == 0, err
    assert summary["engine_check"] is None and not warnings_in(err)


def test_a_resumed_run_checks_again_and_trains_what_an_uninterrupted_one_does(tiny_corpus: Path, tmp_path: Path,
                                                                              monkeypatch, capsys, engine_on_the_cpu):
    code, err, _ = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys, run="straight", batching="packed")
    assert code == 0, err
    code, err, _ = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys, run="resumed", batching="packed",
                             max_steps=2)
    assert code == 0, err
    cfg = tiny_config(tiny_corpus, train={"max_steps": 4, "eval_every_steps": 4, "save_every_steps": 2,
                                          "batching": "packed"})
    save_config(cfg, tmp_path / "tiny.yaml")
    code, _, err = run_cli(["train", "--config", "tiny.yaml", "--run-dir", "resumed", "--resume"], monkeypatch, capsys,
                           tmp_path)
    assert code == 0, err
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text(encoding="utf-8"))
    assert summary["engine_check"]["captured"]["passed"] and summary["step"] == 4
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "step_00000004.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_00000004.pt")
    assert all(torch.equal(t, b["model"][name]) for name, t in a["model"].items())


def test_the_check_leaves_the_random_streams_where_they_were(tmp_path: Path):
    # Trainer seeds after the check; the check puts the streams back all the same, wherever it runs.
    from transformer_mt.core.runtime import AttentionKernels, Precision
    from transformer_mt.train.self_check import Engine, run_checks

    torch.manual_seed(5)
    before = torch.get_rng_state()
    results = run_checks(Engine(packed=True, graphed=True), tiny_config(tmp_path), torch.device("cpu"),
                         Precision(None, "cpu"), AttentionKernels())
    assert results["packed"]["passed"] and results["captured"]["passed"]
    assert torch.equal(torch.get_rng_state(), before)


def test_a_packed_run_resumed_where_the_check_fails_goes_on_padded(tiny_corpus: Path, tmp_path: Path, monkeypatch,
                                                                   capsys):
    code, err, summary = train_cli(tmp_path, tiny_corpus, monkeypatch, capsys, batching="packed", max_steps=2)
    assert code == 0, err
    assert summary["engine_check"]["packed"]["passed"]
    monkeypatch.setattr(transformer, "varlen_backend", lambda *args: raising_backend)
    code, _, err = run_cli(["train", "--config", "tiny.yaml", "--run-dir", "run", "--resume", "--set",
                            "train.max_steps=4"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert "resuming from" in err and len([w for w in warnings_in(err) if "self-check" in w]) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "finished" and summary["step"] == 4
    assert summary["engine_check"]["packed"]["fallback"] == "padded batches"
