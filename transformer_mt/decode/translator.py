"""`Translator.from_run(path).translate(lines)`: a trained run's translations (greedy, beam search or
sampling) on the engine `decode.engine` picks: CTranslate2 on a CPU (`ct2_engine`), else torch
(`torch_engine`). Greedy output is the same on both; so are scores, tmt's (`hypotheses.Hypothesis`)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from transformer_mt.config.loading import config_from_dict
from transformer_mt.config.schema import Config, DecodeConfig, language_tag
from transformer_mt.core.errors import CheckpointError, ConfigError, DataError, TmtError, UsageError
from transformer_mt.core.files import describe_os_error
from transformer_mt.core.run_layout import find_checkpoint
from transformer_mt.data.tokenization import EOS, UNK_ID, TokenizerPair, leading_tag, token_room
from transformer_mt.decode.alignment import alignment_layer, pharaoh, word_links
from transformer_mt.decode.ct2_engine import CT2Engine, conversion_dir, convert, find_conversion
from transformer_mt.decode.hypotheses import Hypothesis, length_caps

if TYPE_CHECKING:
    import torch

    from transformer_mt.decode.hypotheses import Sampling
    from transformer_mt.decode.torch_engine import TorchEngine
    from transformer_mt.runs.checkpoint import LoadedRun

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """Decodes source ids (no special tokens; cut and given an EOS inside, as `model_source` does) in
    length-sorted batches of `decode.batch_tokens`, results in input order: each source's best
    translation (`translate`; beam 1: greedy), its `n_best` best, best first, or with `sampling`
    `n_best` samples (`hypotheses`), each beginning with its source's `prefixes` ids where given (the
    length cap counts them; they fit, with room for EOS); the torch engine also takes `terms=`, the ids of
    terms each translation contains (`search.ConstrainedBeamState`); the head-averaged cross-attention
    (T + 1, S + 1) of decoder `layer` producing `hyp_ids` + EOS; the log-probability of each target id and then EOS given its
    source (`score`, teacher-forced)."""

    name: str  # "torch" or "ctranslate2"
    device: str  # "cpu", "cuda" or "mps"

    def translate(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, progress: bool,
                  prefixes: list[list[int]] | None = None) -> list[list[int]]: ...

    def hypotheses(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, n_best: int,
                   sampling: Sampling | None, progress: bool,
                   prefixes: list[list[int]] | None = None) -> list[list[Hypothesis]]: ...

    def score(self, src_ids: list[list[int]], tgt_ids: list[list[int]], decode: DecodeConfig,
              progress: bool) -> list[list[float]]: ...

    def cross_attention(self, src_ids: list[int], hyp_ids: list[int], layer: int): ...


def has_ctranslate2() -> bool:
    """Whether the `ctranslate2` package is installed (without importing it)."""
    return importlib.util.find_spec("ctranslate2") is not None


def pick_engine(setting: str, device: str) -> str:
    """The engine `decode.engine: setting` runs on `--device device`: "torch" or "ctranslate2"
    (auto: CTranslate2 on a CPU when it is installed, torch with its CUDA graphs on a GPU)."""
    if setting == "torch":
        return "torch"
    if setting == "ctranslate2":
        if not has_ctranslate2():
            raise UsageError("decode.engine: ctranslate2 needs the ctranslate2 package (pip install ctranslate2); "
                             "or translate with --engine torch")
        if device == "mps":
            raise UsageError("--device mps: CTranslate2 runs on a CPU or CUDA; use --engine torch on mps")
        return "ctranslate2"
    if device not in ("auto", "cpu") or not has_ctranslate2():
        return "torch"
    return "torch" if device == "auto" and _cuda_devices() > 0 else "ctranslate2"


def _cuda_devices() -> int:
    import ctranslate2  # asks the CUDA driver without importing torch

    return ctranslate2.get_cuda_device_count()


class Translator:
    """A trained run's tokenizers and config with a decoding engine, ready to translate raw sentences."""

    def __init__(self, engine: Engine, tokenizers: TokenizerPair, cfg: Config, run_dir: Path, checkpoint: Path,
                 step: int):
        self.engine = engine
        self.tokenizers = tokenizers
        self.cfg = cfg  # the run's config: decoding settings, and data for `tmt evaluate --split`
        self.run_dir = run_dir
        self.checkpoint = checkpoint  # the weights' file, which names `tmt evaluate`'s output
        self.step = step  # the training step the checkpoint was saved at
        self.max_len = cfg.model.max_len  # sources are cut to `token_room(max_len)` tokens and EOS
        self._attention_engine: TorchEngine | None = None  # on CTranslate2, the torch model that aligns
        self._warn_quantize_ignored()

    @classmethod
    def from_run(cls, run_dir: Path, checkpoint: Path | None = None, device: str = "auto",
                 engine: str | None = None) -> Translator:
        """Load a run directory (its checkpoint as `load_run` chooses it) on `engine` (auto, torch or
        ctranslate2; None: the run's `decode.engine`). On CTranslate2 a conversion cached for this
        checkpoint loads without torch; the first use converts it."""
        for attempt in range(3):  # a trainer may delete the newest step checkpoint (keep_last) as it is read
            chosen = checkpoint or find_checkpoint(run_dir)
            try:
                return cls._from_checkpoint(run_dir, chosen, device, engine)
            except CheckpointError:
                if checkpoint is not None or chosen.exists() or attempt == 2:
                    raise

    @classmethod
    def _from_checkpoint(cls, run_dir: Path, checkpoint: Path, device: str, engine: str | None) -> Translator:
        tokenizers = TokenizerPair.load(run_dir)
        cache = None  # where this checkpoint's conversion is (or goes), found before torch loads it
        if engine != "torch" and has_ctranslate2():
            try:
                cache = conversion_dir(run_dir, checkpoint, tokenizers.fingerprint())
            except OSError:  # a checkpoint missing or unreadable: torch's loader says so
                pass
            info = find_conversion(cache) if cache is not None else None
            try:  # the checkpoint's config, valid when it was converted
                cfg = config_from_dict(info["config"]) if info is not None else None
            except ConfigError:  # else torch's loader says what is wrong with it
                cfg = None
            if cfg is not None and pick_engine(engine or cfg.decode.engine, device) == "ctranslate2":
                return cls._on_ctranslate2(cache, info, tokenizers, cfg, run_dir, checkpoint, device)
        from transformer_mt.runs.checkpoint import load_run

        run = load_run(run_dir, checkpoint, tokenizers)
        setting = engine or run.cfg.decode.engine
        if pick_engine(setting, device) == "ctranslate2":
            try:
                cache = cache or conversion_dir(run_dir, checkpoint, tokenizers.fingerprint())
                return cls._on_ctranslate2(cache, convert(run_dir, run, cache), tokenizers, run.cfg, run_dir,
                                           checkpoint, device)
            except OSError as err:  # a run directory this user cannot write, say
                problem = f"cannot cache a CTranslate2 conversion in {run_dir} ({describe_os_error(err)})"
                if setting == "ctranslate2":
                    raise TmtError(f"{problem}; translate with --engine torch") from None
                logger.warning("%s; translating with torch", problem)
        return cls._on_torch(run, run_dir, device)

    @classmethod
    def _on_ctranslate2(cls, path: Path, info: dict, tokenizers: TokenizerPair, cfg: Config, run_dir: Path,
                        checkpoint: Path, device: str) -> Translator:
        where = "cuda" if device == "cuda" or (device == "auto" and _cuda_devices() > 0) else "cpu"
        logger.info("loaded %s (step %d%s) on CTranslate2 (%s)", checkpoint, info["step"],
                    ", EMA weights" if info["which"] == "ema" else "", where)
        return cls(CT2Engine(path, where, cfg.model.max_len), tokenizers, cfg, run_dir, checkpoint, info["step"])

    @classmethod
    def _on_torch(cls, run: LoadedRun, run_dir: Path, device: str) -> Translator:
        from transformer_mt.core.runtime import pick_device, pick_precision, warn_attention_fallbacks
        from transformer_mt.decode.torch_engine import TorchEngine

        torch_device = pick_device(device)
        logger.info("loaded %s (step %d%s) on %s", run.checkpoint, run.step, ", EMA weights" if run.which == "ema"
                    else "", torch_device)
        warn_attention_fallbacks(torch_device, {"decode.attention_backend": run.cfg.decode.attention_backend})
        try:  # the run's training precision (as validation used it) where this device allows it
            precision = pick_precision(run.cfg.train.precision, torch_device)
        except UsageError:  # e.g. an fp16 run translated on a CPU
            precision = pick_precision("auto", torch_device)
        engine = TorchEngine(run.model.to(torch_device), torch_device, precision)
        return cls(engine, run.tokenizers, run.cfg, run_dir, run.checkpoint, run.step)

    @property
    def device(self) -> str:
        """Where the engine decodes: "cpu", "cuda" or "mps"."""
        return self.engine.device

    def set_decoding(self, **settings) -> None:
        """Decode with other `decode.*` settings than the run's, e.g. `length_penalty=1.0`."""
        self.cfg = dataclasses.replace(self.cfg, decode=dataclasses.replace(self.cfg.decode, **settings))
        if "quantize" in settings:
            self._warn_quantize_ignored()

    @property
    def quantized(self) -> str | None:
        """The weights' quantisation translations are made with (`decode.quantize` on a CPU), or None."""
        return self.cfg.decode.quantize if self.cfg.decode.quantize != "none" and self.device == "cpu" else None

    def _warn_quantize_ignored(self) -> None:
        if self.cfg.decode.quantize != "none" and self.device != "cpu":
            logger.warning("decode.quantize: %s applies to CPU decoding only; decoding on %s unquantised",
                           self.cfg.decode.quantize, self.device)

    def translate(self, lines: list[str], beam_size: int | None = None, progress: bool = False,
                  target_lang: str | None = None, prefixes: list[str] | None = None,
                  constraints: list[list[str]] | None = None) -> list[str]:
        """Translate each line (beam size: `beam_size`, else the run's `decode.beam_size`; into
        `target_lang`, else `decode.target_lang`, see `source_ids`); an empty line gives an empty
        line, one longer than the model allows is truncated with a warning. With `prefixes` (one per
        line, "" none), each translation begins with its prefix (`_prefixes`); with `constraints` (a
        list of target terms per line), each contains its line's terms (`_terms`)."""
        texts, src_ids = self._sources(lines, target_lang)
        beam = self._beam(beam_size)
        prefix_ids = self._prefixes(texts, src_ids, prefixes)
        terms = self._terms(texts, src_ids, prefix_ids, constraints, beam)
        if terms is None:
            hyp_ids = self.engine.translate(src_ids, self.cfg.decode, beam, progress, prefix_ids)
        else:
            hyp_ids = self.engine.translate(src_ids, self.cfg.decode, beam, progress, prefix_ids, terms=terms)
        hypotheses = self.tokenizers.decode_tgt(hyp_ids)
        return [hyp if text else "" for text, hyp in zip(texts, hypotheses)]

    def translate_n_best(self, lines: list[str], n_best: int = 1, beam_size: int | None = None,
                         sampling: Sampling | None = None, progress: bool = False,
                         target_lang: str | None = None, prefixes: list[str] | None = None,
                         alignments: bool = False, alignment_layer: int | None = None,
                         constraints: list[list[str]] | None = None) -> list[list[Translation]]:
        """Each line's `n_best` translations with their scores: the best of beam search, best first
        (beam 1: greedy; the first is what `translate` gives), or with `sampling`, samples in the order
        drawn; each beginning with the line's prefix, as `translate` says, whose tokens' log-probabilities
        the scores include; containing the line's `constraints` as `translate` says (beam search only:
        a list may then hold fewer than `n_best`); with `alignments`, each with its word alignment
        (`align`). An empty line gets one empty translation, scored 0."""
        texts, src_ids = self._sources(lines, target_lang)
        beam = self._beam(beam_size)
        prefix_ids = self._prefixes(texts, src_ids, prefixes)
        if sampling is not None and constraints is not None and any(constraints):
            raise UsageError("constraints (a glossary's terms) need beam search; sampling draws each token freely: "
                             "leave out --sample or the constraints")
        terms = self._terms(texts, src_ids, prefix_ids, constraints, beam)
        if terms is None:
            hypotheses = self.engine.hypotheses(src_ids, self.cfg.decode, beam, n_best, sampling, progress,
                                                prefix_ids)
        else:
            hypotheses = self.engine.hypotheses(src_ids, self.cfg.decode, beam, n_best, sampling, progress,
                                                prefix_ids, terms=terms)
        results = []
        for text, hyps in zip(texts, hypotheses):
            if not text:
                results.append([Translation("", 0.0, [])])
                continue
            decoded = self.tokenizers.decode_tgt([hyp.ids for hyp in hyps])
            results.append([Translation(translation, hyp.score, self.tokenizers.tgt_pieces(hyp.ids))
                            for translation, hyp in zip(decoded, hyps)])
        if alignments:
            pairs = [(line, translation) for line, translations in zip(lines, results) for translation in translations]
            links = iter(self.align([line for line, _ in pairs], [t.text for _, t in pairs], alignment_layer,
                                    target_lang))
            results = [[dataclasses.replace(t, alignment=pharaoh(next(links))) for t in translations]
                       for translations in results]
        return results

    def align(self, sources: list[str], targets: list[str], layer: int | None = None,
              target_lang: str | None = None) -> list[list[tuple[int, int]]]:
        """The word alignment of each (source, target) pair, as (source word, target word) links
        between the words of the stripped lines (`str.split()`, from 0): from the cross-attention of
        decoder `layer` (None: `alignment.DEFAULT_LAYER`), heads averaged, teacher-forced on the
        target's tokens (`alignment.word_links`). Always computed by the torch model, so the same on
        both engines; on CTranslate2 the run's checkpoint is loaded with torch the first time."""
        n_layers = self.cfg.model.n_decoder_layers
        if layer is not None and not -n_layers <= layer < n_layers:
            raise UsageError(f"--alignment-layer {layer}: the model has {n_layers} decoder layers "
                             f"(0..{n_layers - 1}, or -1 for the last)")
        texts = [line.strip() for line in sources]
        src = self.tokenizers.encode_src_words(texts, self._target_tag(texts, target_lang))
        tgt = self.tokenizers.encode_tgt_words([line.strip() for line in targets])
        maps = self._attention().cross_attentions([ids for ids, _ in src], [ids for ids, _ in tgt],
                                                  alignment_layer(layer, n_layers), self.cfg.decode)
        return [word_links(weights.tolist(), src_words, tgt_words)
                for weights, (_, src_words), (_, tgt_words) in zip(maps, src, tgt)]

    def _attention(self) -> TorchEngine:
        """The torch engine that computes cross-attention: this translator's, or on CTranslate2 the
        same checkpoint's weights loaded with torch on the same device (once)."""
        if self.engine.name == "torch":
            return self.engine
        if self._attention_engine is None:
            from transformer_mt.core.runtime import pick_device, pick_precision
            from transformer_mt.decode.torch_engine import TorchEngine
            from transformer_mt.runs.checkpoint import load_run

            run = load_run(self.run_dir, self.checkpoint, self.tokenizers)
            device = pick_device(self.device)
            self._attention_engine = TorchEngine(run.model.to(device), device, pick_precision("fp32", device))
        return self._attention_engine

    def score(self, sources: list[str], targets: list[str], progress: bool = False) -> list[ScoredPair]:
        """The model's log-probability of each target given its source, token by token (the target's
        BPE pieces, then EOS). A target longer than the model reads (`model.max_len - 1` tokens) is
        refused, naming its line (from 1); a source too long is cut with a warning, as `translate` does."""
        src_ids = self._sources(sources)[1]
        tgt_ids = self.tokenizers.encode_tgt([target.strip() for target in targets])
        for number, ids in enumerate(tgt_ids, start=1):
            if len(ids) > token_room(self.max_len):
                raise DataError(f"line {number}: the target is {len(ids)} tokens; this model scores at most "
                                f"{token_room(self.max_len)} (model.max_len={self.max_len} with BOS)")
        scored = self.engine.score(src_ids, tgt_ids, self.cfg.decode, progress)
        return [ScoredPair(self.tokenizers.tgt_pieces(ids) + [EOS], log_probs)
                for ids, log_probs in zip(tgt_ids, scored)]

    def attention(self, line: str, layer: int = -1, beam_size: int | None = None, prefix: str = "") -> AttentionMap:
        """Translate one line (beginning with `prefix`, as in `translate`) and return where decoder
        layer `layer` (-1: the last) of the torch engine's model looked; a line too long is truncated
        with a warning, as in `translate`."""
        from transformer_mt.decode.plotting import cross_attention_labels

        texts, sources = self._sources([line])
        src_ids = sources[0][:token_room(self.max_len)]  # as the engines cut it
        hyp_ids = self.engine.translate([src_ids], self.cfg.decode, self._beam(beam_size), False,
                                        self._prefixes(texts, sources, [prefix]))[0]
        weights = self.engine.cross_attention(src_ids, hyp_ids, layer)
        src_pieces, tgt_pieces = cross_attention_labels(
            self.tokenizers.src_pieces(src_ids), self.tokenizers.tgt_pieces(hyp_ids), EOS, self.max_len)
        return AttentionMap(weights, src_pieces, tgt_pieces, self.tokenizers.decode_tgt([hyp_ids])[0])

    def prefix_problem(self, src_ids: list[int], prefix_ids: list[int]) -> str | None:
        """Why `prefix_ids` cannot begin the translation of `src_ids` (None: it can): the sentence's
        length cap (`length_caps`) counts the prefix and must leave room for EOS after it."""
        source_length = min(len(src_ids), token_room(self.max_len)) + 1  # cut as the engines cut it, with EOS
        decode = self.cfg.decode
        [cap] = length_caps([source_length], decode.max_len_a, decode.max_len_b, self.max_len)
        if len(prefix_ids) < cap:
            return None
        return (f"the prefix is {len(prefix_ids)} tokens; this sentence's translation is capped at {cap} tokens "
                f"with its EOS (decode.max_len_a={decode.max_len_a:g} × {source_length} source tokens with EOS + "
                f"decode.max_len_b={decode.max_len_b}, at most model.max_len={self.max_len}): give a shorter prefix")

    def _prefixes(self, texts: list[str], src_ids: list[list[int]],
                  prefixes: list[str] | None) -> list[list[int]] | None:
        """The target ids each translation begins with: each line's prefix, stripped and tokenized as
        a target sentence ("" or an empty line: none); None when there are none. A prefix that does
        not fit its sentence's cap (`prefix_problem`) is refused, naming its line (from 1)."""
        if prefixes is None:
            return None
        if len(prefixes) != len(texts):
            raise ValueError(f"{len(prefixes)} prefixes for {len(texts)} lines")
        wanted = [prefix.strip() if text else "" for text, prefix in zip(texts, prefixes)]
        if not any(wanted):
            return None
        prefix_ids = self.tokenizers.encode_tgt(wanted)
        for number, (ids, prefix) in enumerate(zip(src_ids, prefix_ids), start=1):
            if problem := self.prefix_problem(ids, prefix):
                raise DataError(f"line {number}: {problem}")
        return prefix_ids

    def term_ids(self, term: str) -> list[int]:
        """A target term's ids as the tokenizer spells it inside a sentence: each word with its
        word-boundary mark (Metaspace's `▁`), as the pieces after a space."""
        return self.tokenizers.encode_tgt([" ".join(term.split())])[0]

    def term_problem(self, term: str) -> str | None:
        """Why `term` cannot be forced into a translation (None: it can): empty, or characters the
        target vocabulary cannot spell (they would come out as <unk>)."""
        text = " ".join(term.split())
        if not text:
            return "an empty term"
        encoded = self.tokenizers.tgt.encode(text, add_special_tokens=False)
        unknown = "".join(dict.fromkeys(character for token, (start, end) in zip(encoded.ids, encoded.offsets)
                                        if token == UNK_ID for character in text[start:end]))
        if unknown:
            return (f"the term {term!r} has characters the target vocabulary cannot spell ({unknown!r}; they would "
                    "come out as <unk>)")
        return None

    def terms_problem(self, src_ids: list[int], prefix_ids: list[int], terms: list[str], beam: int) -> str | None:
        """Why a sentence's `terms` cannot all be forced into its translation (None: they can): a term
        `term_problem` refuses; more than K - 1 terms for a beam of K; or term tokens that, after the
        prefix, leave no room for EOS under the sentence's length cap (`length_caps`). Each term counts once."""
        terms = list(dict.fromkeys(" ".join(term.split()) for term in terms))
        for term in terms:
            if problem := self.term_problem(term):
                return problem
        if len(terms) > beam - 1:
            return (f"{len(terms)} terms; a beam of {beam} holds at most {beam - 1} (a beam for each bank of terms "
                    f"met, one for none): use a beam of {len(terms) + 1} or more")
        source_length = min(len(src_ids), token_room(self.max_len)) + 1  # cut as the engines cut it, with EOS
        decode = self.cfg.decode
        [cap] = length_caps([source_length], decode.max_len_a, decode.max_len_b, self.max_len)
        needed = len(prefix_ids) + sum(len(self.term_ids(term)) for term in terms)
        if needed < cap:
            return None
        return (f"the terms{' and the prefix' if prefix_ids else ''} are {needed} tokens; this sentence's translation "
                f"is capped at {cap} tokens with its EOS (decode.max_len_a={decode.max_len_a:g} × {source_length} "
                f"source tokens with EOS + decode.max_len_b={decode.max_len_b}, at most model.max_len={self.max_len})")

    def constraints_problem(self, beam: int) -> str | None:
        """Why this translator cannot force terms with a beam of `beam` (None: it can)."""
        if self.engine.name != "torch":
            return ("constraints (a glossary's terms) need the torch engine; CTranslate2 has no lexical constraints: "
                    "translate with --engine torch (or auto)")
        if beam < 2:
            return ("constraints (a glossary's terms) need beam search with a beam of 2 or more: one beam would always "
                    "follow the hypothesis that has met the most terms, putting them first")
        return None

    def _terms(self, texts: list[str], src_ids: list[list[int]], prefix_ids: list[list[int]] | None,
               constraints: list[list[str]] | None, beam: int) -> list[list[list[int]]] | None:
        """The ids of the terms each translation must contain: each line's `constraints`, each term
        once (`term_ids`; an empty line: none); None when there are none. Refused in one line: what
        `constraints_problem` refuses, and terms `terms_problem` refuses, naming the line (from 1)."""
        if constraints is None:
            return None
        if len(constraints) != len(texts):
            raise ValueError(f"{len(constraints)} constraint lists for {len(texts)} lines")
        wanted = [list(dict.fromkeys(" ".join(term.split()) for term in terms)) if text else []
                  for text, terms in zip(texts, constraints)]
        if not any(wanted):
            return None
        if problem := self.constraints_problem(beam):
            raise UsageError(problem)
        for number, (terms, source, prefix) in enumerate(zip(wanted, src_ids, prefix_ids or [[]] * len(texts)),
                                                         start=1):
            if problem := self.terms_problem(source, prefix, terms, beam):
                raise DataError(f"line {number}: {problem}")
        return [[self.term_ids(term) for term in terms] for terms in wanted]

    def _beam(self, beam_size: int | None) -> int:
        return self.cfg.decode.beam_size if beam_size is None else beam_size

    def source_ids(self, lines: list[str], target_lang: str | None = None,
                   asked_as: str = "--target-lang (decode.target_lang)") -> list[list[int]]:
        """The source ids of stripped `lines`. A multilingual model's target-language tag comes first:
        a line's own leading tag (`>>ita<<`, as `MarianTokenizer` reads it), else that of `target_lang`
        (else `decode.target_lang`). Refused in one line: a tag the model does not know, and no tag
        for a non-empty line when the model knows two or more (the message names `asked_as`)."""
        return self.tokenizers.encode_src(lines, self._target_tag(lines, target_lang, asked_as))

    def _target_tag(self, lines: list[str], target_lang: str | None = None,
                    asked_as: str = "--target-lang (decode.target_lang)") -> str | None:
        """The tag `source_ids` puts before lines without their own (None: none), after its checks."""
        tags = self.tokenizers.language_tags
        lang = target_lang or self.cfg.decode.target_lang
        codes = [tag[2:-2] for tag in tags]
        if lang is not None and language_tag(lang) not in tags:
            if not tags:
                raise UsageError(f"target language {lang!r}: this model has no target-language tags (>>xxx<<); it "
                                 f"translates into {self.cfg.data.tgt_lang}: leave out {asked_as.split()[0]}")
            close = difflib.get_close_matches(lang, codes, n=1)
            raise UsageError(f"target language {lang!r}: this model has no tag {language_tag(lang)} ("
                             + (f"did you mean {close[0]!r}? " if close else "") + f"it knows {_few(codes)})")
        if not tags:
            return None
        for number, line in enumerate(lines, start=1):
            lead = leading_tag(line)[0]
            if lead is not None and lead not in tags:
                raise UsageError(f"line {number} begins with {lead}, not a tag of this model (it knows "
                                 f"{_few(codes)}, written >>xxx<<)")
            if line and lead is None and lang is None and len(tags) >= 2:
                raise UsageError(f"this model translates into {len(tags)} languages ({_few(codes)}): choose one with "
                                 f"{asked_as}, or begin each line with its tag such as "
                                 f"{next(iter(tags))} (line {number} has none)")
        return None if lang is None else language_tag(lang)

    def _sources(self, lines: list[str], target_lang: str | None = None) -> tuple[list[str], list[list[int]]]:
        """The stripped lines and their source ids, warning of those longer than model.max_len (cut)."""
        if self.quantized and self.engine.name == "torch":
            raise UsageError(f"decode.quantize: {self.quantized} decodes on the ctranslate2 engine (pip install "
                             "ctranslate2); the torch engine decodes in fp32: leave out --engine torch or --quantize")
        texts = [line.strip() for line in lines]
        src_ids = self.source_ids(texts, target_lang)
        too_long = sum(len(ids) > token_room(self.max_len) for ids in src_ids)
        if too_long:
            logger.warning("%d input(s) longer than model.max_len=%d tokens were truncated", too_long, self.max_len)
        return texts, src_ids


