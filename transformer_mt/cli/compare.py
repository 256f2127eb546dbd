"""`tmt compare`: several runs (their final tests) or hypothesis files on one test set, with
confidence intervals, significance against the first, seed groups, config differences and the
sentences each system wins most; a terminal table, markdown or JSON."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.cli.arguments import add_command, file_path, non_negative_int, positive_int
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.config.schema import BLEU_TOKENIZERS
from transformer_mt.core.errors import DataError, UsageError
from transformer_mt.core.run_layout import RunDir
from transformer_mt.data.glossary import GLOSSARY_CASES

COMPARE_EXAMPLES = """examples:
  # the demo against another seed of it (the first is the baseline)
  tmt train --config configs/demo.yaml --run-dir runs/demo-seed2 --set seed=2
  tmt compare runs/demo runs/demo-seed2
  tmt compare base.it new.it --ref test.it        # hypothesis files
  # tables to paste into a report
  tmt compare runs/demo runs/demo-seed2 --format markdown
  # term accuracy too: the share of a glossary's terms the translations hold
  tmt compare base.it terms.it --ref test.it --src test.en --glossary terms.tsv
"""


def add_parser(commands) -> None:
    """`tmt compare`: its options, help and examples."""
    compare = add_command(commands, "compare", "compare runs or hypothesis files on one test set: intervals, "
                                                "significance, seed groups, config differences, sentences",
                           COMPARE_EXAMPLES)
    compare.add_argument("systems", nargs="+", type=file_path, metavar="RUN_OR_FILE",
                         help="run directories (their final test: evaluation/test_scores.json and its hypotheses) "
                              "or hypothesis files, one line per test sentence; the first is the baseline")
    compare.add_argument("--ref", type=file_path, nargs="+", metavar="REF",
                         help="reference file(s) of the test set, line by line (default: the runs' own test split; "
                              "needed for hypothesis files alone)")
    compare.add_argument("--format", choices=["text", "markdown", "json"], default="text",
                         help="text tables (default), markdown tables, or JSON with every figure")
    compare.add_argument("--tokenize", choices=BLEU_TOKENIZERS, metavar="TOKENIZER",
                         help=f"sacreBLEU tokenizer for BLEU: {', '.join(BLEU_TOKENIZERS)} (default: the first "
                              "run's train.bleu_tokenize, else 13a)")
    compare.add_argument("--bootstrap", type=positive_int, default=1000, metavar="N",
                         help="paired bootstrap resamples, which also give the 95%% intervals (default 1000)")
    compare.add_argument("--trials", type=positive_int, default=10000, metavar="N",
                         help="approximate randomisation trials (default 10000)")
    compare.add_argument("--comet", metavar="MODEL",
                         help="add each system's COMET score (no test of its difference): a Hub model name or a "
                              "downloaded model folder; needs the comet extra (pip install 'transformer-mt[comet]')")
    compare.add_argument("--src", type=file_path,
                         help="the test set's sources, for --comet and --glossary with hypothesis files")
    compare.add_argument("--glossary", type=file_path, metavar="TERMS.tsv",
                         help="add term accuracy, tested as the other metrics: of the glossary's target terms whose "
                              "source term a sentence holds (source term<TAB>target term a line; whole words), the "
                              "share the system's translation contains (exact match, as the WMT 2021 terminology "
                              "task counts it)")
    compare.add_argument("--glossary-case", choices=GLOSSARY_CASES, default=GLOSSARY_CASES[0],
                         help="how --glossary's terms match, in sources and translations: insensitive (default) "
                              "or sensitive")
    compare.add_argument("--examples", type=non_negative_int, default=3, metavar="K",
                         help="sentences shown where each system gains most over the first by sentence chrF, and "
                              "where it loses most (default 3)")


@dataclass
class System:
    """One compared system: its name as given, hypotheses, test references (a run's own), config."""

    name: str
    hypotheses: list[str]
    references: list[str] | None
    sources: list[str] | None  # a run's test sources; None for a hypothesis file
    config: dict | None  # a run's; None for a hypothesis file
    tokenize: str | None


def run_compare(args: argparse.Namespace) -> None:
    from transformer_mt.data.sources import read_lines
    from transformer_mt.cli.arguments import read_glossary_option
    from transformer_mt.evaluate.comparison import config_differences, paired_tests, seed_groups, winning_segments
    from transformer_mt.evaluate.metrics import bleu_tokenizer_problem, pair_scores

    setup_logging(logging.WARNING)
    if len(args.systems) < 2:
        raise UsageError("compare needs two systems or more: run directories or hypothesis files, the first the "
                         "baseline")
    if args.tokenize and (problem := bleu_tokenizer_problem(args.tokenize)):
        raise UsageError(f"--tokenize: {problem}")
    if args.comet:  # the package and the model, before anything is read
        from transformer_mt.evaluate.comet import comet_checkpoint

        comet_checkpoint(args.comet)
    glossary = read_glossary_option(args)
    systems = [_load_system(path) for path in args.systems]
    references = _references(systems, [[line.strip() for line in read_lines(path)] for path in args.ref or []],
                             args.ref or [])
    sources, comet = None, None
    if args.comet or glossary is not None:
        sources = _sources(systems, args.src, len(references[0]), "--comet" if args.comet else "--glossary")
    if glossary is not None and not any(glossary.targets(source) for source in sources):
        raise UsageError(f"--glossary {args.glossary}: no source sentence of the test set holds one of its terms")
    if args.comet:  # loaded once for every system, once the inputs are known to be there
        from transformer_mt.evaluate.comet import Comet

        comet = Comet.load(args.comet)
    tokenize = args.tokenize or next((s.tokenize for s in systems if s.tokenize), "13a")
    named = [(system.name, system.hypotheses) for system in systems]
    comparison = paired_tests(named, references, tokenize=tokenize, n_bootstrap=args.bootstrap, n_trials=args.trials,
                              glossary=glossary, sources=sources)
    first = {}  # a run given again is no seed of its own group: it would be counted twice
    groups = seed_groups([s.config if first.setdefault(path.resolve(), i) == i else None
                          for i, (path, s) in enumerate(zip(args.systems, systems))],
                         {metric: [r.score for r in rows] for metric, rows in comparison.results.items()})
    differences = config_differences([s.config for s in systems])
    segments = [winning_segments(s.hypotheses, systems[0].hypotheses, references, args.examples)
                for s in systems[1:]]
    report = _report(systems, references, tokenize, comparison, groups, differences, segments)
    if glossary is not None:
        report["test_set"]["glossary"] = str(args.glossary)
    run = next((s for s in systems if s.sources is not None), None)
    if run is not None:  # a multilingual test set (its sources begin with target-language tags): each pair's scores
        for system, entry in zip(systems, report["systems"]):
            if pairs := pair_scores(run.sources, system.hypotheses, references, run.config["data"]["src_lang"],
                                    tokenize):
                entry["pairs"] = pairs
    if comet is not None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        for system, entry in zip(systems, report["systems"]):
            result = comet.score(sources, system.hypotheses, references[0], device=device)
            entry["scores"]["comet"] = {"score": round(result.score, 4)}
        report["test_set"]["comet_model"] = args.comet
    if args.format == "json":
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        print(_tables(report, markdown=args.format == "markdown"))


def _load_system(path: Path) -> System:
    """A run directory's final test (its hypotheses and its test split), or a hypothesis file."""
    if path.is_dir():
        paths = RunDir(path)
        if not paths.config.is_file():
            raise UsageError(f"{path}: a directory but not a run (no {RunDir.CONFIG}); give run directories or "
                             "hypothesis files")
        try:
            report = json.loads(paths.test_scores.read_text(encoding="utf-8"))
            hypotheses_file = paths.evaluation / report["hypotheses"]
        except (OSError, ValueError, KeyError, TypeError):
            raise DataError(f"{path}: no final test to compare ({paths.test_scores} is missing or unreadable); "
                            "let the run finish with train.test_at_end, or compare hypothesis files with --ref") \
                from None
        from transformer_mt.config.loading import load_config
        from transformer_mt.config.schema import config_to_dict
        from transformer_mt.data.corpus import load_run_corpus
        from transformer_mt.data.sources import read_lines

        cfg = load_config(paths.config)
        test = load_run_corpus(cfg.data, cfg.seed, path).test
        return System(str(path), [line.strip() for line in read_lines(hypotheses_file)], list(test["tgt"]),
                      list(test["src"]), config_to_dict(cfg), cfg.train.bleu_tokenize)
    if not path.is_file():
        raise UsageError(f"{path}: no such run directory or hypothesis file")
    from transformer_mt.data.sources import read_lines

    return System(str(path), [line.strip() for line in read_lines(path)], None, None, None, None)


def _references(systems: list[System], given: list[list[str]], paths: list[Path]) -> list[list[str]]:
    """The reference streams every system is scored against: --ref's files, else the runs' test
    split, which must be one and the same; every system has a line per reference."""
    if given:
        references, where = given, f"--ref {paths[0]}"
    else:
        run = next((s for s in systems if s.references is not None), None)
        if run is None:
            raise UsageError("hypothesis files need their references: add --ref FILE (or compare runs, whose "
                             "test split is the reference)")
        references, where = [run.references], f"{run.name}'s test split"
    for stream, path in zip(references[1:], paths[1:]):
        if len(stream) != len(references[0]):
            raise DataError(f"{paths[0]} has {len(references[0])} lines but {path} has {len(stream)}")
    for system in systems:
        if system.references is not None and system.references != references[0]:
            raise DataError(f"{system.name} was tested on another test set than {where}; compare systems on one "
                            "test set")
        if len(system.hypotheses) != len(references[0]):
            raise DataError(f"{system.name} has {len(system.hypotheses)} translations but {where} has "
                            f"{len(references[0])} sentences")
    return references


def _sources(systems: list[System], path: Path | None, count: int, reader: str) -> list[str]:
    """The test sources `reader` (--comet, --glossary) reads: --src, else a run's own."""
    if path is not None:
        from transformer_mt.data.sources import read_lines

        sources = [line.strip() for line in read_lines(path)]
        if len(sources) != count:
            raise DataError(f"--src {path} has {len(sources)} lines but the test set has {count} sentences")
        return sources
    run = next((s for s in systems if s.sources is not None), None)
    if run is None:
        raise UsageError(f"{reader} reads the sources too: add --src FILE (or compare runs, whose test split has "
                         "them)")
    return run.sources


def _report(systems, references, tokenize, comparison, groups, differences, segments) -> dict:
    """Everything `compare` found, as JSON-ready values (scores rounded to 2 decimals, p to 4)."""
    def result(r) -> dict:
        entry = {"score": round(r.score, 2), "ci95": [round(r.mean - r.ci, 2), round(r.mean + r.ci, 2)]}
        if r.p_bootstrap is not None:
            entry.update(p_bootstrap=round(r.p_bootstrap, 4), p_randomization=round(r.p_randomization, 4),
                         significant=r.significant)
        return entry

    return {
        "test_set": {"sentences": len(references[0]), "references": len(references), "tokenize": tokenize},
        "systems": [{"name": s.name, "kind": "file" if s.config is None else "run",
                     "seed": s.config.get("seed") if s.config else None,
                     "scores": {metric: result(rows[i]) for metric, rows in comparison.results.items()},
                     "config_differences": {key: [_plain(a), _plain(b)] for key, a, b in differences[i]}}
                    for i, s in enumerate(systems)],
        "seed_groups": [{"systems": [systems[i].name for i in g.members], "seeds": g.seeds,
                         "mean": {m: round(v, 2) for m, v in g.mean.items()},
                         "sd": {m: None if v is None else round(v, 2) for m, v in g.sd.items()}} for g in groups],
        "segments": [{"system": s.name, "wins": [vars(seg) | {"gain": round(seg.gain, 2)} for seg in wins],
                      "losses": [vars(seg) | {"gain": round(seg.gain, 2)} for seg in losses]}
                     for s, (wins, losses) in zip(systems[1:], segments)],
        "signatures": comparison.signatures,
    }


def _plain(value):
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _tables(report: dict, markdown: bool) -> str:
    """The report as aligned text tables, or as markdown tables."""
    from transformer_mt.evaluate.comparison import metric_name

    test = report["test_set"]
    metrics = [m for m in report["systems"][0]["scores"] if m != "comet"]  # METRICS, then term accuracy
    out = [f"{test['sentences']} sentences, {test['references']} reference(s), BLEU tokenizer {test['tokenize']}; "
           f"p: paired bootstrap / approximate randomisation against {report['systems'][0]['name']}"
           + (" (* below 0.05 in both)" if len(report["systems"]) > 1 else ""), ""]
    comet = "comet_model" in test
    rows = [["system", *[metric_name(m) for m in metrics], *(["COMET"] if comet else [])]]
    for system in report["systems"]:
        cells = [system["name"]]
        for metric in metrics:
            r = system["scores"][metric]
            cell = f"{r['score']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"
            if "p_bootstrap" in r:
                cell += f" p={_p(r['p_bootstrap'])}/{_p(r['p_randomization'])}{'*' if r['significant'] else ''}"
            cells.append(cell)
        if comet:
            cells.append(f"{system['scores']['comet']['score']:.4f}")
        rows.append(cells)
    out += _table(rows, markdown) + [""]
    if pairs := report["systems"][0].get("pairs"):  # BLEU and chrF of each language pair, without tests
        rows = [["per language pair", *(f"{pair} ({s['sentences']}) {name}" for pair, s in pairs.items()
                                        for name in ("BLEU", "chrF"))]]
        rows += [[system["name"], *(f"{s[metric]:.2f}" for s in system["pairs"].values() for metric in ("bleu", "chrf"))]
                 for system in report["systems"]]
        out += _table(rows, markdown) + [""]
    groups = [g for g in report["seed_groups"] if len(g["systems"]) > 1]
    if groups:
        rows = [["seed group", "seeds", *[f"{metric_name(m)} mean ± sd" for m in metrics]]]
        for group in groups:
            rows.append([", ".join(group["systems"]), ", ".join(map(str, group["seeds"])),
                         *[f"{group['mean'][m]:.2f} ± {group['sd'][m]:.2f}" for m in metrics]])
        out += _table(rows, markdown) + [""]
    for system in report["systems"][1:]:
        changes = system["config_differences"]
        if changes:
            shown = ", ".join(f"{key}: {a} -> {b}" for key, (a, b) in changes.items())
            out.append(f"config of {system['name']} against {report['systems'][0]['name']}: {shown}")
    if any(s["config_differences"] for s in report["systems"][1:]):
        out.append("")
    base = report["systems"][0]["name"]
    for entry in report["segments"]:
        for title, segments in ((f"where {entry['system']} wins most over {base}", entry["wins"]),
                                (f"where {base} wins most over {entry['system']}", entry["losses"])):
            if not segments:
                continue
            out.append(f"{'### ' if markdown else ''}{title} (sentence chrF)")
            if markdown:
                out.append("")
            for seg in segments:
                lines = [f"line {seg['line']}, chrF {seg['gain']:+.2f}", f"reference: {seg['reference']}",
                         f"{entry['system']}: {seg['hypothesis']}", f"{base}: {seg['baseline']}"]
                out += ([f"- {lines[0]}"] + [f"  - {line}" for line in lines[1:]]) if markdown else \
                    [f"  {lines[0]}"] + [f"    {line}" for line in lines[1:]]
            out.append("")
    return "\n".join(out).rstrip("\n")


def _p(value: float) -> str:
    """A p-value in 3 decimals; one below 0.001 (the fewest a test of 1000 resamples gives) as <0.001."""
    return f"{value:.3f}" if value >= 0.001 else "<0.001"


def _table(rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
        return lines + ["| " + " | ".join(row) + " |" for row in rows[1:]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
