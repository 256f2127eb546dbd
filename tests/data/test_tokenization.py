import json
import pickle
from pathlib import Path

import pytest

from transformer_mt.config.schema import TokenizerConfig
from transformer_mt.data import tokenization
from transformer_mt.data.tokenization import BOS, EOS, PAD, UNK, TokenizerPair, train_tokenizers

SRC = ["Where is the coffee?", "The city is beautiful, isn't it?", "I have 3 brothers."] * 5
TGT = ["Dov'è il caffè?", "La città è bella, vero?", "Ho 3 fratelli. Perché più così?"] * 5


def test_accented_text_round_trips_exactly():
    pair = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1), SRC, TGT)
    assert pair.decode_tgt(pair.encode_tgt(TGT[:3])) == TGT[:3]
    assert pair.decode_tgt(pair.encode_tgt(SRC[:3])) == SRC[:3]  # joint: one vocabulary


def test_punctuation_is_split_but_detokenised_without_spaces():
    pair = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1), SRC, TGT)
    tokens = pair.tgt.encode("Dov'è il caffè?", add_special_tokens=False).tokens
    assert "?" in tokens  # punctuation is its own token...
    assert pair.decode_tgt([pair.tgt.encode("Dov'è il caffè?", add_special_tokens=False).ids]) == ["Dov'è il caffè?"]


def test_special_tokens_have_fixed_ids_and_are_dropped_when_decoding():
    pair = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1, joint=False), SRC, TGT)
    for tokenizer in (pair.src, pair.tgt):
        assert [tokenizer.token_to_id(t) for t in (PAD, UNK, BOS, EOS)] == [0, 1, 2, 3]
    ids = pair.encode_tgt(["La città è bella, vero?"])[0]
    assert pair.decode_tgt([[2] + ids + [3, 0, 0]]) == ["La città è bella, vero?"]


def test_separate_tokenizers_save_and_load(tmp_path: Path):
    pair = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1, joint=False), SRC, TGT)
    pair.save(tmp_path)
    loaded = TokenizerPair.load(tmp_path)
    assert not loaded.joint
    assert loaded.encode_src(SRC[:2]) == pair.encode_src(SRC[:2])
    assert loaded.encode_tgt(TGT[:2]) == pair.encode_tgt(TGT[:2])


def test_the_fingerprint_survives_save_and_load_and_tells_other_vocabularies_apart(tmp_path: Path):
    pair = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1), SRC, TGT)
    pair.save(tmp_path)
    assert TokenizerPair.load(tmp_path).fingerprint() == pair.fingerprint()
    # Other pieces (other text): what a checkpoint of another run would have been trained with.
    other = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1), [s.upper() for s in SRC], TGT)
    assert other.fingerprint() != pair.fingerprint()
    separate = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1, joint=False), SRC, TGT)
    assert separate.fingerprint() != pair.fingerprint()


def test_progress_bars_stay_off_when_stderr_is_not_a_terminal(capsys):
    quiet = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1), SRC, TGT)
    shown = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1), SRC, TGT, progress=True)
    assert shown.encode_tgt(TGT) == quiet.encode_tgt(TGT)  # the bar changes nothing
    assert shown.src.to_str() == quiet.src.to_str()
    assert capsys.readouterr().err == ""  # captured stderr is not a TTY


@pytest.mark.parametrize("unset", [False, True])
def test_max_train_pairs_trains_the_tokenizers_on_the_seeded_sample(tiny_corpus, tmp_path, monkeypatch, unset):
    from tests.helpers import tiny_config
    from transformer_mt.config import schema
    from transformer_mt.data.corpus import load_corpus, sample_rows
    from transformer_mt.train.preparation import prepare_data

    if unset:  # the automatic sample, made smaller than this corpus
        monkeypatch.setattr(schema, "AUTO_MAX_TRAIN_PAIRS", 4)
    cfg = tiny_config(tiny_corpus, tokenizer={} if unset else {"max_train_pairs": 4})
    run = tmp_path / "run"
    tokenizers, *_ = prepare_data(cfg, run)
    train = load_corpus(cfg.data, cfg.seed, run).train  # the same rows training saw
    rows = sample_rows(len(train), 4, cfg.seed)
    expected = train_tokenizers(cfg.tokenizer, [train["src"][int(i)] for i in rows],
                                [train["tgt"][int(i)] for i in rows])
    assert tokenizers.src.to_str() == expected.src.to_str()
    everything = train_tokenizers(cfg.tokenizer, train["src"][:], train["tgt"][:])
    assert tokenizers.src.to_str() != everything.src.to_str()  # the sample is not the whole split


def test_special_token_strings_in_text_are_encoded_as_text(tmp_path: Path):
    html = ["Strike <s>this</s> out <pad> now.", "Plain text."] * 5
    pair = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1), SRC + html, TGT + html)
    pair.save(tmp_path)
    for tokenizers in (pair, TokenizerPair.load(tmp_path), pickle.loads(pickle.dumps(pair))):
        ids = tokenizers.encode_tgt(html[:1])[0]
        assert not {0, 2, 3} & set(ids)  # no <pad>, <s> or </s> in the middle of a sentence
        assert tokenizers.decode_tgt([ids]) == html[:1]
        assert tokenizers.encode_src(html[:1]) == [ids]


