"""`tmt translate` and `tmt evaluate`: sentences from arguments, a file, stdin or a prompt, translated
by a run, and their translations, scores and attention written where the user says (never over an input)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import sys

from transformer_mt.cli.arguments import (STDIO, add_alignment_arguments, add_command, add_glossary_arguments,
                                          add_model_arguments, check_alignment_arguments, check_glossary_terms,
                                          file_path, non_negative_int, path_or_dash, positive_float, positive_int,
                                          probability, read_glossary_option, seed_number)
from transformer_mt.cli.common import check_not_kept, check_output, load_translator, run_dir_of, shown
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.config.schema import BLEU_TOKENIZERS
from transformer_mt.core.errors import DataError, UsageError
from transformer_mt.core.files import write_error, write_lines
from transformer_mt.core.run_layout import RunDir

TRANSLATE_EXAMPLES = """examples:
  tmt translate "Where is the station?"           # the newest run under ./runs
  tmt translate --run runs/demo "Good morning." "Thank you!"
  tmt translate --run runs/demo --beam 5 --input test.en --output test.it
  tmt translate --checkpoint runs/demo/checkpoints/step_00001200.pt \\
      < input.en > output.it
  tmt translate --run runs/demo --show-attention attention.png \\
      "Where is the station?"
  # at a terminal: type a sentence, get its translation
  tmt translate --run runs/demo
  tmt translate --run runs/demo --beam 5 --n-best 3 --scores \\
      "Where is the station?"
  tmt translate --run runs/demo --beam 5 --n-best 5 --format jsonl \\
      --input transformer_mt/corpora/demo_en_it/test.en > test.nbest.jsonl
  tmt translate --run runs/demo --sample --top-p 0.9 --seed 1 --n-best 2 \\
      "Where is the station?"
  # every translation begins with "Mia"; or a prefix per line of a jsonl file
  tmt translate --run runs/demo --prefix "Mia" "My sister is at home."
  tmt translate --run runs/demo --input-format jsonl --input requests.jsonl
  # translation<TAB>word alignment (Pharaoh links: source word-target word)
  tmt translate --run runs/demo --alignments "Where is the station?"
  # a glossary's target terms in every translation whose source has the term
  tmt translate --run runs/demo --beam 4 --glossary terms.tsv --input test.en
"""

EVALUATE_EXAMPLES = """examples:
  tmt evaluate --run runs/demo                    # the run's test split, greedy
  tmt evaluate --run runs/demo --split valid --beam 5
  # pre-tokenized text
  tmt evaluate --run runs/m30k --src test.en --ref test.de --tokenize none
  # two references of each sentence
  tmt evaluate --run runs/demo --src test.en --ref test.it other.it
  # the test split translated with a glossary's terms forced
  tmt evaluate --run runs/demo --beam 4 --glossary terms.tsv