def _few(codes: list[str], shown: int = 6) -> str:
    """Some language codes for a message: `a, b, c` or `a, b, ... (40 in all)`."""
    return ", ".join(codes) if len(codes) <= shown else f"{', '.join(codes[:shown])}, ... ({len(codes)} in all)"


@dataclass(frozen=True)
class Translation:
    """One translation of a sentence, with what rescoring needs."""

    text: str
    score: float  # log-probability (EOS included) / length^α, the length counting the EOS
    tokens: list[str]  # the target BPE pieces the model produced, without BOS and EOS
    alignment: str | None = None  # its words' links to the source's in Pharaoh format, when asked for


@dataclass(frozen=True)
class AttentionMap:
    """Cross-attention of one translated sentence, ready to plot."""

    weights: torch.Tensor  # (T, S): row t is where the decoder looked while producing target piece t
    src_pieces: list[str]
    tgt_pieces: list[str]
    translation: str



@dataclass(frozen=True)
class ScoredPair:
    """A target's score given its source: each token's log-probability, EOS last."""

    tokens: list[str]  # the target's BPE pieces, then EOS
    token_log_probs: list[float]

    @property
    def log_prob(self) -> float:
        """The target's log-probability (EOS included)."""
        return sum(self.token_log_probs)

    @property
    def per_token(self) -> float:
        """`log_prob` over its tokens (EOS counted): comparable across lengths."""
        return self.log_prob / len(self.token_log_probs)
