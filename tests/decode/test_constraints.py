"""Glossaries and hard lexical constraints: which terms a sentence holds (`data/glossary.py`), the
constrained beam search (every hypothesis contains its sentence's terms, scored with its true
log-probability, fixed-shape steps as eager ones), and `tmt translate`/`evaluate` with --glossary or
jsonl constraints, their refusals in one line and the engine they pick."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import transformer_mt.decode.generator as decoding
from tests.helpers import (BOS, EOS, PAD, SOURCES, assert_same_hypotheses, random_model, random_prefixes,
                           random_sources, random_terms, teacher_forced_log_prob)
from transformer_mt.core.errors import DataError, UsageError
from transformer_mt.data.glossary import read_glossary
from transformer_mt.decode.generator import StepGraphs, beam_search
from transformer_mt.decode.search import allocation_order, bank, matched_after

DEMO_GLOSSARY = Path(__file__).parent / "demo_glossary.tsv"
DEMO = Path(__file__).parents[2] / "transformer_mt" / "corpora" / "demo_en_it"
DEMO_CONFIG = Path(__file__).parents[2] / "configs" / "demo.yaml"


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


# --- the glossary ------------------------------------------------------------------------------

def test_a_glossary_matches_whole_words_longest_first_in_order_each_term_once(tmp_path: Path):
    glossary = read_glossary(write(tmp_path / "g.tsv", "# a comment\n\ncat\tgatto\nNew York\tNew York\n"
                                                       "New York City\tla città di New York\ncaffè\tcaffè\n"
                                                       "train station\tstazione\n"))
    assert glossary.matches("The category of cats.") == []  # no match inside a word
    assert glossary.matches("A cat, a CAT: Cat!") == [("cat", "gatto")]
    assert glossary.matches("New York City has a cat and New York.") == [
        ("New York City", "la città di New York"), ("cat", "gatto"), ("New York", "New York")]
    assert glossary.matches("un caffè, non caffèlatte") == [("caffè", "caffè")]  # Unicode word boundaries
    assert glossary.matches("The  train\tstation") == [("train station", "stazione")]  # any spaces between words
    assert glossary.targets("cat") == ["gatto"] and [t.line for t in glossary.terms] == [3, 4, 5, 6, 7]
    # a match that case folding spells otherwise (Turkish dotless ı, upper case I) still finds its term
    turkish = read_glossary(write(tmp_path / "tr.tsv", "ılık\ttiepido\n"))
    assert turkish.matches("ILIK su") == [("ılık", "tiepido")]


def test_a_case_sensitive_glossary_matches_the_terms_as_written(tmp_path: Path):
    glossary = read_glossary(write(tmp_path / "g.tsv", "US\tStati Uniti\nus\tci\n"), case="sensitive")
    assert glossary.matches("Tell us about the US.") == [("us", "ci"), ("US", "Stati Uniti")]
    with pytest.raises(DataError, match=r"line 2: the source term 'us' is already on line 1$"):
        read_glossary(tmp_path / "g.tsv")  # insensitive: the same term twice


@pytest.mark.parametrize("content, message", [
    ("cat\tgatto\ndog cane\n", "line 2: no tab; write source term<TAB>target term"),
    ("cat\tgatto\tmicio\n", "line 1: 2 tabs; write source term<TAB>target term"),
    ("cat\t \n", "line 1: the target term is empty"),
    ("\tgatto\n", "line 1: the source term is empty"),
    (b"cat\tgatto\ndog\tcan\xe8\n", "line 2: not valid UTF-8 (unexpected end of data at byte 7)"),
    ("# nothing\n\n", ": no terms (a line is source term<TAB>target term)"),
])
def test_a_bad_glossary_is_one_line_naming_the_file_and_line(tmp_path: Path, content, message):
    path = write(tmp_path / "g.tsv", content)
    with pytest.raises(DataError) as refused:
        read_glossary(path)
    assert str(refused.value) == f"glossary {path}{'' if message.startswith(':') else ' '}{message}"


# --- the constrained search ----------------------------------------------------------------------

def term_lists(terms: torch.Tensor) -> list[list[list[int]]]:
    return [[term[term != PAD].tolist() for term in sentence if (term != PAD).any()] for sentence in terms]


def contains(ids: list[int], term: list[int]) -> bool:
    return any(ids[i:i + len(term)] == term for i in range(len(ids) - len(term) + 1))


SEARCH = {"bos_id": BOS, "eos_id": EOS, "beam_size": 4, "n_best": 3, "max_len_a": 1.5, "max_len_b": 8}


@pytest.mark.parametrize("seed", range(3))
def test_every_hypothesis_contains_its_sentences_terms_and_carries_its_true_log_probability(seed):
    model, src = random_model(seed), random_sources(seed, batch=6, max_len=12)
    terms = random_terms(seed, 6)
    prefixes = random_prefixes(seed, 6, max_len=3) if seed == 2 else None
    limits = decoding.max_target_lengths(src != PAD, 1.5, 8, model.cfg.max_len).tolist()
    results = beam_search(model, src, terms=terms, prefixes=prefixes, **SEARCH)
    for i, (hyps, wanted) in enumerate(zip(results, term_lists(terms))):
        assert hyps, f"sentence {i} has no hypothesis"
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        for h in hyps:
            assert all(contains(h.ids, term) for term in wanted), (i, h.ids, wanted)
            if prefixes is not None:
                prefix = prefixes[i][prefixes[i] != PAD].tolist()
                assert h.ids[:len(prefix)] == prefix
            ended = len(h.ids) < limits[i]  # cut at the cap: no EOS scored
            expected = teacher_forced_log_prob(model, src[i][src[i] != PAD], h.ids, ended)
            assert h.log_prob == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("seed", range(2))
def test_constraints_on_fixed_shape_steps_give_the_eager_output(seed):
    model, src = random_model(seed), random_sources(seed, batch=5, max_len=12)
    terms, prefixes = random_terms(seed, 5), random_prefixes(seed, 5, max_len=3)
    for extra in ({}, {"prefixes": prefixes}):
        eager = beam_search(model, src, terms=terms, **extra, **SEARCH)
        assert_same_hypotheses(beam_search(model, src, terms=terms, graphs=StepGraphs(), **extra, **SEARCH), eager)


def test_sentences_without_terms_decode_as_in_a_search_without_constraints():
    model, src = random_model(4), random_sources(4, batch=6, max_len=12)
    terms = random_terms(4, 6)  # sentences 0 and 3 have none
    constrained, plain = beam_search(model, src, terms=terms, **SEARCH), beam_search(model, src, **SEARCH)
    assert_same_hypotheses([constrained[i] for i in (0, 3)], [plain[i] for i in (0, 3)])
    assert any(constrained[i][0].ids != plain[i][0].ids for i in (1, 2, 4, 5))


def test_a_term_counts_as_met_only_where_the_output_holds_it():
    terms = torch.tensor([[[5, 5, 6], [7, PAD, PAD]]])  # (1, 2, 3): "5 5 6" and "7"
    lengths = torch.tensor([[3, 1]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        output = torch.randint(5, 8, (10,), generator=gen).tolist()
        matched = torch.zeros(1, 2, dtype=torch.long)
        for t, token in enumerate(output):
            matched = matched_after(matched, lengths, terms, torch.tensor([[token]]))[:, 0]
            for n, term in enumerate(([5, 5, 6], [7])):
                assert bool(matched[0, n] >= lengths[0, n]) == contains(output[:t + 1], term) or (
                    # a restart does not look for the term inside its own partial match: "5 5 5 6"
                    n == 0 and contains(output[:t + 1], term) and not bool(matched[0, n] >= 3))
                # what it has matched is always what the output ends with
                so_far = int(matched[0, n]) if matched[0, n] < lengths[0, n] else 0
                assert output[t + 1 - so_far:t + 1] == term[:so_far] or so_far == 0
    # the bank: every token of met terms, and the most of one unmet term
    assert bank(torch.tensor([[3, 0], [2, 1], [1, 0]]), torch.tensor([[3, 1]] * 3)).tolist() == [3, 3, 1]


def test_the_banks_take_turns_best_first_and_the_highest_bank_leads():
    scores = torch.tensor([[-1.0, -2.0, -3.0, -0.5, float("-inf"), -4.0]])
    banks = torch.tensor([[0, 0, 1, 0, 2, 2]])
    # rank 0: bank 2 (-4.0; the -inf one goes last), bank 1 (-3.0), bank 0 (-0.5); rank 1: bank 0 (-1.0), ...
    assert allocation_order(scores, banks, top_bank=2).tolist() == [[5, 2, 3, 0, 1, 4]]


# --- the command line on the tiny run ------------------------------------------------------------

TINY_GLOSSARY = "station\tstazione\ncoffee\tcaffè\nbook\tlibro\nbread\tpane\nwater\tacqua\n"


def test_a_glossary_puts_its_terms_in_every_translation_whose_source_has_them(workdir: Path, tmt_here):
    write(workdir / "g.tsv", TINY_GLOSSARY)
    write(workdir / "in.en", "".join(line + "\n" for line in SOURCES))
    result = tmt_here("translate", "--run", "runs/tiny", "--beam", "3", "--glossary", "g.tsv", "--input", "in.en",
                      "--quiet", cwd=workdir)
    assert result.returncode == 0, result.stderr
    outputs = result.stdout.splitlines()
    glossary = read_glossary(workdir / "g.tsv")
    forced = [(target, output) for source, output in zip(SOURCES, outputs) for target in glossary.targets(source)]
    assert len(forced) == 5 and all(target in output for target, output in forced), forced
    # CTranslate2 (auto's engine on a CPU) cannot force terms: auto takes torch and says so
    assert result.stderr.count("translating with the torch engine") == 1
    # the same terms as jsonl constraints, with n-best lists
    write(workdir / "in.jsonl", "".join(json.dumps({"source": source, "constraints": glossary.targets(source)}) + "\n"
                                        for source in SOURCES))
    result = tmt_here("translate", "--run", "runs/tiny", "--beam", "3", "--input-format", "jsonl", "--input",
                      "in.jsonl", "--n-best", "2", "--format", "jsonl", "--quiet", cwd=workdir)
    assert result.returncode == 0, result.stderr
    lists = [json.loads(line) for line in result.stdout.splitlines()]
    assert [entry["hypotheses"][0] for entry in lists] == outputs
    for source, entry in zip(SOURCES, lists):
        assert all(target in hypothesis for target in glossary.targets(source) for hypothesis in entry["hypotheses"])


def test_tmt_evaluate_with_a_glossary_forces_its_terms_and_names_its_hypotheses(workdir: Path, tmt_here):
    write(workdir / "g.tsv", TINY_GLOSSARY)
    result = tmt_here("evaluate", "--run", "runs/tiny", "--beam", "3", "--glossary", "g.tsv", "--quiet",
                      "--no-diagnostics", "--bootstrap", "0", cwd=workdir)
    assert result.returncode == 0, result.stderr
    [hypotheses] = (workdir / "runs" / "tiny" / "evaluation").glob("test.*.beam3.glossary-g.tsv-*.txt")
    assert "caffè" in hypotheses.read_text(encoding="utf-8").splitlines()[0]  # "The coffee is hot."
    assert "Term accuracy = 100.00  nrefs:1|case:insensitive" in result.stdout  # every term, as forced


@pytest.mark.parametrize("args, glossary, stdin, message", [
    (["--glossary", "g\x00.tsv"], None, None, "tmt translate: argument --glossary: a file name cannot hold a NUL "
                                               "character"),
    (["--glossary", "g.tsv"], "station\tstazione\ncoffee caffè\n", None,
     "glossary g.tsv line 2: no tab; write source term<TAB>target term"),
    (["--glossary", "g.tsv"], b"station\tstazione\ncoffee\tcaff\xe8\n", None,
     "glossary g.tsv line 2: not valid UTF-8 (unexpected end of data at byte 11)"),
    (["--glossary", "g.tsv"], "station\tstazione\ncoffee\tкофе\n", None,
     "glossary g.tsv line 2: the term 'кофе' has characters the target vocabulary cannot spell ('кофе'; they "
     "would come out as <unk>)"),
    (["--glossary", "g.tsv", "--beam", "1"], TINY_GLOSSARY, None,
     "constraints (a glossary's terms) need beam search with a beam of 2 or more: one beam would always follow "
     "the hypothesis that has met the most terms, putting them first"),
    (["--glossary", "g.tsv", "--beam", "3", "--engine", "ctranslate2"], TINY_GLOSSARY, None,
     "--engine ctranslate2 cannot force a glossary's terms (CTranslate2 has no lexical constraints): leave out "
     "--engine, or use --engine torch"),
    (["--glossary", "g.tsv", "--sample"], TINY_GLOSSARY, None,
     "--glossary forces terms by beam search; --sample draws each token freely: leave out one"),
    (["--input-format", "jsonl", "--beam", "2"], None,
     '{"source": "Good morning."}\n{"source": "Where is the station?", "constraints": ["la", "stazione"]}\n',
     "line 2: 2 terms; a beam of 2 holds at most 1 (a beam for each bank of terms met, one for none): use a beam "
     "of 3 or more"),
    (["--input-format", "jsonl", "--beam", "3"], None,
     json.dumps({"source": "Good morning.", "constraints": ["stazione " * 9]}) + "\n",
     "line 1: the terms are 18 tokens; this sentence's translation is capped at 17 tokens with its EOS "
     "(decode.max_len_a=1.5 × 5 source tokens with EOS + decode.max_len_b=10, at most model.max_len=64)"),
    (["--input-format", "jsonl", "--beam", "3"], None, '{"source": "Good morning.", "constraints": ["a", " "]}\n',
     'stdin line 1: "constraints" has an empty term'),
    (["--input-format", "jsonl", "--beam", "3"], None, '{"source": "Good morning.", "constraints": "stazione"}\n',
     'stdin line 1: "constraints" must be a list of strings, got "stazione"'),
    (["--input-format", "jsonl", "--show-attention", "a.png"], None,
     '{"source": "Good morning.", "constraints": ["pane"]}\n',
     '--show-attention draws a translation without terms forced; leave out the line\'s "constraints"'),
])
def test_bad_glossaries_and_constraints_are_one_line(workdir: Path, tmt_here, args, glossary, stdin, message):
    if glossary is not None:
        write(workdir / "g.tsv", glossary)
    result = tmt_here("translate", "--run", "runs/tiny", *args, *([] if stdin else ["Where is the station?"]),
                      cwd=workdir, stdin=stdin)
    assert result.returncode in (1, 2) and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == f"tmt: error: {message}", result.stderr


def test_the_ctranslate2_engine_refuses_constraints_in_one_line(workdir: Path):
    from transformer_mt.decode.translator import Translator

    translator = Translator.from_run(workdir / "runs" / "tiny", device="cpu", engine="ctranslate2")
    assert translator.translate(["Where is the station?"], beam_size=3, constraints=[[]])  # no terms: fine
    with pytest.raises(UsageError, match=r"^constraints \(a glossary's terms\) need the torch engine; CTranslate2 has "
                                         r"no lexical constraints: translate with --engine torch \(or auto\)$"):
        translator.translate(["Where is the station?"], beam_size=3, constraints=[["stazione"]])


# --- the demo ----------------------------------------------------------------------------------

@pytest.mark.skipif(not os.environ.get("TMT_TEST_TRANSCRIPTS"), reason="trains the demo (minutes); set "
                    "TMT_TEST_TRANSCRIPTS=1")
@pytest.mark.longest
def test_the_demo_with_its_glossary_has_every_term_in_every_test_sentence_whose_source_has_it(tmp_path: Path,
                                                                                             tmt_here):
    from transformer_mt.decode.translator import Translator

    result = tmt_here("train", "--config", str(DEMO_CONFIG), "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    translator = Translator.from_run(tmp_path / "runs" / "demo", device="cpu", engine="torch")
    glossary = read_glossary(DEMO_GLOSSARY)
    sources = (DEMO / "test.en").read_text(encoding="utf-8").splitlines()
    constraints = [glossary.targets(source) for source in sources]
    assert len(glossary.terms) == 20 and sum(map(len, constraints)) >= 30  # 31 terms in 25 of the 60 sentences
    for beam in (3, 4):  # a sentence has 2 terms at most
        outputs = translator.translate(sources, beam_size=beam, constraints=constraints)
        missing = [(target, output) for output, targets in zip(outputs, constraints) for target in targets
                   if target not in output]
        assert missing == [], (beam, missing)
