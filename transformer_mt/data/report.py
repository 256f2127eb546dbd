"""The data report (`tmt data`, the start of `tmt train`): the corpus as the model will see it; time estimates."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from transformer_mt.config.schema import Config
from transformer_mt.data.batching import TokenBatchSampler, pack_shape
from transformer_mt.data.corpus import SPLITS, Corpus, iter_text_batches
from transformer_mt.data.filters import MAX_REMOVED_LINES, FilterCount, removed_examples
from transformer_mt.data.tokenization import UNK_ID, TokenizerPair

if TYPE_CHECKING:
    from transformer_mt.data.token_cache import TokenizedSplit

PERCENTILES = (50, 90, 99)
SIDES = ("src", "tgt")


@dataclass(frozen=True)
class LengthStats:
    """Nearest-rank percentiles and the maximum of a list of lengths (BPE tokens, no EOS/BOS)."""

    percentiles: dict[int, int]  # {50: p50, 90: p90, 99: p99}
    max: int


@dataclass(frozen=True)
class CorpusShare:
    """One corpus of `data.corpora` as training sees it."""

    path: str
    pairs: int  # training pairs trained on
    tgt_tokens: int  # their target tokens in plain BPE, EOS included
    weight: float
    share: float  # of an epoch's pairs
    tgt_share: float  # of the first epoch's target tokens: the corpus's weight in the loss, which averages tokens
    pair: str | None = None  # its language pair, `en-ita`, when it has a target-language tag


@dataclass(frozen=True)
class FrozenParts:
    """What `train.freeze` leaves untrained."""

    parts: tuple[str, ...]  # train.freeze's names
    parameters: int  # frozen, tied weights counted once
    total: int  # the model's parameters

    def shown(self) -> str:
        """`embeddings, encoder: 3,112,448 of 7,412,224 parameters (42.0%), 4,299,776 trained`."""
        return (f"{', '.join(self.parts)}: {self.parameters:,} of {self.total:,} parameters "
                f"({100 * self.parameters / max(self.total, 1):.1f}%), {self.total - self.parameters:,} trained")


@dataclass(frozen=True)
class Filtered:
    """What one filter of `data.filters` removed from one split, with a few of its pairs."""

    count: FilterCount
    examples: tuple[tuple[str, str], ...]  # (source, target) of the first pairs removed

    def shown(self, width: int = 40) -> str:
        """`Hello! → Ciao!   ...`, each side cut at `width` characters."""
        cut = [text if len(text) <= width else text[:width - 1] + "…" for pair in self.examples for text in pair]
        cut = [re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda c: f"\\x{ord(c[0]):02x}", text) for text in cut]  # visible
        return "   ".join(f"{src} → {tgt}" for src, tgt in zip(cut[::2], cut[1::2]))


@dataclass(frozen=True)
class DataReport:
    """A corpus as the model will see it; per-epoch counts are the first epoch's, train `lengths` plain BPE's."""

    pairs: dict[str, int]  # per split, after every filter (train also after too_many_tokens)
    carved: tuple[str, ...]  # the splits carved from train
    removed: dict[str, int]  # pairs each filter dropped, in the order they run
    lengths: dict[tuple[str, str], LengthStats]  # (split, side): untruncated BPE tokens of train and valid
    valid_truncated: dict[str, int]  # validation sentences longer than model.max_len - 1 tokens
    unk_rate: dict[str, float]  # share of the validation side's tokens that are <unk>
    word_coverage: dict[str, float]  # share of the validation side's running words seen on that side of train
    src_tokens_per_epoch: int  # EOS included
    tgt_tokens_per_epoch: int  # EOS included: what the loss averages over
    batches_per_epoch: int  # token-budget batches of the training sampler
    batches_per_step: int  # train.accum_steps × the number of training processes (torchrun)
    batch_tokens: int
    max_steps: int
    languages: dict[str, str]  # {"src": "en", "tgt": "it"}
    # (rate, variants, the first dropout epoch's target tokens over plain BPE's, the first dropout epoch)
    bpe_dropout: tuple[float, int, float, int] | None = None
    dropout_batches_per_epoch: int | None = None  # an epoch's batches from a later bpe_dropout_start_epoch on
    corpora: tuple[CorpusShare, ...] | None = None  # with data.corpora
    pack_tokens: tuple[int, int] | None = None  # packed batches (train.batching): source, target tokens of a pack
    frozen: FrozenParts | None = None  # with train.freeze
    filtered: tuple[Filtered, ...] = ()  # with data.filters
    removed_at: str = "in the run directory's corpus_cache/removed/"  # where the removed pairs' files are

    @property
    def steps_per_epoch(self) -> float:
        """Updates per epoch, each of `batches_per_step` batches."""
        return self.batches_per_epoch / self.batches_per_step

    @property
    def epochs_to_max_steps(self) -> float:
        """Epochs in train.max_steps updates (from a later BPE-dropout start on, of `dropout_batches_per_epoch`)."""
        plain_steps = self.bpe_dropout[3] * self.steps_per_epoch if self.dropout_batches_per_epoch else self.max_steps
        if self.max_steps <= plain_steps:
            return self.max_steps / self.steps_per_epoch
        return self.bpe_dropout[3] + (self.max_steps - plain_steps) * self.batches_per_step / self.dropout_batches_per_epoch

    def to_dict(self) -> dict:
        """The report as plain JSON values, for `summary.json`."""
        return {"pairs": self.pairs, "carved_from_train": list(self.carved), "removed": self.removed,
                "lengths": {f"{split}.{side}": {**{f"p{p}": v for p, v in stats.percentiles.items()}, "max": stats.max}
                            for (split, side), stats in self.lengths.items()},
                "valid_truncated": self.valid_truncated, "unk_rate": self.unk_rate, "word_coverage": self.word_coverage,
                "src_tokens_per_epoch": self.src_tokens_per_epoch, "tgt_tokens_per_epoch": self.tgt_tokens_per_epoch,
                "batches_per_epoch": self.batches_per_epoch, "steps_per_epoch": self.steps_per_epoch,
                "bpe_dropout": None if self.bpe_dropout is None else dict(zip(
                    ("rate", "variants", "tgt_token_ratio", "start_epoch"), self.bpe_dropout)),
                "corpora": None if self.corpora is None else [dataclasses.asdict(c) for c in self.corpora],
                "pack_tokens": None if self.pack_tokens is None else list(self.pack_tokens),
                "frozen": None if self.frozen is None else dataclasses.asdict(self.frozen),
                "filtered": [{key: value for key, value in dataclasses.asdict(f.count).items() if key != "file"}
                             for f in self.filtered]}

    def render(self) -> str:
        """The report as a compact text table: a label column, then aligned cells per block."""
        lang = self.languages
        cut = [f"{n:,} {what}{'s' if n != 1 else ''}, {where}" for n, what, where in (
            (self.valid_truncated["src"], "validation source", "cut when translated"),
            (self.valid_truncated["tgt"], "reference", "cut in the validation loss only")) if n]
        rate, variants, ratio, start = self.bpe_dropout or (0, 0, 0, 0)
        blocks = [block for block in (  # falsy: a block left out
            [["pairs", *(f"{split} {self.pairs[split]:,}" + (" (carved from train)" if split in self.carved else "")
                         for split in SPLITS)]],
            self.corpora is not None and (
                [["corpora", "pairs", "target tokens", "weight", "share of an epoch: pairs", "tokens"]]
                + [[f"  {c.path}" + (f" ({c.pair})" if c.pair else ""), f"{c.pairs:,}", f"{c.tgt_tokens:,}", f"{c.weight:g}", f"{100 * c.share:.1f}%",
                    f"{100 * c.tgt_share:.1f}%"] for c in self.corpora]),
            [["removed by filters", *(f"{name} {count:,}" for name, count in self.removed.items())]],
            self.filtered and [["data.filters", "split", "removed", "of", "share"]] + [
                [f"  {f.count.filter}", f.count.split, f"{f.count.removed:,}", f"{f.count.seen:,}",
                 f"{100 * f.count.removed / max(f.count.seen, 1):.1f}%"] for f in self.filtered],
            *([[f"  {f.count.filter} e.g.", f.shown()]] for f in self.filtered if f.examples),
            self.filtered and [["  all removed pairs", f"{self.removed_at}{{split}}.{{filter}}.tsv (the first "
                                                       f"{MAX_REMOVED_LINES:,} of each)"]],
            [["BPE tokens per sentence", *(f"p{p}" for p in PERCENTILES), "max"]]
            + [[f"  {split} {lang[side]}", *(f"{stats.percentiles[p]:,}" for p in PERCENTILES), f"{stats.max:,}"]
               for (split, side), stats in self.lengths.items()],
            cut and [["  longer than max_len", "; ".join(cut)]],
            [["validation", lang["src"], lang["tgt"]],
             ["  <unk> tokens", *(f"{100 * self.unk_rate[side]:.2f}%" for side in SIDES)],
             ["  words seen in train", *(f"{100 * self.word_coverage[side]:.1f}%" for side in SIDES)]],
            self.bpe_dropout is not None and [[
                "BPE-dropout", f"{rate:g} on training pairs only, {variants} cached segmentations cycled by epoch"
                f"{f' from epoch {start}' if start else ''}; {ratio:.2f}x the plain BPE target tokens"]],
            [["per epoch", f"{self.tgt_tokens_per_epoch:,} target tokens ({self.src_tokens_per_epoch:,} source), "
                           + (f"{self.batches_per_epoch:,} batches of at most {self.batch_tokens:,} padded tokens"
                              if self.pack_tokens is None else f"{self.batches_per_epoch:,} packs of "
                              f"{self.pack_tokens[0]:,} source and {self.pack_tokens[1]:,} target tokens")
                           + (f" = {self.steps_per_epoch:,.1f} steps of {self.batches_per_step} batches"
                              if self.batches_per_step > 1 else "")]],
            [["until max_steps", f"{self.max_steps:,} steps = {self.epochs_to_max_steps:,.1f} epochs"]],
            self.frozen is not None and [["frozen (train.freeze)", self.frozen.shown()]],
        ) if block]
        label_width = max(len(row[0]) for block in blocks for row in block)
        lines = []
        for block in blocks:
            if len(block) == 1:  # free text: cells three spaces apart
                lines.append(f"{block[0][0].ljust(label_width)}  {'   '.join(block[0][1:])}")
                continue
            widths = [max(len(row[i]) for row in block) for i in range(1, len(block[0]))]
            lines.extend(f"{row[0].ljust(label_width)}  " + "  ".join(cell.rjust(w) for cell, w in zip(row[1:], widths))
                         for row in block)
        return "\n".join(line.rstrip() for line in lines)


def build_report(cfg: Config, corpus: Corpus, tokenizers: TokenizerPair, train: TokenizedSplit, world_size: int = 1,
                 pad_to_multiple: int = 1, packed: bool = False) -> DataReport:
    """Describe `corpus` as tokenized for training (`train`), batched as `world_size` processes batch
    it (`packed`: in packs, a pair too long for one refused here)."""
    n_pairs = len(train)  # block 0 of the table: each pair once, in plain BPE (`training_split.EpochRows`)
    train_src = np.asarray(train.src_len[:n_pairs], dtype=np.int64)
    train_tgt = np.asarray(train.tgt_len[:n_pairs], dtype=np.int64)
    first_epoch = np.arange(n_pairs) if train.epoch_rows is None else train.epoch_rows(0)
    valid_ids = {"src": tokenizers.encode_src(corpus.valid["src"][:]),
                 "tgt": tokenizers.encode_tgt(corpus.valid["tgt"][:])}
    lengths = {("train", "src"): train_src, ("train", "tgt"): train_tgt,
               **{("valid", side): np.array([len(s) for s in ids], dtype=np.int64) for side, ids in valid_ids.items()}}
    # Cut as training cuts it: under torchrun an incomplete last group of batches is filled up.
    pair_lengths = (train.src_len + 1, train.tgt_len + 1)  # with EOS, BOS
    pack = pack_shape(*pair_lengths, cfg.train.batch_tokens, pad_to_multiple) if packed else None
    sampler = TokenBatchSampler(train.lengths(), cfg.train.batch_tokens, cfg.seed, pad_to_multiple=pad_to_multiple,
                                max_length=cfg.model.max_len, epoch_rows=train.epoch_rows, world_size=world_size,
                                pack=pack, pair_lengths=pair_lengths)
    return DataReport(
        pairs={"train": len(train_src), "valid": len(corpus.valid), "test": len(corpus.test)},
        carved=corpus.carved,
        removed={**corpus.removed, "too_many_tokens": len(corpus.train) - len(train_src)},
        lengths={key: length_stats(values) for key, values in lengths.items()},
        valid_truncated={side: sum(len(seq) >= cfg.model.max_len for seq in ids) for side, ids in valid_ids.items()},
        unk_rate={side: unk_rate(ids) for side, ids in valid_ids.items()},
        word_coverage={side: word_coverage(corpus.valid[side][:], iter_text_batches(corpus.train, side))
                       for side in SIDES},
        src_tokens_per_epoch=int(train.src_len[first_epoch].sum()) + len(first_epoch),
        tgt_tokens_per_epoch=int(train.tgt_len[first_epoch].sum()) + len(first_epoch),
        batches_per_epoch=len(sampler.epoch_batches(0)),
        batches_per_step=cfg.train.accum_steps * world_size,
        batch_tokens=cfg.train.batch_tokens,
        max_steps=cfg.train.max_steps,
        languages={"src": cfg.data.src_lang, "tgt": cfg.data.tgt_lang},
        bpe_dropout=_dropout_summary(cfg, train),
        dropout_batches_per_epoch=(len(sampler.epoch_batches(cfg.tokenizer.bpe_dropout_start_epoch))
                                   if cfg.tokenizer.bpe_dropout and cfg.tokenizer.bpe_dropout_start_epoch else None),
        corpora=_corpus_shares(cfg, train, train_tgt, first_epoch) if cfg.data.corpora else None,
        pack_tokens=None if pack is None else (pack.src_tokens, pack.tgt_tokens),
        filtered=tuple(Filtered(count, tuple(removed_examples(corpus.directory / count.file)))
                       for count in corpus.filtered),
    )


def _dropout_summary(cfg: Config, train: TokenizedSplit) -> tuple[float, int, float, int] | None:
    """`DataReport.bpe_dropout`."""
    if not cfg.tokenizer.bpe_dropout:
        return None
    start = cfg.tokenizer.bpe_dropout_start_epoch
    pairs = train.epoch_rows.pairs(start)  # rows of block 0 (plain BPE); block 1 holds the first segmentation
    plain, dropped = (int(train.tgt_len[rows].sum()) + len(rows) for rows in (pairs, pairs + len(train)))
    return cfg.tokenizer.bpe_dropout, cfg.tokenizer.bpe_dropout_variants, dropped / max(plain, 1), start


def _corpus_shares(cfg: Config, train: TokenizedSplit, train_tgt: np.ndarray,
                   first_epoch: np.ndarray) -> tuple[CorpusShare, ...]:
    """Each corpus's pairs, plain target tokens, weight, and share of an epoch's pairs and `first_epoch`'s tokens."""
    plan = train.epoch_rows
    counts, per_epoch = (plan.counts, plan.pairs_per_epoch()) if plan is not None else ((len(train),), [len(train)])
    ends = np.cumsum(counts)
    corpus_of = np.searchsorted(ends, first_epoch % len(train), side="right")  # a row's pair: its number mod pairs
    epoch_tokens = np.bincount(corpus_of, weights=np.asarray(train.tgt_len[first_epoch], dtype=np.int64) + 1,
                               minlength=len(counts))
    return tuple(CorpusShare(entry.path, n, int(train_tgt[end - n:end].sum()) + n, entry.weight,
                             drawn / max(sum(per_epoch), 1), float(tokens / max(epoch_tokens.sum(), 1)),
                             entry.target_lang and f"{cfg.data.src_lang}-{entry.target_lang}")
                 for entry, n, end, drawn, tokens in zip(cfg.data.corpora, counts, ends, per_epoch, epoch_tokens))