"""


def add_parser(commands) -> None:
    """`tmt translate`: its options, help and examples."""
    translate = add_command(commands, "translate", "translate sentences with a trained run", TRANSLATE_EXAMPLES)
    translate.add_argument("text", nargs="*", help="sentences to translate (default: one per line from stdin)")
    add_model_arguments(translate)
    translate.add_argument("--input", type=path_or_dash, help="translate this file, one sentence per line (- = stdin)")
    translate.add_argument("--output", type=path_or_dash,
                           help="write translations here instead of stdout (- = stdout)")
    translate.add_argument("--input-format", choices=["text", "jsonl"], default="text",
                           help="text (default): a sentence per line; jsonl: a JSON object per line, "
                                '{"source": "...", "prefix": "...", "constraints": ["...", ...]}, the prefix '
                                '("": none) and the constraints (target terms the translation must contain, '
                                "beam 2 or more, the torch engine) optional")
    translate.add_argument("--prefix", metavar="TEXT",
                           help="begin every translation with TEXT (tokenized as target text; the model "
                                "continues from it); the output is the whole translation, TEXT included")
    translate.add_argument("--show-attention", type=file_path, metavar="FILE.png",
                           help="draw the cross-attention of the (single) sentence's translation to FILE.png "
                                "(or .jpg, .pdf, .svg, ...: the format the suffix names)")
    translate.add_argument("--attention-layer", type=int, metavar="N",
                           help="decoder layer to draw for --show-attention: 0 is the first, -1 (default) the last")
    translate.add_argument("--interactive", action="store_true",
                           help="translate each line as it is typed (the default when stdin is a terminal and "
                                "no sentence, --input or --output is given)")
    lists = translate.add_argument_group("n-best lists, scores and sampling (the Translating guide)")
    lists.add_argument("--n-best", type=positive_int, default=1, metavar="K",
                       help="the K best translations of each sentence (K at most the beam size), best first; "
                            "text output: one line each, '<sentence number from 0><TAB>[<score><TAB>]<translation>'")
    lists.add_argument("--scores", action="store_true",
                       help="put each translation's score before it and a TAB: its log-probability over the length "
                            "penalty length^alpha (the length counting the EOS), as beam search ranks them")
    lists.add_argument("--format", choices=["text", "jsonl"], default="text",
                       help="text (default), or jsonl: one JSON object per sentence with source, hypotheses, "
                            "scores and tokens (BPE pieces)")
    lists.add_argument("--sample", action="store_true",
                       help="draw translations from the model instead of searching (back-translation); "
                            "--n-best K draws K per sentence")
    lists.add_argument("--temperature", type=positive_float, metavar="T",
                       help="with --sample: divide the logits by T (default 1; below 1 sharper, above flatter)")
    lists.add_argument("--top-k", type=non_negative_int, metavar="K",
                       help="with --sample: draw from the K most probable tokens only (default 0: all)")
    lists.add_argument("--top-p", type=probability, metavar="P",
                       help="with --sample: draw from the most probable tokens that together reach probability P "
                            "(nucleus sampling; default 1: all)")
    lists.add_argument("--seed", type=seed_number, metavar="N",
                       help="with --sample: the random seed (default 0); the same input (lines and their order), "
                            "options and seed give the same samples on the same device")
    add_alignment_arguments(translate)
    add_glossary_arguments(translate)


def add_evaluate_parser(commands) -> None:
    """`tmt evaluate`: its options, help and examples."""
    evaluate = add_command(commands, "evaluate", "translate a test set and score it with sacreBLEU: BLEU, chrF, "
                                                  "chrF++ and TER with confidence intervals", EVALUATE_EXAMPLES)
    add_model_arguments(evaluate)
    evaluate.add_argument("--split", choices=["valid", "test"], default="test",
                          help="which split of the run's own data to score (default: test)")
    evaluate.add_argument("--src", type=file_path, help="source file to translate instead of a split (needs --ref)")
    evaluate.add_argument("--ref", type=file_path, nargs="+", metavar="REF",
                          help="reference translations of --src, line by line; several files: several references "
                               "of each sentence (sacreBLEU's multi-reference scores)")
    evaluate.add_argument("--bootstrap", type=non_negative_int, default=1000, metavar="N",
                          help="bootstrap resamples for each score's 95%% confidence interval, sacreBLEU's "
                               "(seed: SACREBLEU_SEED, default 12345); 0 = no interval (default 1000)")
    evaluate.add_argument("--comet", metavar="MODEL",
                          help="also score with COMET: a Hub model name (Unbabel/wmt22-comet-da) or a downloaded "
                               "model folder; needs the comet extra (pip install 'transformer-mt[comet]')")
    evaluate.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                          help="leave out the diagnostics printed after the scores: copies of the source, untranslated "
                               "output, another script, n-gram loops, length outliers, numbers, URLs and end "
                               "punctuation that differ from the source, chrF by source length")
    evaluate.add_argument("--tokenize", choices=BLEU_TOKENIZERS, metavar="TOKENIZER",
                          help=f"sacreBLEU tokenizer for BLEU: {', '.join(BLEU_TOKENIZERS)} (default: the run's "
                               "train.bleu_tokenize, normally 13a; none for pre-tokenized text)")
    evaluate.add_argument("--output", type=path_or_dash,
                          help="where to write the hypotheses (default: in <run>/evaluation/, named "
                               "<name>.<checkpoint>.beam<K>[.lp<ALPHA>][.int8].txt; with --glossary, "
                               ".glossary-<file>-<digest> before .txt)")
    add_glossary_arguments(evaluate, "the translation")


def run_translate(args: argparse.Namespace) -> None:
    from transformer_mt.data.sources import read_lines, read_stream_lines

    setup_logging(logging.WARNING)
    _check_options(args)
    glossary = read_glossary_option(args)
    # Typing at a terminal with nothing else to read or write: translate each line as it comes.
    interactive = args.interactive or (not args.text and args.input is None and args.output is None
                                       and args.show_attention is None and sys.stdin.isatty())
    if args.input == STDIO:
        args.input = None  # `--input -`: stdin, as without --input
    if args.output == STDIO:
        args.output = None  # `--output -`: stdout, as without --output
    if interactive:
        translator = load_translator(args, constrained=glossary is not None)
        check_glossary_terms(glossary, translator)
        _translate_interactively(translator, args, glossary)
        return
    if args.input:
        lines, where = read_lines(args.input), str(args.input)
    else:
        lines = _argument_lines(args.text) if args.text else read_stream_lines(sys.stdin.buffer, "stdin")
        where = "sentence argument" if args.text else "stdin"
        if not lines:
            raise UsageError("nothing to translate: give sentences as arguments, --input FILE, "
                             "or one per line on stdin")
    lines, prefixes, constraints = _sentences_and_prefixes(lines, args, where, glossary=glossary)
    if args.show_attention:  # one non-empty sentence, and a file of its own
        if len(lines) != 1:
            raise UsageError(f"--show-attention draws one sentence; got {len(lines)}")
        if not lines[0].strip():
            raise UsageError("--show-attention: the sentence is empty; there is no attention to draw")
        if constraints:
            raise UsageError('--show-attention draws a translation without terms forced; leave out the line\'s '
                             '"constraints"')
        if args.output and args.output.resolve() == args.show_attention.resolve():
            raise UsageError(f"--output and --show-attention are the same file ({args.output}); give two names")
    files = {"--output": args.output, "--show-attention": args.show_attention}
    for option, path in files.items():
        check_output(path, option, inputs={"--input": args.input})
    for option, path in files.items():  # before loading: that may convert the run (into <run>/ctranslate2/)
        check_not_kept(path, option, run_dir_of(args))
    translator = load_translator(args, constrained=constraints is not None)
    check_glossary_terms(glossary, translator)
    if args.show_attention:
        outputs = [_draw_attention(translator, lines[0], prefixes[0] if prefixes else "", args)]
    else:
        outputs = _translate_lines(translator, lines, prefixes, args, progress=bool(args.input) and not args.quiet,
                                   constraints=constraints)
    if args.output:
        write_lines(args.output, outputs)
    else:
        for output in outputs:
            print(output)
        sys.stdout.flush()  # a closed pipe fails here, inside main's error handling, not at exit


def _check_options(args: argparse.Namespace) -> None:
    """Refuse `tmt translate` options that cannot go together, naming them, before a model loads."""
    if args.text and args.input:
        raise UsageError("give sentences as arguments or --input FILE, not both")
    if args.prefix is not None and args.input_format == "jsonl":
        raise UsageError('--prefix begins every translation; with --input-format jsonl give each line its '
                         '"prefix" field instead')
    if not args.sample:
        given = [name for name, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                          ("--top-p", args.top_p), ("--seed", args.seed)) if value is not None]
        if given:
            raise UsageError(f"{given[0]} is a sampling option: add --sample")
        if args.beam is not None and args.n_best > args.beam:
            raise UsageError(f"--n-best {args.n_best}: beam search keeps only --beam {args.beam} translations; "
                             f"use --beam {args.n_best} or more")
    elif args.beam is not None and args.beam > 1:
        raise UsageError(f"--sample draws each token and keeps no beams: leave out --beam {args.beam} "
                         "(--n-best K draws K translations)")
    if args.attention_layer is not None and not args.show_attention:
        raise UsageError("--attention-layer picks the layer --show-attention draws: add --show-attention FILE.png")
    if args.show_attention:
        from matplotlib.figure import Figure  # only when a picture is asked for

        formats = sorted(Figure().canvas.get_supported_filetypes())  # png, jpg, pdf, svg, ...
        if args.show_attention.suffix[1:].lower() not in formats:
            raise UsageError(f"--show-attention {args.show_attention}: name a picture file ending in "
                             f"{', '.join('.' + name for name in formats)}")
    check_alignment_arguments(args)
    if args.show_attention and (args.n_best > 1 or args.scores or args.format != "text" or args.sample
                                or args.alignments):
        raise UsageError("--show-attention draws the best translation of one sentence; leave out --n-best, "
                         "--scores, --format, --sample and --alignments")
    if args.show_attention and args.glossary:
        raise UsageError("--show-attention draws a translation without terms forced; leave out --glossary")
    if args.sample and args.glossary:
        raise UsageError("--glossary forces terms by beam search; --sample draws each token freely: leave out one")
    if args.interactive:
        given = [name for name, value in (("sentences as arguments", args.text), ("--input", args.input),
                                          ("--output", args.output), ("--show-attention", args.show_attention))
                 if value]
        if given:
            raise UsageError(f"--interactive reads sentences as they are typed and answers on stdout; "
                             f"leave out {', '.join(given)}")


def _sentences_and_prefixes(lines: list[str], args: argparse.Namespace, where: str, first_number: int = 1,
                            glossary=None) -> tuple[list[str], list[str] | None, list[list[str]] | None]:
    """The sentences to translate, the prefix each translation begins with (None: none) and the terms
    each must contain (None: none): the lines and --prefix, or with --input-format jsonl each line's
    "source" and "prefix" strings and "constraints" list of strings (prefix and constraints optional,
    "": no prefix; a blank line: an empty sentence); a line that is not such an object is refused as
    `<where> line <number>`. The `glossary`'s target terms of each sentence come before its own."""
    from transformer_mt.data.sources import one_line

    if args.input_format == "text":
        terms = None if glossary is None else [glossary.targets(line) for line in lines]
        return lines, None if args.prefix is None else [args.prefix] * len(lines), terms
    sentences, prefixes, constraints = [], [], []
    for number, line in enumerate(lines, start=first_number):
        place = f"{where} {number}" if where == "sentence argument" else f"{where} line {number}"
        try:
            record = json.loads(line) if line.strip() else {}
        except (ValueError, RecursionError) as err:
            raise DataError(f"{place}: not valid JSON ({err})") from None
        if not isinstance(record, dict):
            raise DataError(f'{place}: not a JSON object such as {{"source": "Good morning.", "prefix": "Buon"}}')
        if unknown := sorted(set(record) - {"source", "prefix", "constraints"}):
            raise DataError(f'{place}: "{unknown[0]}" is not a field of an input line (source, prefix, constraints)')
        if line.strip() and "source" not in record:
            raise DataError(f'{place}: no "source", the sentence to translate')
        terms = record.pop("constraints", [])
        if not isinstance(terms, list) or not all(isinstance(term, str) for term in terms):
            raise DataError(f'{place}: "constraints" must be a list of strings, got {json.dumps(terms)[:40]}')
        for key, value in record.items():
            if not isinstance(value, str):
                raise DataError(f'{place}: "{key}" must be a string, got {json.dumps(value)[:40]}')
        for term in terms:
            if not one_line(term, "constraints", place):
                raise DataError(f'{place}: "constraints" has an empty term')
        sentences.append(one_line(record.get("source"), "source", place))
        prefixes.append(one_line(record.get("prefix"), "prefix", place))
        constraints.append((glossary.targets(sentences[-1]) if glossary else []) + terms)
    return sentences, prefixes, constraints if any(constraints) or glossary else None


