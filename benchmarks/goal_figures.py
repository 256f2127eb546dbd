"""The GPU engine's goals, one JSON line each, from the figure lines `benchmarks/gpu_runbook.sh` stages
wrote into their logs: `goal-bench` (benchmarks/train.py, base preset on Multi30k) and the
`configs/multi30k-en-de.yaml` runs of seeds 1 to 3 (benchmarks/recipe_figures.py). A goal whose
figure is missing says so (`met`: null, `open`: why), so a GPU machine stopped early still reports
what it measured.

    python benchmarks/goal_figures.py gpu-out/*.log

Each line: `{"figure": "goal-...", "commit", "value", "goal", "met", "source"}`; the last line of a
figure in the files given (in that order) counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

BENCH = "goal-bench"
SEEDS = ("multi30k-en-de", "multi30k-en-de-seed2", "multi30k-en-de-seed3")


def figure_lines(paths: list[Path]) -> dict[str, dict]:
    """The last JSON figure line of each label in `paths`."""
    found: dict[str, dict] = {}
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as err:
            raise SystemExit(f"goal_figures: {path}: cannot read it ({err.strerror})") from None
        for line in text.splitlines():
            if line.startswith('{"figure"'):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut off when its stage was stopped
                found[record["figure"]] = record
    return found


def goals(found: dict[str, dict]) -> list[dict]:
    """One record per goal: its value from `found`, the goal, whether it is met (None: not measured)."""
    bench, recipe = found.get(BENCH), found.get(SEEDS[0])
    engine = (recipe or {}).get("cuda_graphs") or {}
    bleus = [found[s].get("test_bleu") for s in SEEDS if s in found]
    rows: list[tuple[str, object, str, Callable[[float], bool], str, str]] = [
        ("goal-mfu", (bench or {}).get("mfu"), ">= 0.35", lambda v: v >= 0.35, BENCH,
         "base preset on Multi30k, the engine train.batching auto picks"),
        ("goal-vs-hf-marian", (bench or {}).get("tmt_vs_hf_marian"), ">= 2.0", lambda v: v >= 2.0, BENCH,
         "target tokens/s over HF Marian's on the same sentences"),
        ("goal-real-token-share", (bench or {}).get("real_token_share"), ">= 0.97", lambda v: v >= 0.97, BENCH,
         "real target tokens / target positions computed"),
        ("goal-ms-per-update", (recipe or {}).get("ms_per_update"), "<= 3.0", lambda v: v <= 3.0, SEEDS[0],
         "configs/multi30k-en-de.yaml alone on the card"),
        ("goal-end-to-end-s", (recipe or {}).get("end_to_end_s"), "<= 60", lambda v: v <= 60, SEEDS[0],
         "from the command to the test score, a run in one go"),
        ("goal-test-bleu-3-seeds", round(statistics.fmean(bleus), 2) if len(bleus) == 3 and None not in bleus
         else None, ">= 41.0", lambda v: v >= 41.0, ",".join(SEEDS), "test2016 BLEU, the mean of seeds 1, 2, 3"),
        ("goal-captures-per-run", engine.get("captured_shapes"), "<= 1", lambda v: v <= 1, SEEDS[0],
         "CUDA graphs the training step captured"),
        ("goal-capture-compile-s", engine.get("capture_seconds"), "<= 10", lambda v: v <= 10, SEEDS[0],
         "seconds capturing (compiling included)"),
    ]
    records = []
    for name, value, goal, met, source, what in rows:
        record = {"figure": name, "commit": os.environ.get("COMMIT"), "value": value, "goal": goal,
                  "met": None if value is None else bool(met(value)), "source": source, "what": what}
        if value is None:
            missing = [s for s in source.split(",") if s not in found]
            record["open"] = (f"no {', '.join(missing)} figure in the logs" if missing
                              else f"{source} did not measure it (a stopped or resumed run)")
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", type=Path, nargs="*", help="the stages' logs (e.g. gpu-out/*.log)")
    args = parser.parse_args(argv)
    for record in goals(figure_lines(args.logs)):
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
