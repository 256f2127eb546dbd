"""benchmarks/finetune.py, run tiny: a Marian folder built, imported, fine-tuned by tmt and by
Seq2SeqTrainer on the same batches, decoded by three engines; one JSON line per figure."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

NEEDED = ("transformers", "sentencepiece", "accelerate", "ctranslate2")
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--vocab-size", "1000", "--spm-vocab", "200",
        "--warmup-steps", "1", "--steps", "2", "--batch-tokens", "512", "--max-tokens", "6", "--batch-size", "16",
        "--beam", "2", "--sentences", "40", "--fit-steps", "3", "--label", "tiny"]


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in NEEDED),
                    reason=f"needs {', '.join(NEEDED)} (the bench and marian extras)")
def test_a_tiny_run_prints_a_train_and_a_decode_figure_of_the_same_work(tmp_path):
    env = {**os.environ, "COMMIT": "abc1234", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "finetune.py"), *TINY], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    figures = {line["figure"]: line for line in map(json.loads, (x for x in result.stdout.splitlines()
                                                                  if x.startswith('{"figure"')))}
    assert list(figures) == ["tiny-train", "tiny-decode"]
    train, decode = figures["tiny-train"], figures["tiny-decode"]
    for figure in (train, decode):
        assert figure["commit"] == "abc1234" and figure["threads"] == 1 and figure["vocab_size"] == 1000
        assert figure["transformers"] and figure["ctranslate2"] and figure["torch"] and figure["cpu"]
    # Fine-tuning: both timed the same tokens (the script refuses otherwise) over the steps after warm-up.
    assert train["timed_steps"] == 2 and train["tgt_tokens"] > 0 and train["precision"] == "fp32"
    assert train["tmt_tokens_per_s"] == pytest.approx(train["tgt_tokens"] / train["tmt_seconds"], rel=0.01)
    assert train["hf_seq2seq_tokens_per_s"] == pytest.approx(train["tgt_tokens"] / train["hf_seconds"], rel=0.01)
    assert train["tmt_vs_hf"] == pytest.approx(train["tmt_tokens_per_s"] / train["hf_seq2seq_tokens_per_s"], rel=0.01)
    assert train["met"] == (train["tmt_vs_hf"] >= train["goal"] == 1.2) and train["tmt_vs_hf_cpu_time"] > 0
    # Decoding: the same 40 sources, each engine at most 6 tokens a sentence.
    assert decode["sentences"] == 40 and (decode["batch_size"], decode["beam"]) == (16, 2)
    assert all(0 < n <= 40 * 6 for n in decode["generated_tokens"].values())
    # Fitted 3 steps first; with no length penalty, tmt's fp32 engines choose generate's translations.
    assert decode["fit_steps"] == 3 and train["fit_loss_last"] > 0
    assert decode["same_as_generate"]["tmt_torch"] == decode["same_as_generate"]["tmt_ct2"] == 40
    for engine in ("ct2", "torch", "hf_generate"):
        assert decode[f"{engine}_tokens_per_s"] > 0 and decode[f"{engine}_sentences_per_s"] > 0
    assert decode["ct2_vs_hf"] == pytest.approx(decode["ct2_sentences_per_s"] / decode["hf_generate_sentences_per_s"],
                                                rel=0.01)
    assert decode["met"] == (decode["ct2_vs_hf"] >= decode["goal"] == 3.0)


def test_a_vocabulary_smaller_than_the_pieces_is_refused_in_one_line(tmp_path):
    if not importlib.util.find_spec("sentencepiece") or not importlib.util.find_spec("transformers"):
        pytest.skip("needs sentencepiece and transformers")
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "finetune.py"), *TINY, "--vocab-size", "50"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert re.match(r"--vocab-size 50: the SentencePiece models have \d+ pieces; give at least \d+$", result.stderr)
