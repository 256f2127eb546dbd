import itertools

import numpy as np
import pytest
import torch

from transformer_mt.core.errors import DataError
from transformer_mt.data.batching import (
    PackShape,
    TokenBatchSampler,
    make_batch,
    make_batch_from_flat,
    pack_shape,
    pad_rows,
    padded_length,
    sorted_batches,
    static_rows,
    token_budget_batches,
)


def as_lists(batches) -> list[list[int]]:
    return [[int(i) for i in b] for b in batches]


def greedy_batches(order, lengths, batch_tokens):
    """The plain cut: add examples one at a time until the next would break the budget."""
    batches, current, longest = [], [], 0
    for idx in order:
        new_longest = max(longest, lengths[idx])
        if current and (len(current) + 1) * new_longest > batch_tokens:
            batches.append(current)
            current, new_longest = [], lengths[idx]
        current.append(idx)
        longest = new_longest
    return batches + [current] if current else batches


def test_make_batch_appends_eos_and_shifts_the_target():
    batch = make_batch([[5, 6], [7]], [[8], [9, 10, 11]], pad_id=0, bos_id=2, eos_id=3)
    assert batch.src_ids.tolist() == [[5, 6, 3], [7, 3, 0]]
    assert batch.tgt_in_ids.tolist() == [[2, 8, 0, 0], [2, 9, 10, 11]]
    assert batch.tgt_out_ids.tolist() == [[8, 3, 0, 0], [9, 10, 11, 3]]
    assert (batch.n_src_tokens, batch.n_tgt_tokens) == (5, 6)  # 3 + 2 source; 2 + 4 target


def test_every_epoch_covers_each_example_once_within_the_token_budget():
    lengths = torch.randint(1, 40, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    sampler = TokenBatchSampler(lengths, batch_tokens=200, seed=7)
    for epoch in range(2):
        batches = sampler.epoch_batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(500))
        assert all(len(b) * max(lengths[i] for i in b) <= 200 for b in batches)
    assert as_lists(sampler.epoch_batches(0)) != as_lists(sampler.epoch_batches(1))  # reshuffled each epoch


def test_the_vectorised_cut_equals_adding_examples_one_by_one():
    gen = torch.Generator().manual_seed(3)
    for budget in (1, 7, 64, 200, 5000):
        lengths = torch.randint(1, 90, (700,), generator=gen).numpy()
        lengths[:5] = [300, 1, 1, 250, 90]  # some longer than the smaller budgets: a batch of their own
        order = np.argsort(lengths, kind="stable")
        expected = greedy_batches(order.tolist(), lengths.tolist(), budget)
        assert as_lists(token_budget_batches(order, lengths, budget)) == expected


def test_sampler_resumes_mid_epoch_with_the_same_batches():
    lengths = [3, 9, 4, 4, 8, 1, 7, 2, 6, 5] * 5
    first = TokenBatchSampler(lengths, batch_tokens=30, seed=1)
    stream = iter(first)
    n_per_epoch = len(first.epoch_batches(0))
    for _ in range(n_per_epoch + 2):  # into the second epoch
        next(stream)
    state = first.state_dict()
    assert (state["epoch"], state["position"], state["earlier_parts"]) == (1, 2, [])
    expected = [next(stream) for _ in range(n_per_epoch)]

    resumed = TokenBatchSampler(lengths, batch_tokens=30, seed=1)
    resumed.load_state_dict(state)
    assert as_lists(b for b, _ in zip(iter(resumed), range(n_per_epoch))) == as_lists(expected)


@pytest.mark.parametrize("change", [{"batch_tokens": 15}, {"batch_tokens": 60}, {"world_size": 2},
                                    {"pad_to_multiple": 4}], ids=["smaller", "larger", "ranks", "padding"])
