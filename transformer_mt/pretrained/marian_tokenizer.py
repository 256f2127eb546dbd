"""A Marian (OPUS-MT) folder's SentencePiece tokenizers as tmt tokenizers, with `MarianTokenizer`'s ids.

`MarianTokenizer` segments a line with its side's SentencePiece model (`source.spm`, `target.spm`) and
looks each piece, and each run of characters the model does not know, up in the one `vocab.json`
(`<unk>` when absent). Each side here becomes a HF `tokenizers` Unigram tokenizer, the one tokenizer
type the rest of tmt knows, rather than SentencePiece at run time: its vocabulary lists the pieces in
tmt's id order (`MarianVocab`); this side's pieces keep their SentencePiece scores and normalizer, so
the segmentation is SentencePiece's; the other side's pieces score below any segmentation of the
same characters, so they match only where SentencePiece finds no piece, as `MarianTokenizer`'s
lookup does. The ids are `MarianTokenizer`'s but in two cases a lattice over one vocabulary cannot
follow (docs/development/architecture.md): an unknown run of characters that are the other side's
pieces while the run is not one, and a literal "<pad>", "</s>" or "<unk>" whose characters the model
knows (text for tmt, the special id for `MarianTokenizer`). Folders whose model has pieces that
`vocab.json` lacks (they would need `<unk>`'s id beside their own), byte fallback or user-defined
pieces are refused. Reading a folder needs `sentencepiece`; the tokenizers made do not.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

from transformer_mt.core.errors import TmtError
from transformer_mt.data.tokenization import BOS, EOS, PAD, SPECIAL_TOKENS, UNK, TokenizerPair, is_language_tag
from transformer_mt.pretrained.marian import read_json_object
from transformer_mt.pretrained.marian_vocab import MarianVocab

SIDES = ("source.spm", "target.spm")
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)  # SentencePiece's piece types
# A foreign piece of L characters scores L * (lowest score - FOREIGN_PENALTY) plus a bonus under one per
# extra character: worse than any SentencePiece segmentation of the same characters, fewer pieces first.
FOREIGN_PENALTY = 10.0


def marian_tokenizers(folder: Path) -> tuple[TokenizerPair, MarianVocab]:
    """The source and target tokenizers of a Marian folder (one object when both spm files are the same
    model), and the order of its Marian ids in tmt's."""
    for name in SIDES:
        if not (folder / name).is_file():
            raise TmtError(f"{folder}: a tokenizer without spm files is not supported (no {name}; "
                           "tmt reads Marian's SentencePiece tokenizers)")
    settings = read_json_object(folder / "tokenizer_config.json")
    if settings.get("separate_vocabs") or (folder / "target_vocab.json").is_file():
        raise TmtError(f"{folder}: separate source and target vocabularies (target_vocab.json) "
                       "are not supported")
    pieces = _vocabulary(folder / "vocab.json")
    marian = _marian_vocab(folder, pieces, read_json_object(folder / "config.json"))
    names = _tmt_names(folder, pieces, marian)
    src, tgt = (_convert(folder / name, names) for name in SIDES)
    if src.to_str() == tgt.to_str():
        return TokenizerPair(src, src), marian
    return TokenizerPair(src, tgt), marian


def _vocabulary(path: Path) -> list[str]:
    """vocab.json's pieces by Marian id; its ids must be 0..n-1, each once."""
    vocab = read_json_object(path, f"{path}: missing (a Marian folder has vocab.json, source.spm and target.spm)")
    for token in (PAD, UNK, EOS):
        if token not in vocab:
            raise TmtError(f"{path}: no {token} piece (Marian vocabularies have {PAD}, {UNK} and {EOS})")
    by_id: dict[int, str] = {}
    for piece, marian_id in vocab.items():
        if not isinstance(marian_id, int) or isinstance(marian_id, bool) or marian_id < 0 or marian_id in by_id:
            raise TmtError(f"{path}: piece {piece!r} has id {marian_id!r}; "
                           f"ids must be 0..{len(vocab) - 1}, each once")
        by_id[marian_id] = piece
    if sorted(by_id) != list(range(len(by_id))):
        raise TmtError(f"{path}: ids must be 0..{len(vocab) - 1}, each once")
    return [by_id[i] for i in range(len(by_id))]


