"""Marian (OPUS-MT) SentencePiece tokenizers read as tmt tokenizers give transformers' `MarianTokenizer` ids."""

from __future__ import annotations

import json
import pickle
import random
import shutil
import sys
import warnings
from pathlib import Path

import pytest

from tests.pretrained.marian_fixtures import demo_lines, marian_tokenizer_folder, marian_vocab
from transformer_mt.core.errors import TmtError
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TokenizerPair
from transformer_mt.pretrained.marian_tokenizer import marian_tokenizers
from transformer_mt.pretrained.marian_vocab import MarianVocab

# Characters neither model saw, digits, punctuation, runs of spaces, tabs, no-break and full-width forms.
HARD_LINES = ["", "   ", "  Two   spaces  and\ta tab. ", "12345, 3.14 e 1/2!?", "Straße 中文 😀 x",
              "«Perché?» — disse.", "ＦＵＬＬ ｗｉｄｔｈ ½ ﬁ", "a\u00a0b\u2009c", "...!!!;;", "città è perché più",
              "L'1 e l' 2"]


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> tuple[Path, object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on sacremoses and the like
        folder = tmp_path_factory.mktemp("marian") / "opus-mt-en-it"
        return folder, marian_tokenizer_folder(folder)


def marian_ids(tokenizer, line: str, side: str) -> list[int]:
    """`MarianTokenizer`'s ids of a line, without the `</s>` it appends."""
    ids = tokenizer(line).input_ids if side == "src" else tokenizer(text_target=line).input_ids
    assert ids[-1] == tokenizer.eos_token_id
    return ids[:-1]


@pytest.mark.parametrize("side,lang", [("src", "en"), ("tgt", "it")])
def test_ids_are_marian_tokenizers_on_every_demo_line(marian, side, lang):
    folder, tokenizer = marian
    pair, vocab = marian_tokenizers(folder)
    tmt_id = vocab.tmt_ids()
    lines = demo_lines(lang) + HARD_LINES
    ours = pair.encode_src(lines) if side == "src" else pair.encode_tgt(lines)
    differ = [(line, ids) for line, ids in zip(lines, ours)
              if ids != [tmt_id[i] for i in marian_ids(tokenizer, line, side)]]
    assert not differ, differ[:3]
    assert len(lines) == 760 + len(HARD_LINES)
    assert any(UNK_ID in ids for ids in ours)  # the unseen characters are there


def test_each_tmt_id_takes_the_row_of_its_marian_piece(marian):
    folder, tokenizer = marian
    pair, vocab = marian_tokenizers(folder)
    assert pair.src.get_vocab_size() == pair.tgt.get_vocab_size() == len(vocab) == len(tokenizer.encoder) + 1
    for piece, marian_id in tokenizer.encoder.items():
        tmt_id = vocab.tmt_ids()[marian_id]
        assert vocab.rows[tmt_id] == marian_id
        assert pair.src.id_to_token(tmt_id) == pair.tgt.id_to_token(tmt_id) == piece
    assert [pair.src.id_to_token(i) for i in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert vocab.rows[BOS_ID] == tokenizer.pad_token_id  # Marian starts decoding from <pad>


def test_decoding_tmt_ids_gives_marian_tokenizers_text(marian):
    folder, tokenizer = marian
    pair, vocab = marian_tokenizers(folder)
    marian_id = {t: m for m, t in enumerate(vocab.tmt_ids())}
    lines = demo_lines("it") + HARD_LINES
    # A model may put any piece anywhere, EOS and PAD included: random id sequences too.
    rng = random.Random(0)
    sequences = pair.encode_tgt(lines) + [[rng.randrange(len(vocab)) for _ in range(rng.randrange(1, 30))]
                                          for _ in range(300)]
    sequences = [[i for i in ids if i != BOS_ID] for ids in sequences]  # BOS is tmt's decoder start, never output
    expected = [tokenizer.decode([marian_id[i] for i in ids], skip_special_tokens=True) for ids in sequences]
    assert pair.decode_tgt(sequences) == expected
    assert pair.decode_tgt(pair.encode_tgt(demo_lines("it")[:50])) == demo_lines("it")[:50]


def test_where_a_unigram_lattice_cannot_follow_marians_lookup(marian):
    # Documented: a run of characters the Italian model never saw ("k", "y" are English pieces) is one
    # <unk> for MarianTokenizer, the English pieces for tmt; a lone such character is the same for both.
    folder, tokenizer = marian
    pair, vocab = marian_tokenizers(folder)
    tmt_id = vocab.tmt_ids()
    assert UNK_ID in [tmt_id[i] for i in marian_ids(tokenizer, "sky", "tgt")]
    assert UNK_ID not in pair.encode_tgt(["sky"])[0]
    assert pair.encode_tgt(["k"]) == [[tmt_id[i] for i in marian_ids(tokenizer, "k", "tgt")]]


def test_saves_loads_and_pickles_as_a_tmt_runs_tokenizers(marian, tmp_path):
    folder, _ = marian
    pair, _ = marian_tokenizers(folder)
    assert not pair.joint  # two SentencePiece models, one vocabulary
    pair.save(tmp_path)
    loaded = TokenizerPair.load(tmp_path)
    assert not loaded.joint and loaded.fingerprint() == pair.fingerprint()
    lines = demo_lines("en")[:100] + HARD_LINES + ["<pad> </s>"]
    for copy in (loaded, pickle.loads(pickle.dumps(pair))):
        assert copy.encode_src(lines) == pair.encode_src(lines)
        assert copy.encode_tgt(lines) == pair.encode_tgt(lines)
        assert copy.decode_tgt(pair.encode_tgt(lines)) == pair.decode_tgt(pair.encode_tgt(lines))


def test_one_spm_model_for_both_sides_is_one_joint_tokenizer(marian, tmp_path):
    folder, tokenizer = marian
    shared = tmp_path / "shared"
    shutil.copytree(folder, shared)
    shutil.copyfile(shared / "source.spm", shared / "target.spm")
    pair, vocab = marian_tokenizers(shared)
    assert pair.joint
    line = demo_lines("en")[0]
    assert pair.encode_tgt([line])[0] == [vocab.tmt_ids()[i] for i in marian_ids(tokenizer, line, "src")]


def test_special_ids_come_from_config_json_where_it_has_them(marian, tmp_path):
    folder, tokenizer = marian
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    n = len(tokenizer.encoder)
    assert marian_tokenizers(copy)[1] == MarianVocab.of(n, pad=n - 1, unk=1, eos=0, decoder_start=n - 1)
    (copy / "config.json").write_text(json.dumps({"pad_token_id": n - 1, "eos_token_id": 0,
                                                  "decoder_start_token_id": 5}))
    assert marian_tokenizers(copy)[1] == MarianVocab.of(n, pad=n - 1, unk=1, eos=0, decoder_start=5)


def folder_copy(folder: Path, tmp_path: Path, **vocab_changes) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    vocab = json.loads((copy / "vocab.json").read_text(encoding="utf-8"))
    for piece, marian_id in vocab_changes.items():
        if marian_id is None:
            del vocab[piece]
        else:
            vocab[piece] = marian_id
    (copy / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    return copy


def refusal(folder: Path) -> str:
    with pytest.raises(TmtError) as err:
        marian_tokenizers(folder)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_folders_tmt_cannot_read_exactly_are_refused_in_one_line(marian, tmp_path):
    folder, tokenizer = marian
    copy = folder_copy(folder, tmp_path)
    (copy / "target.spm").unlink()
    assert "a tokenizer without spm files is not supported (no target.spm" in refusal(copy)
    shutil.rmtree(copy)

    for token in ("<pad>", "<unk>", "</s>"):
        copy = folder_copy(folder, tmp_path, **{token: None})
        assert f"vocab.json: no {token} piece" in refusal(copy)
        shutil.rmtree(copy)

    piece = next(p for p in tokenizer.encoder if p.startswith("▁") and len(p) > 3)
    pieces = [p for p in sorted(tokenizer.encoder, key=tokenizer.encoder.get) if p != piece]
    copy = folder_copy(folder, tmp_path, **{p: i for i, p in enumerate(pieces)}, **{piece: None})
    assert f"source.spm: 1 piece(s) missing from vocab.json (e.g. {piece!r})" in refusal(copy)
    shutil.rmtree(copy)

    copy = folder_copy(folder, tmp_path, **{"<s>": len(tokenizer.encoder)})
    assert "vocab.json: piece <s>" in refusal(copy)
    shutil.rmtree(copy)

    copy = folder_copy(folder, tmp_path, **{"<pad>": 0})
    assert "vocab.json: piece" in refusal(copy) and "each once" in refusal(copy)
    shutil.rmtree(copy)

    copy = folder_copy(folder, tmp_path)
    (copy / "vocab.json").write_text("{not json", encoding="utf-8")
    assert "vocab.json: not readable as JSON" in refusal(copy)
    (copy / "vocab.json").unlink()
    assert "vocab.json: missing" in refusal(copy)
    shutil.rmtree(copy)

    copy = folder_copy(folder, tmp_path)
    (copy / "source.spm").write_bytes(b"\x00not a model\xff")
    assert "source.spm: not a SentencePiece model" in refusal(copy)
    shutil.rmtree(copy)

    copy = folder_copy(folder, tmp_path)
    (copy / "target_vocab.json").write_text("{}", encoding="utf-8")
    assert "separate source and target vocabularies" in refusal(copy)
    shutil.rmtree(copy)

    copy = folder_copy(folder, tmp_path)
    (copy / "config.json").write_text(json.dumps({"pad_token_id": None}), encoding="utf-8")
    assert "config.json: pad_token_id is None" in refusal(copy)
    (copy / "config.json").write_text(json.dumps({"eos_token_id": 5}), encoding="utf-8")
    assert "config.json: eos_token_id is 5, but vocab.json has </s> at 0" in refusal(copy)
    shutil.rmtree(copy)


def test_a_sentencepiece_bpe_model_is_refused(tmp_path):
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(demo_lines("en")), model_type="bpe",
                                             model_prefix=str(tmp_path / "bpe"), vocab_size=200, num_threads=1,
                                             minloglevel=2)
    folder = tmp_path / "folder"
    folder.mkdir()
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(tmp_path / "bpe.model", folder / name)
    vocab = marian_vocab(folder / "source.spm")
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    assert "source.spm: a SentencePiece bpe model is not supported" in refusal(folder)


def test_without_sentencepiece_reading_a_folder_says_what_to_install(marian, monkeypatch):
    folder, _ = marian
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    assert "pip install 'transformer-mt[marian]'" in refusal(folder)