def test_a_resume_that_cuts_batches_differently_still_covers_each_example_once_per_epoch(change):
    """E.g. a lower train.batch_tokens after running out of memory, then --resume mid-epoch."""
    lengths = torch.randint(1, 12, (300,), generator=torch.Generator().manual_seed(2)).numpy()
    settings = {"batch_tokens": 30, "world_size": 1, "pad_to_multiple": 1}

    def sampler(**changed) -> TokenBatchSampler:
        cut = {**settings, **changed}
        return TokenBatchSampler(lengths, cut["batch_tokens"], seed=5, world_size=cut["world_size"],
                                 pad_to_multiple=cut["pad_to_multiple"], max_length=12)

    first = sampler()
    stream = iter(first)
    n_first = len(first.epoch_batches(0))
    before = [next(stream) for _ in range(n_first + 7)]  # one epoch, and 7 batches into the next
    resumed = sampler(**change)
    resumed.load_state_dict(first.state_dict())
    stream = iter(resumed)
    rest = [next(stream) for _ in range(3)]
    again = sampler(**change)  # a second resume in the same epoch: it continues the same way
    again.load_state_dict(resumed.state_dict())
    n_left = len(again.epoch_batches(1)) - 3
    rest += list(itertools.islice(iter(again), n_left))
    assert as_lists(rest[3:]) == as_lists(itertools.islice(stream, n_left))

    second_epoch = np.concatenate(before[n_first:] + rest).tolist()
    if "world_size" in change:  # with 2 ranks, an odd batch count repeats a batch to fill the last step
        assert set(second_epoch) == set(range(300)) and len(second_epoch) - 300 <= len(rest[-1]) * 2
    else:
        assert sorted(second_epoch) == list(range(300))
    budget = resumed.cut["batch_tokens"]
    assert all(len(b) * max(padded_length(lengths[b], resumed.cut["pad_to_multiple"], 12)) <= budget for b in rest)
    assert resumed.state_dict()["earlier_parts"] != []
    next(stream)  # on into the third epoch: cut the new way from the start
    assert (resumed.epoch, resumed.position, resumed.earlier_parts) == (2, 1, [])


def test_evaluation_batches_are_sorted_and_complete():
    lengths = [5, 1, 9, 3]
    batches = sorted_batches(lengths, batch_tokens=10)
    assert [i for b in batches for i in b] == [1, 3, 0, 2]


def test_batches_from_concatenated_ids_equal_rows_padded_by_hand():
    gen = torch.Generator().manual_seed(0)
    src = [torch.randint(4, 50, (int(n),), generator=gen).tolist() for n in torch.randint(1, 12, (9,), generator=gen)]
    tgt = [torch.randint(4, 50, (int(n),), generator=gen).tolist() for n in torch.randint(1, 12, (9,), generator=gen)]
    flat = lambda seqs: np.array([i for s in seqs for i in s], dtype=np.int32)  # noqa: E731
    lengths = lambda seqs: np.array([len(s) for s in seqs])  # noqa: E731

    def padded(rows: list[list[int]], width: int) -> torch.Tensor:
        return torch.tensor([row + [0] * (width - len(row)) for row in rows])

    for multiple, max_length in ((1, None), (8, None), (8, 13)):
        batch = make_batch_from_flat(flat(src), lengths(src), flat(tgt), lengths(tgt), pad_id=0, bos_id=2, eos_id=3,
                                     pad_to_multiple=multiple, max_length=max_length)
        width = lambda seqs: int(padded_length(max(map(len, seqs)) + 1, multiple, max_length))  # noqa: E731
        assert torch.equal(batch.src_ids, padded([s + [3] for s in src], width(src)))
        assert torch.equal(batch.tgt_in_ids, padded([[2] + t for t in tgt], width(tgt)))
        assert torch.equal(batch.tgt_out_ids, padded([t + [3] for t in tgt], width(tgt)))
        assert (batch.n_src_tokens, batch.n_tgt_tokens) == (sum(map(len, src)) + 9, sum(map(len, tgt)) + 9)


def test_padding_to_a_multiple_rounds_lengths_up_and_adds_only_pad():
    batch = make_batch([[5, 6], [7]], [[8], [9, 10, 11]], pad_id=0, bos_id=2, eos_id=3, pad_to_multiple=8)
    assert batch.src_ids.shape == (2, 8) and batch.tgt_in_ids.shape == (2, 8)
    assert batch.src_ids[:, 3:].eq(0).all() and batch.tgt_out_ids[:, 4:].eq(0).all()
    assert (batch.n_src_tokens, batch.n_tgt_tokens) == (5, 6)


def test_padding_to_a_multiple_stops_at_the_models_positions():
    # model.max_len = 13 is no multiple of 8: a 12-token sequence (+ EOS) pads to 13, not 16.
    batch = make_batch([[5] * 12], [[6] * 3], pad_id=0, bos_id=2, eos_id=3, pad_to_multiple=8, max_length=13)
    assert batch.src_ids.shape == (1, 13) and batch.tgt_in_ids.shape == (1, 8)
    assert padded_length(np.array([1, 8, 9, 13]), 8, 13).tolist() == [8, 8, 13, 13]
    assert padded_length(20, 8, 13) == 20  # longer than the limit: never cut, only not padded


