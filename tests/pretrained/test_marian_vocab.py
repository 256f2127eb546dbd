import pytest

from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_mt.pretrained.marian_vocab import MarianVocab


def test_opus_mt_ids_become_tmts_with_bos_taking_the_decoder_starts_row():
    # OPUS-MT: </s> 0, <unk> 1, pieces 2..5, <pad> 6, which is also the decoder start.
    vocab = MarianVocab.of(7, pad=6, unk=1, eos=0, decoder_start=6)
    assert vocab.rows == (6, 1, 6, 0, 2, 3, 4, 5)
    assert len(vocab) == 8
    ids = vocab.tmt_ids()
    assert ids == [EOS_ID, UNK_ID, 4, 5, 6, 7, PAD_ID]
    assert all(vocab.rows[t] == m for m, t in enumerate(ids))  # each piece's id takes its own row
    assert BOS_ID not in ids


def test_special_ids_that_collide_or_fall_outside_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        MarianVocab.of(7, pad=6, unk=6, eos=0, decoder_start=6)
    with pytest.raises(ValueError, match="do not fit"):
        MarianVocab.of(7, pad=7, unk=1, eos=0, decoder_start=7)
