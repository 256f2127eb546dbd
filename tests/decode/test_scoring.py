"""`tmt score`: the log-probability of given pairs equals the model's own per-token log-softmax, on
both engines; files, stdin and JSON lines; bad input gets one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import SOURCES, TARGETS, tmt
from transformer_mt.data.tokenization import BOS_ID, EOS_ID
from transformer_mt.decode.translator import Translator
from transformer_mt.runs.checkpoint import load_run

# Training pairs, unseen pairs, and a wrong translation.
PAIRS = list(zip(SOURCES, TARGETS)) + [("Good night, the city is hot.", "Buonanotte, la città è calda."),
                                       ("Where is the station?", "Il caffè è caldo."), ("?", "Sì")]


def reference_log_probs(run: Path) -> list[list[float]]:
    """Each pair's per-token log-probabilities from the model itself, one sentence at a time (no padding),
    over the tokens a translation can hold (all but padding and BOS, as the search and CTranslate2)."""
    loaded = load_run(run)
    tokenizers, model = loaded.tokenizers, loaded.model.eval()
    expected = []
    for src, tgt in PAIRS:
        src_ids = torch.tensor([tokenizers.encode_src([src])[0] + [EOS_ID]])
        tgt_ids = tokenizers.encode_tgt([tgt])[0]
        with torch.no_grad():
            logits = model(src_ids, torch.tensor([[BOS_ID, *tgt_ids]]))  # (T, V)
        allowed = torch.ones(logits.shape[-1], dtype=torch.bool)
        allowed[[loaded.model.pad_id, BOS_ID]] = False
        log_probs = logits - torch.logsumexp(logits[:, allowed], dim=-1, keepdim=True)
        expected.append([log_probs[t, token].item() for t, token in enumerate([*tgt_ids, EOS_ID])])
    return expected


def test_score_equals_the_models_log_softmax_on_torch_and_ctranslate2(workdir: Path):
    run = workdir / "runs" / "tiny"
    expected = reference_log_probs(run)
    sources, targets = [s for s, _ in PAIRS], [t for _, t in PAIRS]
    on_torch = Translator.from_run(run, device="cpu", engine="torch").score(sources, targets)
    for pair, reference in zip(on_torch, expected):
        assert pair.token_log_probs == pytest.approx(reference, abs=1e-5)
        assert pair.log_prob == pytest.approx(sum(reference), abs=1e-4)
        assert pair.per_token == pytest.approx(sum(reference) / len(reference), abs=1e-5)
        assert pair.tokens[-1] == "</s>" and len(pair.tokens) == len(reference)
    pytest.importorskip("ctranslate2")
    on_ct2 = Translator.from_run(run, device="cpu", engine="ctranslate2")
    assert on_ct2.engine.name == "ctranslate2"
    for pair, reference in zip(on_ct2.score(sources, targets), on_torch):
        assert pair.token_log_probs == pytest.approx(reference.token_log_probs, abs=1e-4)
    # A wrong translation of a training source scores below the right one.
    assert on_torch[3].per_token > on_torch[len(SOURCES) + 1].per_token


def test_score_command_reads_files_and_stdin_and_writes_jsonl(workdir: Path, tmt_here):
    (workdir / "pairs.en").write_text("".join(s + "\n" for s, _ in PAIRS), encoding="utf-8")
    (workdir / "pairs.it").write_text("".join(t + "\n" for _, t in PAIRS), encoding="utf-8")
    common = ["score", "--run", "runs/tiny", "--engine", "torch"]
    from_files = tmt(*common, "--source", "pairs.en", "--target", "pairs.it", cwd=workdir)  # as started: a process
    assert from_files.returncode == 0, from_files.stderr
    rows = [line.split("\t") for line in from_files.stdout.splitlines()]
    expected = reference_log_probs(workdir / "runs" / "tiny")
    assert [float(total) for total, _ in rows] == pytest.approx([sum(e) for e in expected], abs=1e-3)
    assert [float(mean) for _, mean in rows] == pytest.approx([sum(e) / len(e) for e in expected], abs=1e-3)
    from_stdin = tmt_here(*common, cwd=workdir, stdin="".join(f"{s}\t{t}\n" for s, t in PAIRS))
    assert from_stdin.returncode == 0 and from_stdin.stdout == from_files.stdout
    jsonl = tmt_here(*common, "--source", "pairs.en", "--target", "pairs.it", "--format", "jsonl",
                     "--output", "scores.jsonl", cwd=workdir)
    assert jsonl.returncode == 0, jsonl.stderr
    records = [json.loads(line) for line in (workdir / "scores.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(r["source"], r["target"]) for r in records] == PAIRS
    for record, reference in zip(records, expected):
        assert record["token_log_probs"] == pytest.approx(reference, abs=1e-3)
        assert len(record["tokens"]) == len(record["token_log_probs"])


@pytest.mark.parametrize("files, args, stdin, message", [
    ({"a.en": "Good morning.\n"}, ["--source", "a.en", "--target", "missing.it"], None, "missing.it: cannot read"),
    ({"a.en": "Good morning.\nThank you.\n", "a.it": "Buongiorno.\n"}, ["--source", "a.en", "--target", "a.it"],
     None, "a.en has 2 lines but a.it has 1"),
    ({"a.en": "Good morning.\n\n", "a.it": "Buongiorno.\nGrazie.\n"}, ["--source", "a.en", "--target", "a.it"],
     None, "a.en line 2: the source is empty"),
    ({"a.en": "", "a.it": ""}, ["--source", "a.en", "--target", "a.it"], None, "nothing to score"),
    ({}, ["--source", "a.en"], None, "--source and --target go together"),
    ({}, [], "Good morning.\tBuongiorno.\nThank you.\n", "stdin line 2: expected source<TAB>target"),
    ({}, [], "Good morning.\t\n", "stdin line 1: the target is empty"),
    ({}, [], "Good morning.\t" + "Buongiorno " * 80 + "\n", "line 1: the target is"),
])
def test_bad_score_input_gets_one_line(workdir: Path, tmp_path: Path, files: dict, args: list, stdin: str | None,
                                       message: str, tmt_here):
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    result = tmt_here("score", "--run", str(workdir / "runs" / "tiny"), "--engine", "torch", *args, cwd=tmp_path,
                      stdin=stdin or "")
    assert result.returncode != 0 and result.stdout == ""
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