def test_breaking_length_ties_by_target_length_keeps_every_example_and_pads_targets_less():
    gen = torch.Generator().manual_seed(0)
    tgt = torch.randint(1, 30, (400,), generator=gen).numpy()
    src = torch.randint(1, 30, (400,), generator=gen).numpy()
    lengths = np.maximum(src, tgt) + 1
    plain = TokenBatchSampler(lengths, batch_tokens=120, seed=3)
    tied = TokenBatchSampler(lengths, batch_tokens=120, seed=3, tie_break=tgt)
    target_slots = lambda batches: sum(len(b) * (tgt[b].max() + 1) for b in batches)  # noqa: E731
    for epoch in range(2):
        batches = tied.epoch_batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(400))
        assert all(len(b) * lengths[b].max() <= 120 for b in batches)
        assert target_slots(batches) < target_slots(plain.epoch_batches(epoch))


def test_filler_rows_up_to_a_static_shape_change_neither_the_loss_nor_the_gradients():
    from tests.helpers import random_model
    from transformer_mt.train.loss import StepLoss

    model = random_model(0).train()  # dropout 0.0 in random_model: the two passes see the same network
    gen = torch.Generator().manual_seed(3)
    src = [torch.randint(4, 40, (n,), generator=gen).tolist() for n in (5, 3, 7)]  # V = 40
    tgt = [torch.randint(4, 40, (n,), generator=gen).tolist() for n in (4, 6, 2)]
    batch = make_batch(src, tgt, pad_id=0, bos_id=2, eos_id=3, pad_to_multiple=8)
    rows = static_rows(batch, batch_tokens=64)
    assert rows == 8  # 64 tokens // the longest padded side, 8
    grown = pad_rows(batch, rows, pad_id=0, bos_id=2, eos_id=3)
    assert grown.src_ids.shape == (8, 8) and grown.tgt_out_ids.shape == (8, 8)
    assert (grown.n_src_tokens, grown.n_tgt_tokens) == (batch.n_src_tokens, batch.n_tgt_tokens)

    def loss_and_grads(b):
        model.zero_grad(set_to_none=True)
        loss = StepLoss(model)(b.src_ids, b.tgt_in_ids, b.tgt_out_ids, 0.1, pack=False)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    (loss, grads), (grown_loss, grown_grads) = loss_and_grads(batch), loss_and_grads(grown)
    assert torch.isfinite(grown_loss) and grown_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grown_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert pad_rows(grown, 4, pad_id=0, bos_id=2, eos_id=3) is grown  # never shrinks


def test_epoch_rows_choose_each_epochs_examples_and_their_lengths_cut_it():
    # 40 rows: 20 pairs in two segmentations (rows 20..39 twice as long as rows 0..19). Even epochs
    # draw rows 0..19, odd ones rows 20..39 with pair 0 twice: each epoch must hold exactly those
    # rows, cut within the budget by their own lengths.
    lengths = np.concatenate([np.full(20, 3), np.full(20, 6)])

    def rows(epoch: int) -> np.ndarray:
        return np.arange(20) if epoch % 2 == 0 else np.concatenate([np.arange(20, 40), [20]])

    sampler = TokenBatchSampler(lengths, batch_tokens=12, seed=4, epoch_rows=rows)
    for epoch in range(3):
        batches = sampler.epoch_batches(epoch)
        assert sorted(np.concatenate(batches).tolist()) == sorted(rows(epoch).tolist())
        assert all(len(b) * lengths[b].max() <= 12 for b in batches)
    assert len(sampler.epoch_batches(0)) == 5 and len(sampler.epoch_batches(1)) == 11  # 4 of 3 tokens, 2 of 6


@pytest.mark.parametrize("change", [{}, {"batch_tokens": 15}], ids=["same cut", "smaller budget"])
def test_a_sampler_with_epoch_rows_resumes_mid_epoch_covering_each_example_once(change):
    lengths = torch.randint(1, 12, (200,), generator=torch.Generator().manual_seed(6)).numpy()
    rows = np.concatenate([np.arange(100), np.arange(100), np.arange(150, 200)])  # repeats: a weighted mixture

    def sampler(batch_tokens: int = 30) -> TokenBatchSampler:
        return TokenBatchSampler(lengths, batch_tokens, seed=2, epoch_rows=lambda epoch: rows)

    first = sampler()
    stream = iter(first)
    n_first = len(first.epoch_batches(0))
    before = [next(stream) for _ in range(n_first + 5)]  # an epoch, and 5 batches into the next
    state = first.state_dict()
    expected = [next(stream) for _ in range(3)]
    resumed = sampler(**change)
    resumed.load_state_dict(state)
    rest, stream = [], iter(resumed)
    while True:
        batch = next(stream)
        if resumed.epoch != 1:
            break
        rest.append(batch)
    if not change:
        assert as_lists(rest[:3]) == as_lists(expected)
    second_epoch = np.concatenate(before[n_first:] + rest)
    assert sorted(second_epoch.tolist()) == sorted(rows.tolist())  # each example once, repeats included


