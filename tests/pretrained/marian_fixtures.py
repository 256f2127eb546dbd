"""A small Marian (OPUS-MT) tokenizer folder built in the test: two SentencePiece unigram models trained on
the demo corpus, their union as Marian's vocab.json, saved by transformers' `MarianTokenizer`."""

from __future__ import annotations

import json
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "transformer_mt" / "corpora" / "demo_en_it"


def demo_lines(lang: str) -> list[str]:
    """Every line of the demo corpus in `lang` (train, valid, test)."""
    return [line for split in ("train", "valid", "test")
            for line in (DEMO / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()]


def train_spm(lines: list[str], prefix: Path, vocab_size: int) -> Path:
    """A SentencePiece unigram model of `lines` (as OPUS-MT's: nmt_nfkc, full character coverage); its path."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0, num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


def marian_vocab(*spm_paths: Path) -> dict[str, int]:
    """Marian's vocabulary of these models: `</s>` 0, `<unk>` 1, their normal pieces in order, each once,
    `<pad>` last."""
    import sentencepiece

    pieces = ["</s>", "<unk>"]
    for path in spm_paths:
        model = sentencepiece.SentencePieceProcessor(model_file=str(path))
        pieces += [model.id_to_piece(i) for i in range(model.get_piece_size())
                   if not (model.is_control(i) or model.is_unknown(i) or model.is_unused(i))]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    vocab["<pad>"] = len(vocab)
    return vocab


def marian_tokenizer_folder(folder: Path, src_lang: str = "en", tgt_lang: str = "it", vocab_size: int = 300,
                            vocab: dict[str, int] | None = None):
    """A folder as `MarianTokenizer.save_pretrained` writes it, for two models of the demo corpus (or `vocab`
    as vocab.json); returns the `MarianTokenizer`."""
    from transformers import MarianTokenizer

    work = folder.parent / f"{folder.name}-spm"
    work.mkdir(parents=True, exist_ok=True)
    src = train_spm(demo_lines(src_lang), work / "source", vocab_size)
    tgt = train_spm(demo_lines(tgt_lang), work / "target", vocab_size)
    vocab = vocab or marian_vocab(src, tgt)
    (work / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = MarianTokenizer(source_spm=str(src), target_spm=str(tgt), vocab=str(work / "vocab.json"),
                                source_lang=src_lang, target_lang=tgt_lang)
    tokenizer.save_pretrained(str(folder))
    return tokenizer