def _marian_vocab(folder: Path, pieces: list[str], config: dict) -> MarianVocab:
    """Special ids from config.json where it has them, else from vocab.json's pieces; decoding starts from PAD."""
    ids = {piece: i for i, piece in enumerate(pieces)}
    special = {"pad": config.get("pad_token_id", ids[PAD]), "eos": config.get("eos_token_id", ids[EOS])}
    special["decoder_start"] = config.get("decoder_start_token_id", special["pad"])
    for key, value in special.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TmtError(f"{folder / 'config.json'}: {key}_token_id is {value!r}, not a token id")
    for key, token in (("pad", PAD), ("eos", EOS)):
        if special[key] != ids[token]:
            raise TmtError(f"{folder / 'config.json'}: {key}_token_id is {special[key]}, but vocab.json has "
                           f"{token} at {ids[token]}")
    try:
        return MarianVocab.of(len(pieces), unk=ids[UNK], **special)
    except ValueError as err:
        raise TmtError(f"{folder}: {err}") from None


def _tmt_names(folder: Path, pieces: list[str], marian: MarianVocab) -> list[str]:
    """The piece of each tmt id: tmt's special tokens, then Marian's other pieces."""
    rest = [pieces[m] for m in marian.rows[len(SPECIAL_TOKENS):]]
    if BOS in rest:
        raise TmtError(f"{folder / 'vocab.json'}: piece {BOS} (id {pieces.index(BOS)}) is not Marian's decoder "
                       f"start, and tmt keeps {BOS} for that")
    return [*SPECIAL_TOKENS, *rest]


def _convert(path: Path, names: list[str]) -> Tokenizer:
    """One side's SentencePiece model as a Unigram tokenizer whose ids are tmt's (`names` by id)."""
    proto = _load_proto(path)
    kinds = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
    if proto.trainer_spec.model_type != 1:
        raise TmtError(f"{path}: a SentencePiece {kinds.get(proto.trainer_spec.model_type, 'unknown')} model "
                       "is not supported (Marian's are unigram)")
    if proto.trainer_spec.byte_fallback or any(p.type in (USER_DEFINED, BYTE) for p in proto.pieces):
        raise TmtError(f"{path}: SentencePiece byte-fallback and user-defined pieces are not supported")
    scores = {p.piece: p.score for p in proto.pieces if p.type == NORMAL}
    vocab = set(names)
    missing = [piece for piece in scores if piece not in vocab]
    if missing:
        raise TmtError(f"{path}: {len(missing)} piece(s) missing from vocab.json (e.g. {missing[0]!r}); "
                       "tmt cannot give them <unk>'s id as MarianTokenizer does")
    lowest = min(scores.values()) - FOREIGN_PENALTY
    bonus = 1.0 / (max(map(len, names)) + 1)
    foreign = {name: len(name) * lowest + (len(name) - 1) * bonus for name in names if name not in scores}
    tokenizer = Tokenizer(models.Unigram([(name, scores.get(name, foreign.get(name))) for name in names],
                                         unk_id=SPECIAL_TOKENS.index(UNK), byte_fallback=False))
    spec = proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    # MarianTokenizer joins the pieces, spaces for "▁", and strips the ends.
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(),
                                           decoders.Replace(Regex(r"\A +| +\z"), "")])
    # The target-language tags (>>ita<<) too: one token each, never segmented; a line's leading one is
    # split off as MarianTokenizer does (`TokenizerPair.encode_src`).
    tags = [name for name in names if is_language_tag(name)]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in (*SPECIAL_TOKENS, *tags)])
    tokenizer.encode_special_tokens = True  # a literal "</s>" is text, as in tmt's other tokenizers
    return tokenizer


def _load_proto(path: Path):
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise TmtError("reading Marian's SentencePiece models needs sentencepiece and protobuf: "
                       "pip install 'transformer-mt[marian]'") from None
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except OSError as err:
        raise TmtError(f"{path}: cannot read ({err.strerror})") from None
    except Exception:  # protobuf's DecodeError
        raise TmtError(f"{path}: not a SentencePiece model") from None
    if not proto.pieces:
        raise TmtError(f"{path}: not a SentencePiece model")
    return proto
