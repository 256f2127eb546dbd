"""How much a trained model takes from its source: the teacher-forced loss of a parallel text with
the true sources, and with each sentence given the next sentence's source. A model that translates
loses several nats per token when its sources are swapped; a decoder that has become a
target-side language model (a stalled post-norm run, docs/results/multi30k-en-de.md) loses little.

    python scripts/source_use.py --checkpoint runs/x/checkpoints/step_00004096.pt \
        --src /path/to/multi30k/tok/valid.en --tgt /path/to/multi30k/tok/valid.de

Prints one JSON line: the mean negative log-likelihood in nats per target token (EOS included)
that `tmt score` gives, with the true sources (`true`) and the shifted ones (`shifted`), and
`source_use` = shifted - true. `--weights trained` scores a checkpoint's trained weights even when
it also holds an EMA of them (`train.ema_decay`), which `tmt translate` and `tmt score` use.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from transformer_mt.core.errors import TmtError
from transformer_mt.decode.translator import ScoredPair, Translator
from transformer_mt.runs.checkpoint import load_checkpoint


def nats_per_token(scored: list[ScoredPair]) -> float:
    return -sum(pair.log_prob for pair in scored) / sum(len(pair.token_log_probs) for pair in scored)


def source_use(checkpoint: Path, src_lines: list[str], tgt_lines: list[str], weights: str = "translation") -> dict:
    """`tmt score`'s figures (`Translator.score`, torch engine) of the pairs, and of the targets with
    each sentence given the next sentence's source."""
    translator = Translator.from_run(checkpoint.parent.parent, checkpoint, device="cpu", engine="torch")
    if weights == "trained":
        translator.engine.model.load_state_dict(load_checkpoint(checkpoint)["model"])
    true = nats_per_token(translator.score(src_lines, tgt_lines))
    shifted = nats_per_token(translator.score(src_lines[1:] + src_lines[:1], tgt_lines))
    return {"checkpoint": str(checkpoint), "weights": weights, "sentences": len(src_lines), "true": round(true, 4),
            "shifted": round(shifted, 4), "source_use": round(shifted - true, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint in a run's checkpoints/")
    parser.add_argument("--src", type=Path, required=True, help="source sentences, one per line")
    parser.add_argument("--tgt", type=Path, required=True, help="their reference translations, line by line")
    parser.add_argument("--weights", choices=("translation", "trained"), default="translation",
                        help="translation: what tmt translate uses (the EMA when there is one); trained: the trained weights")
    args = parser.parse_args()
    torch.set_num_threads(1)
    src_lines = args.src.read_text(encoding="utf-8").splitlines()
    tgt_lines = args.tgt.read_text(encoding="utf-8").splitlines()
    if len(src_lines) != len(tgt_lines) or len(src_lines) < 2:
        raise SystemExit(f"source_use.py: {args.src} and {args.tgt} need the same number of lines, at least 2 "
                         f"(got {len(src_lines)} and {len(tgt_lines)})")
    try:
        print(json.dumps(source_use(args.checkpoint, src_lines, tgt_lines, args.weights)))
    except TmtError as err:  # a missing or damaged checkpoint, a run without its tokenizers, a target too long
        raise SystemExit(f"source_use.py: {err}") from None


if __name__ == "__main__":
    main()