def _translate_lines(translator, lines: list[str], prefixes: list[str] | None, args: argparse.Namespace,
                     progress: bool, first_number: int = 0, constraints: list[list[str]] | None = None) -> list[str]:
    """The output lines for `lines` (their translations beginning with `prefixes`, containing the
    terms of `constraints`): one translation
    each, or with --n-best, --scores, --format jsonl, --sample or --alignments, the lists the
    Translating guide describes: jsonl, an object per line; text, a line per translation,
    `[<number from first_number>\t][<score>\t]<translation>[\t<links>]`."""
    if args.n_best == 1 and not args.scores and args.format == "text" and not args.sample and not args.alignments:
        return translator.translate(lines, beam_size=args.beam, progress=progress, prefixes=prefixes,
                                    constraints=constraints)
    beam = args.beam or translator.cfg.decode.beam_size
    if not args.sample and args.n_best > beam:  # the run's beam size, when --beam was left out
        raise UsageError(f"--n-best {args.n_best}: beam search keeps only the run's decode.beam_size={beam} "
                         f"translations; add --beam {args.n_best} or more")
    sampling = None
    if args.sample:
        from transformer_mt.decode.hypotheses import Sampling

        sampling = Sampling(temperature=args.temperature or 1.0, top_k=args.top_k or 0, top_p=args.top_p or 1.0,
                            seed=args.seed or 0)
    results = translator.translate_n_best(lines, n_best=args.n_best, beam_size=1 if args.sample else beam,
                                          sampling=sampling, progress=progress, prefixes=prefixes,
                                          alignments=args.alignments, alignment_layer=args.alignment_layer,
                                          constraints=constraints)
    if args.format == "jsonl":
        return [json.dumps({"source": line, "hypotheses": [t.text for t in translations],
                            "scores": [t.score for t in translations], "tokens": [t.tokens for t in translations],
                            **({"alignments": [t.alignment for t in translations]} if args.alignments else {})},
                           ensure_ascii=False) for line, translations in zip(lines, results)]
    outputs = []
    for number, translations in enumerate(results, start=first_number):
        for translation in translations:
            score = [f"{translation.score:.4f}"] if args.scores else []
            links = [translation.alignment] if args.alignments else []
            outputs.append("\t".join(([str(number)] if args.n_best > 1 else []) + score + [translation.text] + links))
    return outputs


