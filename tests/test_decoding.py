import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.beam_reference import reference_beam_search
from transformer_mt.config import ModelConfig
from transformer_mt.decoding import beam_search, greedy_decode
from transformer_mt.model import Transformer

PAD, BOS, EOS, V = 0, 2, 3, 40


def random_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32, dropout=0.0, max_len=48)
    model = Transformer(cfg, V, V, PAD).eval()
    with torch.no_grad():  # make EOS likely enough that sentences end at different steps
        model.output_proj.weight.mul_(4.0)
    return model


def random_sources(seed: int, batch: int = 6, max_len: int = 9, min_len: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (batch,), generator=gen).tolist()
    rows = [torch.randint(4, V, (n,), generator=gen).tolist() + [EOS] for n in lengths]
    src = torch.full((batch, max(map(len, rows))), PAD)
    for i, row in enumerate(rows):
        src[i, : len(row)] = torch.tensor(row)
    return src  # (B, S) with padding


def teacher_forced_log_prob(model: Transformer, src: torch.Tensor, ids: list[int], ended: bool) -> float:
    tgt = torch.tensor([[BOS] + ids])
    logits = model(src[None], tgt)[0].clone()  # (T, V)
    logits[:, PAD] = logits[:, BOS] = torch.finfo(logits.dtype).min
    log_probs = torch.log_softmax(logits, dim=-1)
    targets = ids + [EOS] if ended else ids
    return sum(log_probs[t, token].item() for t, token in enumerate(targets))


def test_decoding_logits_are_fp32_under_bf16_autocast():
    # Ranking candidates on bf16 logits (8 mantissa bits) would tie or swap close ones.
    model, src = random_model(0), random_sources(0)
    src_mask = src != PAD
    tgt = torch.full((src.shape[0], 1), BOS)
    with torch.inference_mode():
        plain = model.decode(tgt, model.encode(src, src_mask), src_mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model.decode(tgt, model.encode(src, src_mask), src_mask)
    assert mixed.dtype == torch.float32
    assert torch.allclose(mixed, plain, atol=0.5)  # bf16 layers, fp32 projection: close, not equal
    # Computed in fp32, not computed in bf16 and cast: most values are not bf16 numbers.
    assert (mixed != mixed.bfloat16().float()).float().mean() > 0.5


@pytest.mark.parametrize("seed", range(5))
def test_cached_greedy_equals_uncached_greedy(seed):
    model, src = random_model(seed), random_sources(seed)
    args = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    cached = greedy_decode(model, src, use_cache=True, **args)
    assert cached == greedy_decode(model, src, use_cache=False, **args)
    assert len({len(ids) for ids in cached}) > 1  # sentences really stopped at different steps


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_of_one_equals_greedy(seed, alpha):
    model, src = random_model(seed), random_sources(seed)
    greedy = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=1, max_len_a=1.5, max_len_b=4, alpha=alpha)
    assert [hyps[0].ids for hyps in beam] == greedy


@pytest.mark.parametrize("seed", range(3))
def test_beam_search_in_a_batch_equals_one_sentence_at_a_time(seed):
    model, src = random_model(seed), random_sources(seed)
    args = dict(bos_id=BOS, eos_id=EOS, beam_size=4, max_len_a=1.5, max_len_b=4, n_best=3)
    batched = beam_search(model, src, **args)
    for i in range(src.shape[0]):
        row = src[i][src[i] != PAD][None]  # the same sentence without padding
        alone = beam_search(model, row, **args)[0]
        assert [h.ids for h in batched[i]] == [h.ids for h in alone]


@pytest.mark.parametrize("seed", range(3))
def test_beam_hypotheses_carry_their_true_log_probability_best_first(seed):
    model, src = random_model(seed), random_sources(seed, batch=3)
    results = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=4, max_len_a=1.5, max_len_b=4,
                          alpha=0.6, n_best=4)
    limits = ((src != PAD).sum(1) * 1.5 + 4).long().tolist()
    for i, hyps in enumerate(results):
        assert len(hyps) == 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        real = src[i][src[i] != PAD]
        for h in hyps:
            ended = len(h.ids) < limits[i]  # cut at the cap means no EOS was scored
            assert h.log_prob == pytest.approx(teacher_forced_log_prob(model, real, h.ids, ended), abs=1e-4)


