"""A training run's status in `summary.json`: running, interrupted, failed, finished; its progress,
metrics and throughput, and the wall time its processes have trained."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from transformer_mt.config.schema import Config
from transformer_mt.core.distributed import Distributed
from transformer_mt.data.report import DataReport
from transformer_mt.runs import summary
from transformer_mt.train.state import TrainState

logger = logging.getLogger(__name__)


class RunStatus:
    """Rewrites `summary.json` (rank 0) and counts `TrainState.train_seconds`."""

    def __init__(self, cfg: Config, run_dir: Path, state: TrainState, *, device: torch.device, n_parameters: int,
                 data_report: DataReport | None, dist: Distributed, config_dir: Path | None,
                 engine_report: Callable[[], dict | None] = lambda: None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.state = state
        self.n_parameters = n_parameters
        self.data_report = data_report
        self.engine_report = engine_report  # the GPU engine's captures: shapes, seconds
        self.dist = dist
        self.provenance = summary.provenance(cfg, run_dir, device, config_dir)
        self.test_report: dict | None = None  # the final test's, once there is one
        self._clock = time.perf_counter()  # train_seconds counts from here
        self._warned = False  # about a summary.json that could not be written

    def tick(self) -> None:
        """Add the wall time since the last tick to `train_seconds`."""
        now = time.perf_counter()
        self.state.train_seconds += now - self._clock
        self._clock = now

    def write(self, status: str, sampler_state: dict) -> None:
        """Rewrite `summary.json` (rank 0): provenance, the data report, progress, metrics and throughput so far."""
        self.tick()
        if not self.dist.is_main:
            return
        s = self.state
        self._write({
            "name": self.cfg.name, "status": status, "step": s.step, "max_steps": self.cfg.train.max_steps,
            "epoch": sampler_state["epoch"] + 1, "best_bleu": s.best_bleu, "best_step": s.best_step,
            "last_valid": s.last_valid, "test": self.test_report, "tgt_tokens_seen": s.tgt_tokens_seen,
            "train_seconds": round(s.train_seconds, 1),
            "tgt_tokens_per_s": round(s.tgt_tokens_seen / s.train_seconds, 1) if s.train_seconds else None,
            "skipped_nonfinite": s.skipped_nonfinite, "skipped_oom": s.skipped_oom, "init_from": s.parent,
            "parameters": self.n_parameters, "data": self.data_report.to_dict(),
            "provenance": {**self.provenance, "processes": self.dist.world_size},  # what --resume must start again
            "cuda_graphs": self.engine_report()})

    def _write(self, content: dict) -> None:
        """Write `summary.json`; a failure (a full disk, say) warns once and the run goes on: the
        next checkpoint, which a resume needs, stops it with the reason if the disk stays full."""
        try:
            summary.write_summary(self.run_dir, content)
        except OSError as err:
            if not self._warned:
                logger.warning("could not update %s (%s); training goes on", err.filename or "summary.json",
                               err.strerror or err)
            self._warned = True

    def write_keeping_the_error(self, status: str, sampler_state: dict) -> None:
        """Record how the run ended. If that write fails too (say, on the full disk that stopped the
        run), warn (`write` does): the error that ended the run is the one to report."""
        self.write(status, sampler_state)