# --- packs ----------------------------------------------------------------------------------------

def pack_sampler(src: np.ndarray, tgt: np.ndarray, shape: PackShape, **kwargs) -> TokenBatchSampler:
    return TokenBatchSampler(np.maximum(src, tgt), shape.tgt_tokens, seed=3, pack=shape, pair_lengths=(src, tgt),
                             **kwargs)


def pair_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, 12, (n,), generator=gen).numpy(), torch.randint(2, 14, (n,), generator=gen).numpy()


def test_an_epoch_of_packs_holds_each_example_once_and_no_pack_overflows():
    src, tgt = pair_lengths(300, 1)
    shape = pack_shape(src, tgt, tgt_tokens=256)
    assert shape.src_tokens % 8 == 0 and shape.src_tokens >= 256 * src.sum() / tgt.sum()  # sized by the ratio
    packs = pack_sampler(src, tgt, shape).epoch_batches(0)
    assert sorted(np.concatenate(packs).tolist()) == list(range(300))
    assert all(src[p].sum() <= shape.src_tokens and tgt[p].sum() <= shape.tgt_tokens for p in packs)
    # Closed only when the next example does not fit: over 90 % of the target tokens are real.
    assert tgt.sum() / (len(packs) * shape.tgt_tokens) > 0.9
    # The static offsets hold any pack's sentences (the shortest ones that fill a side: a bound from
    # the data, far below one per token) and its filler pieces, none longer than the longest pair.
    assert shape.longest == max(src.max(), tgt.max())
    assert max(len(p) for p in packs) <= shape.max_sentences < shape.tgt_tokens // 2
    assert np.sort(tgt)[:shape.max_sentences].sum() <= 256 < np.sort(tgt)[:shape.max_sentences + 1].sum() \
        or np.sort(src)[:shape.max_sentences + 1].sum() > shape.src_tokens


def test_packs_resume_mid_epoch_as_the_same_packs():
    src, tgt = pair_lengths(200, 2)
    shape = pack_shape(src, tgt, tgt_tokens=48)
    first = pack_sampler(src, tgt, shape)
    stream = iter(first)
    n_per_epoch = len(first.epoch_batches(0))
    for _ in range(n_per_epoch + 3):  # into the second epoch
        next(stream)
    state = first.state_dict()
    assert state["cut"] == {"pack_tokens": [shape.src_tokens, 48], "world_size": 1}
    expected = [next(stream) for _ in range(n_per_epoch)]
    resumed = pack_sampler(src, tgt, shape)
    resumed.load_state_dict(state)
    assert as_lists(itertools.islice(iter(resumed), n_per_epoch)) == as_lists(expected)
    assert as_lists(first.epoch_batches(1)) != as_lists(first.epoch_batches(2))  # each epoch its own order


def test_switching_from_batches_to_packs_mid_epoch_trains_on_each_example_once():
    src, tgt = pair_lengths(200, 4)
    padded = TokenBatchSampler(np.maximum(src, tgt), 40, seed=3, pair_lengths=(src, tgt))
    stream = iter(padded)
    head = [next(stream) for _ in range(5)]
    packed = pack_sampler(src, tgt, pack_shape(src, tgt, tgt_tokens=40))
    packed.load_state_dict(padded.state_dict())
    rest = packed.epoch_batches(0)
    assert sorted(np.concatenate(head + rest).tolist()) == list(range(200))


def test_a_pair_longer_than_the_pack_is_refused_naming_its_length_and_the_key():
    src, tgt = np.array([3, 5, 50, 4]), np.array([4, 6, 5, 30])
    with pytest.raises(DataError, match=r"^train.batch_tokens: training pair 3 has 50 source tokens, more than a "
                                        r"pack's 48 .*raise train.batch_tokens to at least 37$"):
        pack_shape(src, tgt, tgt_tokens=32)
    with pytest.raises(DataError, match=r"^train.batch_tokens: training pair 4 has 30 target tokens, more than "
                                        r"a pack's 24 .*at least 30$"):
        pack_shape(np.array([3, 5, 4, 4]), tgt, tgt_tokens=24)
