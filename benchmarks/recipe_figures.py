"""One JSON line of a training run's figures, from its summary.json and train.log: what the
results pages report of a recipe such as `configs/multi30k-en-de.yaml` (ms per update, seconds from
the command to the test score, test BLEU). `benchmarks/gpu_runbook.sh` calls it after a training stage.

    python benchmarks/recipe_figures.py RUN_DIR --label multi30k --stage-seconds 118 [--resumed]

`ms_per_update`: the run's target tokens per update ÷ the median of the log lines' target
tokens/s (which leave out validation, checkpoints and CUDA-graph capture), so the steady state.
`end_to_end_s`: the stage's wall time from starting `tmt train` to its exit, which writes the
test score last; only for a run that finished in one go (null after a resume).
`test_bleu`: the final test of the averaged (or best) weights; `test_ema_bleu`: the same test of
the EMA's weights, when the run keeps one (`train.ema_decay`), else null: the EMA of `best.pt`,
which that EMA's validation chose (`test_ema_checkpoint`). With an EMA, `best_valid_bleu` is the
EMA's greedy validation, not comparable with a run's without one.
`--score-valid` adds, for comparing training variants on validation,: `valid_bleu`, the validation split
translated from the test's checkpoint (the average of the last 10) as `tmt evaluate --split valid`
does it (the run's beam, 5 for the recipe), and for a run with an EMA `valid_ema_bleu`, the same of
the last step's checkpoint, its EMA weights (not `best.pt`'s: validation chose that one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from transformer_mt.core.run_layout import step_file_name

LOG_LINE = re.compile(r"^.*step (\d+)/\d+ .*?, (\d+) source and (\d+) target tokens/s(.*)$")


def figures(run: Path, label: str, stage_seconds: float | None, resumed: bool) -> dict:
    try:
        summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"recipe_figures: {run / 'summary.json'}: cannot read it ({err})") from None
    rates, mfus, captures = [], [], []
    for line in (run / "train.log").read_text(encoding="utf-8").splitlines():
        if match := LOG_LINE.match(line):
            rates.append(int(match.group(3)))
            if mfu := re.search(r"MFU ([\d.]+)%", match.group(4)):
                mfus.append(float(mfu.group(1)) / 100)
            if capture := re.search(r"; ([\d.]+)s capturing CUDA graphs", match.group(4)):
                captures.append(float(capture.group(1)))
    step = summary["step"]
    tokens_per_update = summary["tgt_tokens_seen"] / step if step else None
    rate = statistics.median(rates) if rates else None
    test = summary.get("test") or {}
    finished = summary["status"] == "finished"
    return {
        "figure": label, "commit": os.environ.get("COMMIT"), "status": summary["status"], "step": step,
        "max_steps": summary["max_steps"], "resumed": resumed,
        "end_to_end_s": round(stage_seconds, 1) if stage_seconds is not None and finished and not resumed else None,
        "stage_s": stage_seconds, "train_seconds": summary["train_seconds"],
        "ms_per_update": round(1000 * tokens_per_update / rate, 2) if rate and tokens_per_update else None,
        "tgt_tokens_per_update": round(tokens_per_update, 1) if tokens_per_update else None,
        "tgt_tokens_per_s_median": rate, "mfu_median": round(statistics.median(mfus), 4) if mfus else None,
        "capture_seconds_logged": round(sum(captures), 2), "cuda_graphs": summary.get("cuda_graphs"),
        # A run that never validated keeps its -1 markers: null here, as `tmt runs` shows "-"
        "best_valid_bleu": summary["best_bleu"] if summary["best_bleu"] >= 0 else None,
        "best_step": summary["best_step"] if summary["best_bleu"] >= 0 else None,
        "test_bleu": test.get("bleu"), "test_chrf": test.get("chrf"), "test_beam": test.get("beam_size"),
        "test_seconds": test.get("seconds"), "test_ema_bleu": (test.get("ema") or {}).get("bleu"),
        # What the test scores are of: the checkpoint, how many step checkpoints it averages (10 for the
        # recipe's full average; fewer says the run stopped early) and whose weights ("model" or "ema").
        "test_checkpoint": test.get("checkpoint"), "test_checkpoints_averaged": len(test.get("checkpoint_steps") or []),
        "test_weights": test.get("weights"), "test_ema_checkpoint": (test.get("ema") or {}).get("checkpoint"),
        "device": (summary.get("provenance") or {}).get("device"),
    }


def valid_bleu(run: Path, checkpoint: str | None) -> float | None:
    """BLEU of one of the run's checkpoints on its validation split, by `tmt evaluate --split valid`
    (which translates with the checkpoint's EMA weights when it has them); None without a checkpoint
    or when the evaluation fails (its error then goes to stderr)."""
    if not checkpoint:
        return None
    result = subprocess.run([sys.executable, "-m", "transformer_mt", "evaluate", "--checkpoint",
                             str(run / "checkpoints" / checkpoint), "--split", "valid", "--quiet"],
                            capture_output=True, text=True)
    score = re.search(r"^BLEU = ([\d.]+)", result.stdout, re.MULTILINE)
    if result.returncode != 0 or not score:
        print(f"recipe_figures: tmt evaluate --split valid of {checkpoint} failed:\n{result.stderr}", file=sys.stderr)
        return None
    return float(score.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run directory")
    parser.add_argument("--label", default="recipe", help="the JSON line's `figure` name")
    parser.add_argument("--stage-seconds", type=float, default=None, help="wall time of the training command")
    parser.add_argument("--resumed", action="store_true", help="the command resumed an earlier start")
    parser.add_argument("--score-valid", action="store_true",
                        help="a finished run's test checkpoint (and last EMA), translated and scored on validation")
    args = parser.parse_args(argv)
    line = figures(args.run, args.label, args.stage_seconds, args.resumed)
    failed = False
    if args.score_valid and line["status"] == "finished":
        line["valid_bleu"] = valid_bleu(args.run, line["test_checkpoint"])
        has_ema = line["test_ema_checkpoint"] is not None
        line["valid_ema_bleu"] = valid_bleu(args.run, step_file_name(line["step"]) if has_ema else None)
        failed = line["valid_bleu"] is None or (has_ema and line["valid_ema_bleu"] is None)
    print(json.dumps(line))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