def length_stats(lengths: Sequence[int] | np.ndarray) -> LengthStats:
    """Nearest-rank percentiles (the smallest length with at least p% at or below it) and the maximum."""
    values = np.percentile(np.asarray(lengths), [*PERCENTILES, 100], method="inverted_cdf")
    return LengthStats(dict(zip(PERCENTILES, map(int, values[:-1]))), int(values[-1]))


def unk_rate(id_seqs: Sequence[Sequence[int]]) -> float:
    """Share of all tokens in `id_seqs` that are `<unk>`; 0 when there are no tokens."""
    total = sum(len(seq) for seq in id_seqs)
    return sum(token == UNK_ID for seq in id_seqs for token in seq) / max(total, 1)


def word_coverage(lines: Sequence[str], reference_batches: Iterable[Sequence[str]]) -> float:
    """Share of the running words of `lines` that occur in `reference_batches` (batches of lines, read once)."""
    words = [word for line in lines for word in line.split()]
    wanted, known = set(words), set()
    for batch in reference_batches:
        known |= wanted.intersection(" ".join(batch).split())
    return sum(word in known for word in words) / max(len(words), 1)


def estimated_time(report: DataReport, tgt_tokens_per_s: float, step: int) -> str:
    """A log line: time per epoch and to `train.max_steps` at the measured training throughput."""
    seconds_per_epoch = report.tgt_tokens_per_epoch / max(tgt_tokens_per_s, 1e-9)
    seconds_left = max(report.max_steps - step, 0) * seconds_per_epoch / report.steps_per_epoch
    return (f"estimated training time at {tgt_tokens_per_s:,.0f} target tokens/s: {format_duration(seconds_per_epoch)} "
            f"per epoch, {format_duration(seconds_left)} more to train.max_steps={report.max_steps:,} "
            "(validation not included)")


def format_duration(seconds: float) -> str:
    """`0.4s`, `42s`, `3m 05s`, `2h 07m`, `3d 04h`."""
    if seconds < 9.95:  # a tiny corpus's epoch takes well under a second
        return f"{seconds:.1f}s".replace(".0s", "s")
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"
