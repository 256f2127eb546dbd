"""BPE tokenizers (HuggingFace `tokenizers`, SentencePiece-style pre-tokens): train, save, load; fixed special ids."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
import threading
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from transformer_mt.config.schema import TokenizerConfig
from transformer_mt.core.errors import CheckpointError
from transformer_mt.core.files import write_text_atomic
from transformer_mt.core.run_layout import JOINT_FILE, SRC_FILE, TGT_FILE

if TYPE_CHECKING:
    from tqdm import tqdm

logger = logging.getLogger(__name__)
T = TypeVar("T")

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)  # their position here is their id
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(4)


def token_room(max_len: int) -> int:
    """The tokens of one sentence a model of `max_len` positions reads: all but the position of its
    EOS (a source) or BOS (a target's input)."""
    return max_len - 1


def model_source(ids: Sequence[T], max_len: int, eos: T = EOS_ID) -> list[T]:
    """A source as the model reads it: cut to `token_room(max_len)` tokens (ids, or pieces with
    `eos` the EOS piece), then EOS."""
    return [*ids[:token_room(max_len)], eos]


def word_indices(text: str, offsets: Sequence[tuple[int, int]], shift: int = 0) -> list[int | None]:
    """For each piece, by its character span in `text` (`offsets`, each moved by `shift`), the index
    in `text.split()` of the word holding its first non-space character; None for a piece of spaces."""
    word_at: list[int | None] = [None] * len(text)  # character -> its word
    for number, word in enumerate(re.finditer(r"\S+", text)):
        word_at[word.start():word.end()] = [number] * (word.end() - word.start())
    return [next((word_at[i] for i in range(start + shift, end + shift) if word_at[i] is not None), None)
            for start, end in offsets]


def is_language_tag(piece: str) -> bool:
    return len(piece) > 4 and piece.startswith(">>") and piece.endswith("<<")


def leading_tag(line: str) -> tuple[str | None, str]:
    """A line's leading `>>xxx<<` and the text after it, as `MarianTokenizer` splits one off; (None, line) without."""
    end = line.find("<<", 2) if line.startswith(">>") else -1
    return (line[:end + 2], line[end + 2:]) if end > 2 else (None, line)


# Lines with a longer run of non-space characters are left out of BPE training (its time grows with
# the square of a word's length); they are still tokenized.
MAX_WORD_CHARS = 1000


@dataclass(frozen=True)
class TokenizerPair:
    """The source and target tokenizers (the same object when the vocabulary is joint)."""

    src: Tokenizer
    tgt: Tokenizer

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @property
    def one_vocabulary(self) -> bool:
        """Both sides give ids of one vocabulary: a joint tokenizer, or two over the same pieces (an
        imported Marian model's SentencePiece models)."""
        return self.joint or self.src.get_vocab(with_added_tokens=True) == self.tgt.get_vocab(with_added_tokens=True)

    def __setstate__(self, state: dict) -> None:
        # Unpickling (in worker processes) rebuilds each Tokenizer from JSON, which lacks `_text_is_text`'s flag.
        self.__dict__.update(state)
        _text_is_text(self.src)
        _text_is_text(self.tgt)

    @property
    def kind(self) -> str:
        """The tokenizers' model: "BPE" (trained by tmt), "Unigram" (SentencePiece's, imported), ..."""
        kinds = dict.fromkeys(type(t.model).__name__ for t in (self.src, self.tgt))
        return " and ".join(kinds)

    @cached_property
    def language_tags(self) -> dict[str, int]:
        """The target-language tags of the source vocabulary (`>>ita<<` -> its id), by id."""
        vocab = self.src.get_vocab(with_added_tokens=True)
        return {piece: i for piece, i in sorted(vocab.items(), key=lambda item: item[1]) if is_language_tag(piece)}

    def encode_src(self, lines: list[str], tag: str | None = None, words: WordIds | None = None) -> list[list[int]]:
        """Token ids of each source line, without special tokens. A line that begins with one of
        `language_tags` keeps it as its first token (the rest encoded as `MarianTokenizer` does);
        the others begin with `tag`'s token when a tag is given (one of `language_tags`). `words`:
        the source tokenizer's `WordIds`, which gives the same ids faster on a large corpus."""
        encode = words.encode if words is not None else partial(encode_batch, self.src)
        if not self.language_tags:
            return encode(lines)
        firsts, texts = self._split_tags(lines, tag)
        return [first + ids for first, ids in zip(firsts, encode(texts))]

    def encode_src_words(self, lines: list[str], tag: str | None = None) -> list[tuple[list[int], list[int | None]]]:
        """`encode_src`'s ids of each line, with the word of the line (`word_indices`) each id
        belongs to; a tag's is None."""
        firsts, texts = self._split_tags(lines, tag)
        return [(first + e.ids, [None] * len(first) + word_indices(line, e.offsets, len(line) - len(text)))
                for line, first, text, e in zip(lines, firsts, texts,
                                                self.src.encode_batch(texts, add_special_tokens=False))]

    def _split_tags(self, lines: list[str], tag: str | None) -> tuple[list[list[int]], list[str]]:
        """Each line's first ids (its known leading tag's, else `tag`'s, else none) and the text after them."""
        tags = self.language_tags
        firsts, texts = [], []
        for line in lines:
            lead, rest = leading_tag(line) if tags else (None, line)
            known = lead in tags
            firsts.append([tags[lead]] if known else [tags[tag]] if tag else [])
            texts.append(rest if known else line)
        return firsts, texts

    def encode_tgt(self, lines: list[str], words: WordIds | None = None) -> list[list[int]]:
        """Token ids of each target line, without special tokens (`words`: as `encode_src`'s, the target's)."""
        return words.encode(lines) if words is not None else encode_batch(self.tgt, lines)

    def encode_tgt_words(self, lines: list[str]) -> list[tuple[list[int], list[int | None]]]:
        """`encode_tgt`'s ids of each line, with the word of the line (`word_indices`) each belongs to."""
        return [(e.ids, word_indices(line, e.offsets))
                for line, e in zip(lines, self.tgt.encode_batch(lines, add_special_tokens=False))]

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        """Detokenised text for each id sequence; special tokens are dropped."""
        return self.tgt.decode_batch(ids, skip_special_tokens=True)

    def src_pieces(self, ids: list[int]) -> list[str]:
        """The BPE pieces behind source ids, e.g. for the axes of an attention plot."""
        return [self.src.id_to_token(i) for i in ids]

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        return [self.tgt.id_to_token(i) for i in ids]

    def with_bpe_dropout(self, dropout: float) -> TokenizerPair:
        """Copies that skip each BPE merge with probability `dropout`, unseeded (`token_cache` keeps their ids)."""
        def dropping(tokenizer: Tokenizer) -> Tokenizer:
            settings = json.loads(tokenizer.to_str())
            settings["model"]["dropout"] = dropout
            copy = Tokenizer.from_str(json.dumps(settings))
            _text_is_text(copy)
            return copy

        src = dropping(self.src)
        return TokenizerPair(src, src if self.joint else dropping(self.tgt))

    def fingerprint(self) -> str:
        """A digest of both vocabularies (piece -> id), which checkpoints carry."""
        vocabularies = [sorted(t.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
                        for t in (self.src, self.tgt)]
        return hashlib.blake2b(json.dumps(vocabularies, ensure_ascii=False).encode("utf-8"),
                               digest_size=16).hexdigest()

    def save(self, directory: Path) -> None:
        """Write the tokenizer file(s) atomically, the one `exists_in` looks for last."""
        if self.joint:
            write_text_atomic(directory / JOINT_FILE, self.src.to_str(pretty=True))
        else:
            write_text_atomic(directory / TGT_FILE, self.tgt.to_str(pretty=True))
            write_text_atomic(directory / SRC_FILE, self.src.to_str(pretty=True))

    @classmethod
    def load(cls, directory: Path) -> TokenizerPair:
        """Load the tokenizers saved in a run directory."""
        if (directory / JOINT_FILE).is_file():
            joint = _load_file(directory / JOINT_FILE)
            return cls(joint, joint)
        if (directory / SRC_FILE).is_file() and (directory / TGT_FILE).is_file():
            return cls(_load_file(directory / SRC_FILE), _load_file(directory / TGT_FILE))
        raise CheckpointError(f"{directory}: no tokenizer files ({JOINT_FILE}, or {SRC_FILE} and {TGT_FILE}); "
                              "is this a tmt run directory?")

    @classmethod
    def exists_in(cls, directory: Path) -> bool:
        return (directory / JOINT_FILE).is_file() or (directory / SRC_FILE).is_file()


def encode_batch(tokenizer: Tokenizer, lines: list[str]) -> list[list[int]]:
    """Token ids of each line, without special tokens (the Rust threads of `tokenizers` share the lines)."""
    return [e.ids for e in tokenizer.encode_batch(lines, add_special_tokens=False)]


class WordIds:
    """`encode_batch`'s ids of lines, from a cache of each word's ids (a corpus repeats its words: several
    times faster). tmt's BPE splits a line at every space before anything else, so a line of words
    separated by single spaces (NFC, as the tokenizer's normalizer leaves it) is its words' ids end to
    end; any other line, and a tokenizer of another kind (SentencePiece's, BPE-dropout's), are encoded
    whole. At most `MAX_WORDS` words are kept (then the cache starts again)."""

    MAX_WORDS = 500_000

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: dict[str, list[int]] = {}
        settings = json.loads(tokenizer.to_str())
        self.usable = (settings["normalizer"] == {"type": "NFC"} and settings["pre_tokenizer"] == _PRE_TOKENIZER
                       and settings["model"]["type"] == "BPE" and not settings["model"].get("dropout")
                       and all(token["special"] for token in settings["added_tokens"]))

    def encode(self, lines: list[str]) -> list[list[int]]:
        if not self.usable:
            return encode_batch(self.tokenizer, lines)
        split = [line.split() for line in lines]
        whole = [i for i, (line, words) in enumerate(zip(lines, split))
                 if " ".join(words) != line or not (line.isascii() or unicodedata.is_normalized("NFC", line))]
        new = list({word for words in split for word in words if word not in self.ids})
        if len(self.ids) + len(new) > self.MAX_WORDS:
            self.ids.clear()
            new = list({word for words in split for word in words})
        self.ids.update(zip(new, encode_batch(self.tokenizer, new)))
        get = self.ids.__getitem__
        out = [list(chain.from_iterable(map(get, words))) for words in split]
        for i, ids in zip(whole, encode_batch(self.tokenizer, [lines[i] for i in whole])):
            out[i] = ids
        return out


def train_tokenizers(cfg: TokenizerConfig, src_lines: Iterable[str], tgt_lines: Iterable[str],
                     progress: bool = False, n_lines: int | None = None, tags: Sequence[str] = ()) -> TokenizerPair:
    """Train BPE, joint or one per language, reading the lines once; `n_lines` per side sizes the progress bar.
    The target-language `tags` (`>>ita<<`) are special tokens of the source side, which learns from
    its lines without their leading tag."""
    n = len(src_lines) if n_lines is None else n_lines  # type: ignore[arg-type]
    if tags:
        def untagged(line: str) -> str:
            lead, rest = leading_tag(line)
            return rest.lstrip() if lead in tags else line

        src_lines = map(untagged, src_lines)
    if cfg.joint:
        joint = _train_bpe(cfg, chain(src_lines, tgt_lines), 2 * n, "BPE (joint)", progress, tags)
        return TokenizerPair(joint, joint)
    return TokenizerPair(_train_bpe(cfg, iter(src_lines), n, "BPE (source)", progress, tags),
                         _train_bpe(cfg, iter(tgt_lines), n, "BPE (target)", progress))


def _train_bpe(cfg: TokenizerConfig, lines: Iterator[str], n_lines: int, desc: str = "BPE",
               progress: bool = False, tags: Sequence[str] = ()) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    _text_is_text(tokenizer)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                  special_tokens=[*SPECIAL_TOKENS, *tags], show_progress=False)
    from tqdm import tqdm  # not on `tmt translate`'s path

    # A bar on stderr when it is a terminal, gone once done.
    with tqdm(total=n_lines, desc=desc, unit="line", unit_scale=n_lines >= 10_000, leave=False, file=sys.stderr,
              dynamic_ncols=True, disable=not (progress and sys.stderr.isatty())) as bar:
        kept = _KeptLines(lines, bar)
        _train_from_lines(tokenizer, trainer, kept, n_lines)
    if kept.left_out:
        logger.warning("%s: left %d training line(s) with a run of over %d non-space characters out of BPE "
                       "training (they stay in the corpus; a pair longer than model.max_len tokens is not trained on)",
                       desc, kept.left_out, MAX_WORD_CHARS)
    _check_special_ids(tokenizer, "trained tokenizer")
    return tokenizer


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """SentencePiece-style words: "▁" for each space and before the first word, punctuation on its own."""
    return pre_tokenizers.Sequence([pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
                                    pre_tokenizers.Punctuation(behavior="isolated")])


def _pre_tokenizer_settings() -> dict:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer()
    return json.loads(tokenizer.to_str())["pre_tokenizer"]


_PRE_TOKENIZER = _pre_tokenizer_settings()  # as a tokenizer file holds it


def _train_from_lines(tokenizer: Tokenizer, trainer, kept: _KeptLines, n_lines: int) -> None:
    """`train_from_iterator` in a thread of its own. The training reads the lines on its Rust threads,
    where no Python signal handler runs, and would keep Ctrl-C (or SIGTERM) waiting until it ends; the
    main thread waits here instead, takes the signal at once, and the lines end the training."""
    failed: list[BaseException] = []

    def train() -> None:
        try:
            tokenizer.train_from_iterator(kept, trainer=trainer, length=n_lines)
        except BaseException as err:  # raised in the caller's thread
            failed.append(err)

    worker = threading.Thread(target=train, name="tmt-bpe", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except BaseException:
        kept.stopped = True  # the lines raise: the training stops reading (its merges, once begun, run to the end)
        raise
    if failed:
        raise failed[0]


class _KeptLines:
    """`lines` but those with a run of over `MAX_WORD_CHARS` non-space characters (`left_out`), counted in `bar`;
    once `stopped`, an error within 10,000 lines."""

    def __init__(self, lines: Iterator[str], bar: tqdm):
        self.lines, self.bar = lines, bar
        self.left_out = 0
        self.stopped = False

    def __iter__(self) -> Iterator[str]:
        read = 0
        for read, line in enumerate(self.lines, start=1):
            if read % 10_000 == 0:  # an update per line would cost more than the line
                if self.stopped:
                    raise RuntimeError("BPE training stopped")
                self.bar.update(10_000)
            if len(line) > MAX_WORD_CHARS and max(map(len, line.split())) > MAX_WORD_CHARS:
                self.left_out += 1
            else:
                yield line
        self.bar.update(read % 10_000)


def _load_file(path: Path) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises a bare Exception on bad JSON
        raise CheckpointError(f"{path}: cannot load tokenizer ({err})") from None
    _check_special_ids(tokenizer, str(path))
    _text_is_text(tokenizer)
    return tokenizer


def _text_is_text(tokenizer: Tokenizer) -> None:
    """Encode a literal "<s>", "</s>" or "<pad>" as text, never as the special token (a flag files do not keep)."""
    tokenizer.encode_special_tokens = True


def _check_special_ids(tokenizer: Tokenizer, where: str) -> None:
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise CheckpointError(f"{where}: special token {token} does not have id {expected_id}")