def _translate_interactively(translator, args: argparse.Namespace, glossary=None) -> None:
    """A prompt; each line is translated as soon as it is entered (the model loaded once), its
    output on stdout at once. Ctrl-D (end of input) ends it."""
    data = translator.cfg.data
    at_terminal = sys.stdin.isatty()
    if at_terminal:
        print(f"tmt: translating {data.src_lang}->{data.tgt_lang} with {shown(translator.checkpoint)}, a line at a "
              "time; Ctrl-D to quit", file=sys.stderr)
    number = 0
    while (line := _prompt(f"{data.src_lang}> " if at_terminal else "", number + 1)) is not None:
        lines, prefixes, constraints = _sentences_and_prefixes([line], args, "stdin", first_number=number + 1,
                                                               glossary=glossary)
        for output in _translate_lines(translator, lines, prefixes, args, progress=False, first_number=number,
                                       constraints=constraints):
            print(output)
        sys.stdout.flush()
        number += 1


def _prompt(prompt: str, number: int) -> str | None:
    """The next line from stdin, after `prompt` on the terminal; None at the end of input."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        with contextlib.suppress(ImportError):  # no readline on Windows
            import readline  # noqa: F401  (input() then offers line editing and history)
        try:
            return input(prompt)
        except (EOFError, KeyboardInterrupt) as end:
            print(file=sys.stderr)  # the shell's prompt (or "tmt: interrupted") then starts on a line of its own
            if isinstance(end, KeyboardInterrupt):
                raise
            return None
    if prompt:  # stdout is a file or a pipe: keep it for translations
        print(prompt, end="", file=sys.stderr, flush=True)
    from transformer_mt.data.sources import decode_line

    raw = sys.stdin.buffer.readline()
    return decode_line(raw, "stdin", number) if raw else None


def _draw_attention(translator, line: str, prefix: str, args: argparse.Namespace) -> str:
    """Draw `line`'s cross-attention (its translation beginning with `prefix`) to --show-attention and
    return its translation."""
    from transformer_mt.decode.plotting import attention_figure

    n_layers = translator.cfg.model.n_decoder_layers
    asked = -1 if args.attention_layer is None else args.attention_layer  # the last by default
    if not -n_layers <= asked < n_layers:
        raise UsageError(f"--attention-layer {asked}: the model has {n_layers} decoder layers "
                         f"(0..{n_layers - 1}, or -1 for the last)")
    attention = translator.attention(line, layer=asked, beam_size=args.beam, prefix=prefix)
    layer = asked % n_layers
    title = f"cross-attention, decoder layer {layer + 1} of {n_layers}, mean over heads"
    try:
        args.show_attention.parent.mkdir(parents=True, exist_ok=True)
        attention_figure(attention.weights, attention.src_pieces, attention.tgt_pieces, title).savefig(
            args.show_attention, format=args.show_attention.suffix[1:].lower())
    except OSError as err:
        raise write_error(err, folder=args.show_attention) from None
    print(f"attention drawn to {args.show_attention}", file=sys.stderr)
    return attention.translation


def run_evaluate(args: argparse.Namespace) -> None:
    from transformer_mt.evaluate.metrics import bleu_tokenizer_problem
    from transformer_mt.evaluate.test_set import evaluate_test_set

    setup_logging(logging.WARNING)
    if bool(args.src) != bool(args.ref):
        raise UsageError("--src and --ref go together")
    if args.output == STDIO:
        raise UsageError("--output -: evaluate prints its scores on stdout; give a file for the hypotheses")
    check_output(args.output, inputs={"--src": args.src, **{f"--ref {ref}": ref for ref in args.ref or []}})
    if args.tokenize and (problem := bleu_tokenizer_problem(args.tokenize)):  # before the run is loaded (converted)
        raise UsageError(f"--tokenize: {problem}")
    comet = None
    if args.comet:  # the package and the model, before hours of translating
        from transformer_mt.evaluate.comet import Comet

        comet = Comet.load(args.comet)
    check_not_kept(args.output, "--output", run_dir_of(args))  # before loading, which may write into the run
    glossary = read_glossary_option(args)
    translator = load_translator(args, constrained=glossary is not None)
    check_glossary_terms(glossary, translator)
    tokenize = args.tokenize or translator.cfg.train.bleu_tokenize
    problem = bleu_tokenizer_problem(tokenize)  # before translating
    if problem:
        where = "--tokenize" if args.tokenize else "the run's train.bleu_tokenize (choose another with --tokenize)"
        raise UsageError(f"{where}: {problem}")
    sources, references, name = _evaluation_set(args, translator)
    beam = args.beam or translator.cfg.decode.beam_size
    alpha = translator.cfg.decode.length_penalty
    output = args.output or RunDir(translator.run_dir).hypotheses(
        name, translator.checkpoint.stem, beam, alpha=alpha if args.length_penalty is not None else None,
        quantized=translator.quantized, glossary=args.glossary)
    constraints = None if glossary is None else [glossary.targets(source) for source in sources]
    result = evaluate_test_set(functools.partial(translator.translate, beam_size=beam, progress=not args.quiet,
                                                 constraints=constraints),
                               sources, references, output, tokenize=tokenize, n_bootstrap=args.bootstrap,
                               src_lang=translator.cfg.data.src_lang, comet=comet, device=translator.device,
                               diagnostics=args.diagnostics, glossary=glossary)
    for metric, found in result.scores.by_metric.items():  # METRICS, then term accuracy with a glossary
        print(f"{found.shown(metric)}  {found.signature}")
    if glossary is not None and "terms" not in result.scores.by_metric:
        print(f"Term accuracy: no source sentence holds a term of {args.glossary}")
    if result.comet is not None:
        print(f"COMET = {result.comet.score:.4f}  model:{result.comet.model}")
    if result.pairs:  # a multilingual set: its sources begin with target-language tags
        print("\nper language pair:")
        width = max(map(len, result.pairs))
        for pair, values in result.pairs.items():
            print(f"  {pair.ljust(width)}  BLEU = {values['bleu']:.2f}  chrF = {values['chrf']:.2f}  "
                  f"({values['sentences']} sentences)")
    if result.diagnostics is not None:
        print(f"\ndiagnostics of {len(result.hypotheses)} translations (line numbers from 1):")
        for line in result.diagnostics.lines():
            print(f"  {line}")
    penalty = f", length penalty {alpha:g}" if beam > 1 else ""  # greedy decoding has none
    penalty += f", {translator.quantized} weights" if translator.quantized else ""
    penalty += f", the terms of {args.glossary}" if glossary is not None else ""
    print(f"{len(result.hypotheses)} sentences, beam {beam}{penalty}; hypotheses in {shown(output)}",
          file=sys.stderr)


def _evaluation_set(args: argparse.Namespace, translator) -> tuple[list[str], list[list[str]], str]:
    """The sentences `tmt evaluate` scores, their references (one list per reference) and the name
    of their hypotheses: --src and each --ref, else the run's --split as the run read it."""
    from transformer_mt.data.corpus import load_run_corpus
    from transformer_mt.data.sources import read_aligned_files, read_lines

    if not args.src:
        # The split as the run read it (its corpus_cache/), even if the data files moved or changed since
        corpus = load_run_corpus(translator.cfg.data, translator.cfg.seed, translator.run_dir)
        split = getattr(corpus, args.split)
        return split["src"], [split["tgt"]], args.split
    pairs = read_aligned_files(args.src, args.ref[0])
    if not any(src.strip() for src, _ in pairs):  # no lines, or only empty ones: BLEU 0 of nothing
        raise UsageError(f"{args.src}: no sentences to evaluate (the file is empty or every line is blank)")
    sources, references = [src for src, _ in pairs], [[ref for _, ref in pairs]]
    for path in args.ref[1:]:  # more references of the same sentences
        lines = [line.strip() for line in read_lines(path)]
        if len(lines) != len(sources):
            raise DataError(f"{args.src} has {len(sources)} lines but {path} has {len(lines)}; each --ref "
                            "needs one line per source sentence")
        references.append(lines)
    return sources, references, RunDir.source_file_name(args.src)


def _argument_lines(texts: list[str]) -> list[str]:
    """Sentences given as arguments. Python passes on bytes that are not UTF-8 as lone surrogates
    (`os.fsdecode`), which no tokenizer takes: name the argument instead."""
    for number, text in enumerate(texts, start=1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataError(f"sentence argument {number}: not valid UTF-8 (after {text[:err.start]!r}); "
                            "check the terminal's encoding, or pass the text with --input FILE") from None
    return texts