def test_lines_with_an_overlong_word_are_left_out_of_bpe_training(caplog):
    cfg = TokenizerConfig(vocab_size=150, min_frequency=1)
    long_word = "ab" * (tokenization.MAX_WORD_CHARS // 2 + 1)  # one "word" just over the limit
    just_fits = "Ciao " + "c" * tokenization.MAX_WORD_CHARS  # a word at the limit: trained on
    without = train_tokenizers(cfg, SRC, TGT + [just_fits])  # the same lines, less the long one
    with caplog.at_level("WARNING", logger="transformer_mt.data.tokenization"):
        with_long = train_tokenizers(cfg, SRC + [long_word], TGT + [just_fits])
    assert "left 1 training line(s) with a run of over 1000 non-space characters" in caplog.text
    assert with_long.src.get_vocab() == without.src.get_vocab()  # nothing learnt from the left-out line
    assert any(piece.startswith("cc") for piece in with_long.src.get_vocab())  # the line at the limit was trained on
    assert with_long.encode_src([long_word])[0]  # still tokenized


def test_a_bpe_dropout_copy_splits_words_smaller_and_decodes_the_same_leaving_the_original_plain():
    pair = train_tokenizers(TokenizerConfig(vocab_size=120, min_frequency=1), SRC, TGT)
    dropping = pair.with_bpe_dropout(0.5)
    assert dropping.joint and dropping.src.get_vocab() == pair.src.get_vocab()
    plain = pair.encode_tgt(TGT)
    dropped = dropping.encode_tgt(TGT)
    assert dropped != plain and sum(map(len, dropped)) > sum(map(len, plain))
    assert pair.decode_tgt(dropped) == pair.decode_tgt(plain) == TGT
    assert pair.encode_tgt(TGT) == plain  # the original never drops
    assert json.loads(pair.src.to_str())["model"]["dropout"] is None  # what `save` writes


def test_a_source_is_cut_to_all_but_one_position_then_eos():
    from transformer_mt.data.tokenization import EOS_ID, model_source, token_room

    assert token_room(8) == 7  # one position is the sentence's EOS (source) or BOS (target input)
    assert model_source([5, 6, 7], max_len=8) == [5, 6, 7, EOS_ID]
    assert model_source(list(range(10, 20)), max_len=8) == [10, 11, 12, 13, 14, 15, 16, EOS_ID]
    assert model_source((), max_len=8) == [EOS_ID]
    assert model_source(list("abcdefghij"), max_len=4, eos="</s>") == ["a", "b", "c", "</s>"]  # pieces too


# Lines a word cache could get wrong: spaces of every kind, text not in NFC, punctuation, special
# token strings, tags, scripts without spaces, an empty line.
TRICKY = ["Hello, world!", "  two  spaces and ends ", "tab\there", "no\u00a0break space", "", " ",
          "cafe\u0301 decomposed", "café composed", "\u0301starts with a combining mark", "(quoted) «words»",
          "Strike <s>this</s> out <pad>", "mid >>ita<< tag", "中文没有空格。", "emoji 🙂 here", "x" * 300,
          "L'hôtel dell'arte: 3.5%", "trailing space ", "line\u2028separator"]


@pytest.mark.parametrize("joint", [True, False])
def test_word_ids_give_what_encode_batch_gives(joint, monkeypatch):
    tags = (">>ita<<", ">>fra<<")
    pair = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1, joint=joint), SRC + TRICKY,
                            TGT + TRICKY, tags=tags)
    monkeypatch.setattr(tokenization.WordIds, "MAX_WORDS", 12)  # the cache starts again several times
    src_words, tgt_words = tokenization.WordIds(pair.src), tokenization.WordIds(pair.tgt)
    assert src_words.usable and tgt_words.usable  # tmt's BPE: the cache is used
    lines = SRC + TGT + TRICKY + [">>fra<< " + line for line in TRICKY]
    for start in range(0, len(lines), 7):  # chunk after chunk, as the token cache encodes
        chunk = lines[start:start + 7]
        assert pair.encode_src(chunk, words=src_words) == pair.encode_src(chunk)
        assert pair.encode_src(chunk, ">>ita<<", words=src_words) == pair.encode_src(chunk, ">>ita<<")
        assert pair.encode_tgt(chunk, tgt_words) == pair.encode_tgt(chunk)
    assert 0 < len(src_words.ids) <= 12


def test_word_ids_encode_whole_lines_with_a_tokenizer_of_another_kind():
    pair = train_tokenizers(TokenizerConfig(vocab_size=150, min_frequency=1), SRC, TGT)
    assert not tokenization.WordIds(pair.with_bpe_dropout(0.1).src).usable  # each occurrence segmented afresh
    other = tokenization.Tokenizer.from_str(pair.src.to_str())
    other.pre_tokenizer = tokenization.pre_tokenizers.Whitespace()
    words = tokenization.WordIds(other)
    assert not words.usable
    assert words.encode(TRICKY) == tokenization.encode_batch(other, TRICKY) and not words.ids