def assert_same_hypotheses(got, expected):
    """The same n-best lists, token for token, with the same log-probs and scores up to rounding
    (the reference drops finished sentences' rows, which changes the batch the products see)."""
    assert [[h.ids for h in hyps] for hyps in got] == [[h.ids for h in hyps] for hyps in expected]
    for hyps, reference in zip(got, expected):
        for h, e in zip(hyps, reference):
            assert h.log_prob == pytest.approx(e.log_prob, abs=1e-4)
            assert h.score == pytest.approx(e.score, abs=1e-4)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 7), beam=st.integers(1, 6), data=st.data(),
       alpha=st.sampled_from([0.0, 0.6, 1.0]), max_len_a=st.sampled_from([0.0, 0.5, 1.5]),
       max_len_b=st.integers(1, 8), eos_bias=st.floats(-2.0, 4.0))
def test_the_tensorised_beam_search_gives_the_reference_search_output(seed, batch, beam, data, alpha, max_len_a,
                                                                       max_len_b, eos_bias):
    model = random_model(seed % 1000)
    with torch.no_grad():  # how soon sentences end: from almost never to almost at once
        model.output_proj.weight[EOS] += eos_bias * model.output_proj.weight[EOS].sign()
    src = random_sources(seed, batch=batch, max_len=data.draw(st.sampled_from([3, 9, 30]), label="max source length"))
    settings_ = dict(bos_id=BOS, eos_id=EOS, beam_size=beam, max_len_a=max_len_a, max_len_b=max_len_b, alpha=alpha,
                     n_best=data.draw(st.integers(1, beam), label="n_best"))
    assert_same_hypotheses(beam_search(model, src, **settings_), reference_beam_search(model, src, **settings_))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_search_of_sentences_of_very_different_lengths_gives_the_reference_output(seed, alpha):
    model = random_model(seed)
    short, long = random_sources(seed, batch=3, max_len=4), random_sources(seed + 1, batch=3, max_len=40, min_len=30)
    src = torch.full((6, long.shape[1]), PAD)
    src[:3, :short.shape[1]], src[3:] = short, long
    settings_ = dict(bos_id=BOS, eos_id=EOS, beam_size=5, max_len_a=1.0, max_len_b=3, alpha=alpha, n_best=3)
    expected = reference_beam_search(model, src, **settings_)
    assert_same_hypotheses(beam_search(model, src, **settings_), expected)
    assert len({len(hyps[0].ids) for hyps in expected}) > 2


def test_wider_beams_find_at_least_as_likely_single_best_without_length_penalty():
    # Not a theorem for every input, but with K=8 vs greedy on random models it should hold on
    # average: compare the summed log-prob over a batch.
    model, src = random_model(11), random_sources(11, batch=8)
    args = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4, alpha=0.0)
    greedy = sum(h[0].log_prob for h in beam_search(model, src, beam_size=1, **args))
    wide = sum(h[0].log_prob for h in beam_search(model, src, beam_size=8, **args))
    assert wide >= greedy - 1e-6


def test_the_attention_of_a_translation_that_fills_max_len_keeps_every_piece(tmp_path, monkeypatch):
    from tests.test_export import make_run
    from transformer_mt import translator as translator_module

    make_run(tmp_path / "run", "pre", True)
    translator = translator_module.Translator.from_run(tmp_path / "run", device="cpu", engine="torch")
    max_len = translator.max_len
    piece_id = translator.tokenizers.encode_tgt(["ciao"])[0][0]
    capped = [piece_id] * max_len  # no EOS: the search stopped at the model's last position
    monkeypatch.setattr(translator.engine, "translate", lambda *args, **kwargs: [capped])

    attention = translator.attention("Thank you.")
    assert attention.translation == translator.tokenizers.decode_tgt([capped])[0]  # what `translate` prints
    assert attention.weights.shape[0] == len(attention.tgt_pieces) == max_len
    assert attention.tgt_pieces == translator.tokenizers.tgt_pieces(capped)  # no "</s>" row


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fixed_shape_greedy_steps_give_greedy_decodings_output(seed):
    from transformer_mt.graph_decoding import static_greedy_decode

    model, src = random_model(seed), random_sources(seed)
    settings = {"bos_id": BOS, "eos_id": EOS, "max_len_a": 1.5, "max_len_b": 5}
    expected = greedy_decode(model, src, **settings)
    got = static_greedy_decode(model, src, capture=False, **settings)  # the steps a CUDA graph replays
    assert got == expected
    assert len({len(ids) for ids in expected}) > 1  # sentences ended at different steps


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), beam=st.integers(1, 5), data=st.data(),
       alpha=st.sampled_from([0.0, 1.0]), max_len_b=st.integers(1, 8))
