"""Where the GPU engine (`cuda_graph_step`) runs; that it computes the eager step's update is
tested on a GPU, in tests/test_gpu.py."""

from pathlib import Path

import torch

from tests.test_training_speed import make_trainer
from transformer_mt.cuda_graph_step import graphs_apply

CUDA = torch.device("cuda")


def test_the_captured_step_runs_on_one_cuda_process_without_compile_or_fp16_scaling():
    assert graphs_apply(CUDA, distributed=False, compiled=False, grad_scaler=False)
    assert not graphs_apply(torch.device("cpu"), distributed=False, compiled=False, grad_scaler=False)
    assert not graphs_apply(CUDA, distributed=True, compiled=False, grad_scaler=False)  # DDP hooks in backward
    assert not graphs_apply(CUDA, distributed=False, compiled=True, grad_scaler=False)
    assert not graphs_apply(CUDA, distributed=False, compiled=False, grad_scaler=True)  # fp16's changing scale


def test_on_a_cpu_the_step_and_its_batches_are_the_eager_ones(tiny_corpus: Path, tmp_path: Path):
    trainer = make_trainer(tiny_corpus, tmp_path / "run", cuda_graphs=True)
    assert trainer.train_step.graphs is None
    batch = trainer.train_step.load_batch([0, 1, 2])
    assert batch.src_ids.shape[0] == 3  # no filler rows
