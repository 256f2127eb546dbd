import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_PAIRS
from transformer_mt.config.schema import TokenizerConfig
from transformer_mt.core.errors import DataError
from transformer_mt.data.token_cache import MIN_ROWS_PER_PROCESS, _encode_rows, processes_for, tokenize_split
from transformer_mt.data.tokenization import train_tokenizers


def dataset_of(pairs):
    import datasets

    return datasets.Dataset.from_dict({"src": [s for s, _ in pairs], "tgt": [t for _, t in pairs]})


def digest_of(pairs) -> str:
    return str(hash(tuple(pairs)))  # any string that changes with the text (Corpus.digests in training)


def tokenizers(vocab_size: int = 120):
    return train_tokenizers(TokenizerConfig(vocab_size=vocab_size, min_frequency=1),
                            [s for s, _ in TINY_PAIRS], [t for _, t in TINY_PAIRS])


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def file_stamps(entry: Path) -> dict[str, tuple[int, int]]:
    """Each file of a cache entry with its inode and modification time: a rewrite changes them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in entry.iterdir()}


def test_a_cache_hit_gives_the_same_ids_as_encoding(tmp_path: Path):
    split, digest, pair = dataset_of(TINY_PAIRS), digest_of(TINY_PAIRS), tokenizers()
    first = tokenize_split(split, digest, pair, 64, tmp_path, "train", drop_long=True)
    (entry,) = entries(tmp_path)
    written = file_stamps(tmp_path / entry)
    again = tokenize_split(split, digest, pair, 64, tmp_path, "train", drop_long=True)
    assert entries(tmp_path) == [entry] and file_stamps(tmp_path / entry) == written  # reused, not rewritten
    expected_src = pair.encode_src([s for s, _ in TINY_PAIRS])
    expected_tgt = pair.encode_tgt([t for _, t in TINY_PAIRS])
    for cached in (first, again):
        src, tgt = cached.ids(range(len(TINY_PAIRS)))
        assert (src, tgt) == (expected_src, expected_tgt)
        assert cached.lengths_of([0])[0][0] == len(expected_src[0]) + 1


def test_changing_the_tokenizer_the_data_or_max_len_invalidates_the_cache(tmp_path: Path):
    split, digest = dataset_of(TINY_PAIRS), digest_of(TINY_PAIRS)
    tokenize_split(split, digest, tokenizers(120), 64, tmp_path, "train", drop_long=True)
    (original,) = entries(tmp_path)
    for args in [(split, digest, tokenizers(80), 64),
                 (dataset_of(TINY_PAIRS[1:]), digest_of(TINY_PAIRS[1:]), tokenizers(120), 64),
                 (split, digest, tokenizers(120), 8)]:
        tokenize_split(*args, tmp_path, "train", drop_long=True)
        (entry,) = entries(tmp_path)  # the old entry of the split is removed
        assert entry != original
        original = entry


def test_training_drops_over_long_pairs_and_evaluation_truncates_them(tmp_path: Path):
    split, digest, pair = dataset_of(TINY_PAIRS), digest_of(TINY_PAIRS), tokenizers()
    lengths = [max(len(s), len(t)) for s, t in zip(pair.encode_src([s for s, _ in TINY_PAIRS]),
                                                   pair.encode_tgt([t for _, t in TINY_PAIRS]))]
    max_len = sorted(lengths)[len(lengths) // 2] + 1
    train = tokenize_split(split, digest, pair, max_len, tmp_path, "train", drop_long=True)
    assert len(train) == sum(n <= max_len - 1 for n in lengths)
    valid = tokenize_split(split, digest, pair, max_len, tmp_path, "valid", drop_long=False, keep_text=True)
    assert len(valid) == len(TINY_PAIRS) and max(valid.lengths()) <= max_len
    assert valid.tgt_text[3] == TINY_PAIRS[3][1]
    with pytest.raises(DataError, match="no training pair fits"):
        tokenize_split(split, digest, pair, 2, tmp_path, "train", drop_long=True)


@pytest.mark.parametrize("damage", ["entry.json lost", "arrow file lost", "arrow file cut short", "rows missing"])
def test_a_damaged_cache_entry_is_rebuilt(damage: str, tmp_path: Path):
    split, digest, pair = dataset_of(TINY_PAIRS), digest_of(TINY_PAIRS), tokenizers()
    first = tokenize_split(split, digest, pair, 64, tmp_path, "train", drop_long=True)
    expected = first.ids(range(len(first)))
    del first
    (entry,) = entries(tmp_path)
    victim = "entry.json" if damage == "entry.json lost" else next((tmp_path / entry).glob("*.arrow")).name
    if damage == "rows missing":  # as a stream cut at a record-batch boundary reads: without error, shorter
        victim = "entry.json"
        entry_file = tmp_path / entry / victim
        recorded = json.loads(entry_file.read_text())
        entry_file.write_text(json.dumps({**recorded, "rows": recorded["rows"] + 5}))
    elif damage == "arrow file cut short":
        data = (tmp_path / entry / victim).read_bytes()
        (tmp_path / entry / victim).write_bytes(data[: len(data) // 2])
    else:
        (tmp_path / entry / victim).unlink()
    again = tokenize_split(split, digest, pair, 64, tmp_path, "train", drop_long=True)
    assert again.ids(range(len(again))) == expected and entries(tmp_path) == [entry]
    rebuilt = file_stamps(tmp_path / entry)
    tokenize_split(split, digest, pair, 64, tmp_path, "train", drop_long=True)
    assert file_stamps(tmp_path / entry) == rebuilt  # the rebuilt entry is whole: the next start reuses it
    assert (tmp_path / entry / victim).is_file()
    assert json.loads((tmp_path / entry / "entry.json").read_text())["rows"] == len(expected[0])


def test_padded_batches_keep_to_the_token_budget_and_the_models_positions(tmp_path: Path):
    """With pad_to_multiple (CUDA, compile), the sampler cuts by padded lengths, so a batch's
    padded slots stay within train.batch_tokens; and no batch is wider than model.max_len."""
    from transformer_mt.config.schema import ModelConfig
    from transformer_mt.data.batching import TokenBatchSampler
    from transformer_mt.data.tokenization import PAD_ID
    from transformer_mt.model.transformer import Transformer

    pairs = TINY_PAIRS * 4
    pair = tokenizers()
    max_len = max(max(map(len, pair.encode_src([s for s, _ in pairs]))), 6) + 1  # no multiple of 8 below
    max_len += 1 if max_len % 8 == 0 else 0
    train = tokenize_split(dataset_of(pairs), digest_of(pairs), pair, max_len, tmp_path, "train", drop_long=True)
    budget = 3 * max_len
    sampler = TokenBatchSampler(train.lengths(), budget, seed=0, pad_to_multiple=8, max_length=max_len)
    model = Transformer(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, max_len=max_len),
                        pair.src.get_vocab_size(), pair.tgt.get_vocab_size(), PAD_ID)
    for indices in sampler.epoch_batches(0):
        batch = train.batch(indices, 8)
        assert batch.src_ids.shape[1] <= max_len and batch.tgt_in_ids.shape[1] <= max_len
        if len(indices) > 1:
            assert max(batch.padded_src_slots, batch.padded_tgt_slots) <= budget
        model(batch.src_ids, batch.tgt_in_ids, pack=False)  # positions within the model's table


def test_several_processes_cache_the_same_ids_in_the_same_order(tmp_path: Path):
    pairs = TINY_PAIRS * 3
    split, pair = dataset_of(pairs), tokenizers()
    one = tokenize_split(split, "text", pair, 64, tmp_path / "one", "train", drop_long=True)
    three = tokenize_split(split, "text", pair, 64, tmp_path / "three", "train", drop_long=True, num_proc=3)
    (entry,) = entries(tmp_path / "three")
    assert len(list((tmp_path / "three" / entry).glob("*.arrow"))) == 3  # one file per process
    assert three.ids(range(len(pairs))) == one.ids(range(len(pairs)))
    reloaded = tokenize_split(split, "text", pair, 64, tmp_path / "three", "train", drop_long=True, num_proc=3)
    assert reloaded.ids(range(len(pairs))) == one.ids(range(len(pairs)))
    assert (reloaded.src_len == one.src_len).all() and (reloaded.tgt_len == one.tgt_len).all()


def test_small_splits_take_one_process():
    assert processes_for(MIN_ROWS_PER_PROCESS - 1, 8) == 1
    assert processes_for(3 * MIN_ROWS_PER_PROCESS, 8) == 3
    assert processes_for(100 * MIN_ROWS_PER_PROCESS, 4) == 4
    assert processes_for(100 * MIN_ROWS_PER_PROCESS, None) == min(os.cpu_count() or 1, 8)  # unset: the cores


def test_batches_from_the_in_memory_ids_equal_those_from_the_arrow_rows(tmp_path: Path, monkeypatch):
    import numpy as np

    from transformer_mt.data import token_cache

    split, digest, pair = dataset_of(TINY_PAIRS), digest_of(TINY_PAIRS), tokenizers()
    in_memory = tokenize_split(split, digest, pair, 64, tmp_path / "a", "train", drop_long=True)
    monkeypatch.setattr(token_cache, "IN_MEMORY_MAX_IDS", 0)  # too big to hold: the Arrow path
    mapped = tokenize_split(split, digest, pair, 64, tmp_path / "b", "train", drop_long=True)
    assert in_memory._flat is not None and mapped._flat is None
    rng = np.random.default_rng(0)
    for _ in range(5):
        indices = rng.permutation(len(in_memory))[:7]  # any rows, in any order
        a, b = in_memory.batch(indices, pad_to_multiple=8), mapped.batch(indices, pad_to_multiple=8)
        for name in ("src_ids", "tgt_in_ids", "tgt_out_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.n_src_tokens, a.n_tgt_tokens) == (b.n_src_tokens, b.n_tgt_tokens)


def test_a_dropout_variant_holds_the_plain_entrys_pairs_within_max_len(tmp_path: Path):
    # At max_len = the median plain length + 1, no pair is dropped or cut that plain BPE keeps whole.
    pairs = TINY_PAIRS * 5
    split, digest, pair = dataset_of(pairs), digest_of(pairs), tokenizers()
    lengths = [max(len(s), len(t)) for s, t in zip(pair.encode_src([s for s, _ in pairs]),
                                                   pair.encode_tgt([t for _, t in pairs]))]
    max_len = sorted(lengths)[len(lengths) // 2] + 1
    plain = tokenize_split(split, digest, pair, max_len, tmp_path, "train", drop_long=True)
    variant = tokenize_split(split, digest, pair, max_len, tmp_path, "train.v1", drop_long=True, bpe_dropout=0.5,
                             variant=1)
    rows = list(range(len(plain)))
    (plain_src, plain_tgt), (src, tgt) = plain.ids(rows), variant.ids(rows)
    assert len(variant) == len(plain) and max(variant.lengths()) <= max_len
    assert pair.decode_tgt(tgt) == pair.decode_tgt(plain_tgt)
    assert pair.src.decode_batch(src) == pair.src.decode_batch(plain_src)
    assert tgt != plain_tgt
    assert sorted(entries(tmp_path))[0].startswith("train-")  # the plain entry stays beside its variant
    again = tokenize_split(split, digest, pair, max_len, tmp_path, "train.v2", drop_long=True, bpe_dropout=0.5,
                           variant=2)
    assert again.ids(rows)[1] != tgt and len(entries(tmp_path)) == 3  # another variant: another entry


def test_a_side_that_dropout_splits_past_max_len_keeps_its_plain_ids():
    pair = tokenizers()
    source, target = TINY_PAIRS[5]  # "The city is beautiful." / "La città è bella."
    rows = {"src": [source], "tgt": [target]}
    plain = _encode_rows(rows, tokenizers=pair, keep=64, drop_long=True)
    keep = len(plain["src_ids"][0])
    assert len(source) > keep >= len(plain["tgt_ids"][0])
    # Dropping 99% of the merges leaves nearly single characters: the source past `keep` tokens.
    dropped = _encode_rows(rows, tokenizers=pair, keep=keep, drop_long=True, dropping=pair.with_bpe_dropout(0.99))
    assert dropped["src_ids"] == plain["src_ids"]  # the plain ids, not a cut segmentation
    longer = _encode_rows(rows, tokenizers=pair, keep=64, drop_long=True, dropping=pair.with_bpe_dropout(0.99))
    assert len(longer["src_ids"][0]) > keep