def test_fixed_shape_beam_steps_give_beam_searchs_output(seed, batch, beam, data, alpha, max_len_b):
    from transformer_mt.graph_decoding import static_beam_search

    model, src = random_model(seed % 1000), random_sources(seed, batch=batch, max_len=20)
    settings_ = dict(bos_id=BOS, eos_id=EOS, beam_size=beam, max_len_a=1.5, max_len_b=max_len_b, alpha=alpha,
                     n_best=data.draw(st.integers(1, beam), label="n_best"))
    expected = beam_search(model, src, **settings_)
    check_every = data.draw(st.sampled_from([1, 3, 8]), label="check_every")  # steps past the end change nothing
    assert_same_hypotheses(static_beam_search(model, src, capture=False, check_every=check_every, **settings_),
                           expected)


def test_beam_search_drops_done_sentences_and_the_fixed_shape_steps_keep_every_row():
    # The eager search drops a sentence's rows at the step it is done, as the reference does; the
    # fixed-shape steps (what a CUDA graph replays) keep all B·K rows, computing the done ones'
    # and ignoring them; all stop at the step where the last sentence is done.
    from transformer_mt.graph_decoding import static_beam_search

    model, src = random_model(3), random_sources(3)
    settings_ = dict(bos_id=BOS, eos_id=EOS, beam_size=4, max_len_a=1.5, max_len_b=4)

    def rows_per_step(search) -> list[int]:
        rows = []
        hook = model.output_proj.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
        try:
            search(model, src, **settings_)
        finally:
            hook.remove()
        return rows

    shrinking = rows_per_step(reference_beam_search)
    assert shrinking[-1] < shrinking[0]  # sentences did finish at different steps
    assert rows_per_step(beam_search) == shrinking
    fixed = rows_per_step(lambda *args, **kwargs: static_beam_search(*args, capture=False, check_every=1, **kwargs))
    assert fixed == [src.shape[0] * 4] * len(shrinking)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([float("-inf"), -3.0, -1.5, -1.0, 0.0, 2.0]), min_size=1, max_size=9),
                     min_size=1, max_size=4).filter(lambda rows: len({len(r) for r in rows}) == 1))
def test_stable_descending_order_sorts_as_python_sorted_does(rows):
    from transformer_mt.decoding import stable_descending_order

    order = stable_descending_order(torch.tensor(rows, dtype=torch.float64)).tolist()
    assert order == [sorted(range(len(row)), key=lambda i: row[i], reverse=True) for row in rows]


def test_batches_of_one_padded_shape_reuse_one_set_of_step_buffers_with_the_same_output():
    # What a CUDA graph replays for every batch of its bucket, run eagerly: batches of 5-8
    # sentences and 6-8 source tokens pad to one shape (8 sentences, 8 tokens), the next to another.
    from transformer_mt.graph_decoding import StepGraphs, static_beam_search, static_greedy_decode

    model = random_model(5)
    batches = [random_sources(seed, batch=batch, max_len=max_len, min_len=3)
               for seed, batch, max_len in [(0, 5, 8), (1, 8, 8), (2, 7, 6), (3, 9, 8), (4, 6, 20)]]
    assert [tuple(b.shape) for b in batches][:3] == [(5, 8), (8, 8), (7, 6)]  # one bucket
    greedy_settings = {"bos_id": BOS, "eos_id": EOS, "max_len_a": 1.5, "max_len_b": 5}
    beam_settings = dict(greedy_settings, beam_size=3, n_best=2, alpha=1.0)
    for search, expected, settings_ in [(static_greedy_decode, greedy_decode, greedy_settings),
                                        (static_beam_search, beam_search, beam_settings)]:
        graphs, states = StepGraphs(), []
        for src in batches:
            got = search(model, src, capture=False, graphs=graphs, **settings_)
            states.append(next(iter(graphs.captured.values()))[0])
            if search is static_greedy_decode:
                assert got == expected(model, src, **settings_)
            else:
                assert_same_hypotheses(got, expected(model, src, **settings_))
        assert states[0] is states[1] is states[2]  # the first batch's buffers, reused
        assert states[3] is not states[2] and states[4] is not states[3]  # 9 sentences; 19 tokens


def test_the_kv_cache_written_in_one_copy_or_two_and_reordered_keeps_the_rows_asked_for():
    from transformer_mt.kv_cache import KVCache

    gen = torch.Generator().manual_seed(0)
    one, two, flat = KVCache(1, 8), KVCache(1, 8), KVCache(1, 8)  # flat: one position at a time by append_position
    expected_k, expected_v = torch.empty(4, 2, 0, 3), torch.empty(4, 2, 0, 3)
    # A same-rows reorder leaves room for one position: the identity (no reorder) and two new
    # positions after a reorder write past it, which moves the cache back to its full capacity.
    for n, rows in [(2, [0, 1, 2, 3]), (1, [2, 2, 0, 1]), (1, [0, 1, 2, 3]), (2, [1, 0, 3, 2]), (1, [3, 1])]:
        if len(rows) < expected_k.shape[0]:  # fewer rows: sentences dropped, cross K/V selected too
            for cache in (one, two, flat):
                cache.layers[0].cross_k = cache.layers[0].cross_v = torch.arange(4.0)
                cache.reorder(torch.tensor(rows), cross=True)
                assert cache.layers[0].cross_k.tolist() == [3.0, 1.0]
        else:
            for cache in (one, two, flat):
                cache.reorder(torch.tensor(rows), cross=False)  # same rows: the spare buffer, or nothing
        expected_k, expected_v = expected_k[rows], expected_v[rows]
        kv = torch.randn(2, len(rows), 2, n, 3, generator=gen)
        got_one = one.layers[0].append_self_kv(kv.transpose(1, 2).contiguous().transpose(1, 2))  # any strides
        got_two = two.layers[0].append_self(kv[0], kv[1])
        for i in range(n):  # (2, B·H, Dh) of position i, any strides -> (2, B·H, length, Dh)
            written = flat.layers[0].append_position(kv[:, :, :, i].permute(1, 2, 0, 3).reshape(-1, 2, 3).transpose(0, 1),
                                                     len(rows))
        expected_k, expected_v = torch.cat([expected_k, kv[0]], dim=2), torch.cat([expected_v, kv[1]], dim=2)
        got_flat = written.view(2, len(rows), 2, -1, 3).unbind(0)
        for keys, values in (got_one, got_two, got_flat):
            assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    assert one.length == flat.length == 7
    fresh = KVCache(1, 8).layers[0]
    fresh.append_position(torch.zeros(2, 4, 3), 2)
    assert fresh.kv[0, :, :, 0].is_contiguous()  # position-major: a step writes one contiguous block
    with pytest.raises(ValueError, match="KV cache full"):
        one.layers[0].append_self_kv(torch.zeros(2, 2, 2, 2, 3))
    flat.layers[0].append_position(torch.zeros(2, 4, 3), 2)
    with pytest.raises(ValueError, match="KV cache full"):
        flat.layers[0].append_position(torch.zeros(2, 4, 3), 2)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("drop_finished", [0.0, 0.25, 0.5])
def test_greedy_drops_finished_sentences_from_the_batch_with_the_same_output(seed, drop_finished, monkeypatch):
    model, src = random_model(seed), random_sources(seed, batch=8)
    args = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    rows, step = [], model.decode_best

    def counted(tgt_ids, *more):  # the rows each step decodes
        rows.append(tgt_ids.shape[0])
        return step(tgt_ids, *more)

    with monkeypatch.context() as patch:
        patch.setattr(model, "decode_best", counted)
        dropping = greedy_decode(model, src, drop_finished=drop_finished, **args)
        kept = len(rows)
        assert greedy_decode(model, src, drop_finished=None, **args) == dropping
    assert dropping == greedy_decode(model, src, use_cache=False, **args)
    assert rows[kept - 1] < 8 and rows[kept:] == [8] * (len(rows) - kept)  # dropped rows, or kept them all


@pytest.mark.parametrize("vocab, k", [(40, 8), (8000, 8), (8003, 12), (2048, 1), (4100, 16)])
def test_row_top_gives_topks_values_and_indices_of_those_values(vocab, k):
    from transformer_mt.decoding import row_top

    gen = torch.Generator().manual_seed(vocab + k)
    for values in (torch.randn(9, vocab, generator=gen), torch.randint(-3, 4, (9, vocab), generator=gen).float()):
        values[0, -1] = 10.0  # the best in the tail beyond the last whole block
        top, where = row_top(values, k)
        expected = values.topk(k, dim=1)
        assert torch.equal(top, expected.values)
        assert torch.equal(values.gather(1, where), top) and all(len(set(row)) == k for row in where.tolist())
    assert torch.equal(where[0, :1], torch.tensor([vocab - 1]))


def test_beam_search_over_a_large_vocabulary_ranks_candidates_as_a_full_topk_does(monkeypatch):
    import transformer_mt.decoding as decoding

    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.0, max_len=48), 2100, 2100,
                        PAD).eval()
    with torch.no_grad():
        model.output_proj.weight.mul_(4.0)
        model.output_proj.weight[EOS] += 1.0
    src = torch.randint(4, 2100, (5, 7), generator=torch.Generator().manual_seed(0))
    settings_ = dict(bos_id=BOS, eos_id=EOS, beam_size=4, max_len_a=1.0, max_len_b=5, n_best=3)
    got = beam_search(model, src, **settings_)  # each beam's 8 best by block maxima (2,100 tokens: 32 blocks)
    monkeypatch.setattr(decoding, "row_top", lambda values, k: values.topk(k, dim=1))
    assert_same_hypotheses(got, beam_search(model, src, **settings_))
