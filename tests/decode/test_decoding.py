import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import transformer_mt.decode.generator as decoding
from tests.decode.beam_reference import reference_beam_search
from tests.helpers import (BOS, EOS, PAD, assert_same_hypotheses, make_run, random_model, random_prefixes,
                           random_sources, teacher_forced_log_prob)
from transformer_mt.config.schema import ModelConfig
from transformer_mt.decode.generator import StepGraphs, beam_search, greedy_decode, sample_decode
from transformer_mt.decode.hypotheses import Sampling
from transformer_mt.model.transformer import Transformer


def test_decoding_logits_are_fp32_under_bf16_autocast():
    # Ranking candidates on bf16 logits (8 mantissa bits) would tie or swap close ones.
    model, src = random_model(0), random_sources(0)
    bos = torch.full((src.shape[0],), BOS)
    with torch.inference_mode():
        plain = model.decode_step(bos, model.new_cache(src, 4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model.decode_step(bos, model.new_cache(src, 4))
    assert mixed.dtype == torch.float32
    assert torch.allclose(mixed, plain, atol=0.5)  # bf16 layers, fp32 projection: close, not equal
    # Computed in fp32, not computed in bf16 and cast: most values are not bf16 numbers.
    assert (mixed != mixed.bfloat16().float()).float().mean() > 0.5


@torch.inference_mode()
def uncached_greedy(model: Transformer, src: torch.Tensor, max_len_a: float, max_len_b: int) -> list[list[int]]:
    """Greedy decoding the slow way: the whole prefix through the teacher-forced forward at every step."""
    limits = decoding.max_target_lengths(src != PAD, max_len_a, max_len_b, model.cfg.max_len).tolist()
    outputs = []
    for row, limit in zip(src, limits):
        ids = [BOS]
        while len(ids) <= limit:
            logits = model(row[row != PAD][None], torch.tensor([ids])).float()[-1]  # (V,)
            logits[[PAD, BOS]] = torch.finfo(logits.dtype).min
            ids.append(int(logits.argmax()))
            if ids[-1] == EOS:
                break
        outputs.append([t for t in ids[1:] if t != EOS])
    return outputs


@pytest.mark.parametrize("seed", range(5))
def test_cached_greedy_equals_uncached_greedy(seed):
    model, src = random_model(seed), random_sources(seed)
    cached = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    assert cached == uncached_greedy(model, src, 1.5, 4)
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
    gaps: list[float] = []
    expected = reference_beam_search(model, src, **settings_, gaps=gaps)
    # A tie is broken by rounding, which differs between the searches (NaN: two unused beams, no choice).
    assume(min((gap for gap in gaps if gap == gap), default=1.0) > 1e-4)
    assert_same_hypotheses(beam_search(model, src, **settings_), expected)


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
    from transformer_mt.decode import translator as translator_module

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
    model, src = random_model(seed), random_sources(seed)
    settings = {"bos_id": BOS, "eos_id": EOS, "max_len_a": 1.5, "max_len_b": 5}
    expected = greedy_decode(model, src, **settings)
    got = greedy_decode(model, src, graphs=StepGraphs(), **settings)  # the steps a CUDA graph replays
    assert got == expected
    assert len({len(ids) for ids in expected}) > 1  # sentences ended at different steps


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), beam=st.integers(1, 5), data=st.data(),
       alpha=st.sampled_from([0.0, 1.0]), max_len_b=st.integers(1, 8))
def test_fixed_shape_beam_steps_give_beam_searchs_output(seed, batch, beam, data, alpha, max_len_b):
    model, src = random_model(seed % 1000), random_sources(seed, batch=batch, max_len=20)
    settings_ = dict(bos_id=BOS, eos_id=EOS, beam_size=beam, max_len_a=1.5, max_len_b=max_len_b, alpha=alpha,
                     n_best=data.draw(st.integers(1, beam), label="n_best"))
    expected = beam_search(model, src, **settings_)
    check_every = data.draw(st.sampled_from([1, 3, 8]), label="check_every")  # steps past the end change nothing
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoding, "CHECK_EVERY", check_every)
        assert_same_hypotheses(beam_search(model, src, graphs=StepGraphs(), **settings_), expected)


def rows_per_step(model: Transformer, search) -> list[int]:
    """The rows each decoding step computes while `search()` runs."""
    rows = []
    hook = model.output_proj.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        search()
    finally:
        hook.remove()
    return rows


def test_beam_search_drops_done_sentences_and_the_fixed_shape_steps_keep_every_row(monkeypatch):
    # The eager search drops a sentence's rows at the step it is done, as the reference does; the
    # fixed-shape steps (what a CUDA graph replays) keep all B·K rows, computing the done ones'
    # and ignoring them; all stop at the step where the last sentence is done.
    model, src = random_model(3), random_sources(3, batch=8)
    settings_ = dict(bos_id=BOS, eos_id=EOS, beam_size=4, max_len_a=1.5, max_len_b=4)
    shrinking = rows_per_step(model, lambda: beam_search(model, src, **settings_))
    assert shrinking[-1] < shrinking[0]  # sentences did finish at different steps
    monkeypatch.setattr(decoding, "CHECK_EVERY", 1)
    fixed = rows_per_step(model, lambda: beam_search(model, src, graphs=StepGraphs(), **settings_))
    assert fixed == [src.shape[0] * 4] * len(shrinking)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([float("-inf"), -3.0, -1.5, -1.0, 0.0, 2.0]), min_size=1, max_size=9),
                     min_size=1, max_size=4).filter(lambda rows: len({len(r) for r in rows}) == 1))
def test_stable_descending_order_sorts_as_python_sorted_does(rows):
    from transformer_mt.decode.search import stable_descending_order

    order = stable_descending_order(torch.tensor(rows, dtype=torch.float64)).tolist()
    assert order == [sorted(range(len(row)), key=lambda i: row[i], reverse=True) for row in rows]


def test_batches_of_one_padded_shape_reuse_one_set_of_step_buffers_with_the_same_output():
    # What a CUDA graph replays for every batch of its bucket, run eagerly: batches of 5-8
    # sentences and 6-8 source tokens pad to one shape (8 sentences, 8 tokens), the next to another.
    model = random_model(5)
    batches = [random_sources(seed, batch=batch, max_len=max_len, min_len=3)
               for seed, batch, max_len in [(0, 5, 8), (1, 8, 8), (2, 7, 6), (3, 9, 8), (4, 6, 20)]]
    assert [tuple(b.shape) for b in batches][:3] == [(5, 8), (8, 8), (7, 6)]  # one bucket
    greedy_settings = {"bos_id": BOS, "eos_id": EOS, "max_len_a": 1.5, "max_len_b": 5}
    beam_settings = dict(greedy_settings, beam_size=3, n_best=2, alpha=1.0)
    for search, settings_ in [(greedy_decode, greedy_settings), (beam_search, beam_settings)]:
        graphs, states = StepGraphs(), []
        for src in batches:
            got = search(model, src, graphs=graphs, **settings_)
            states.append(next(iter(graphs.captured.values()))[0])
            if search is greedy_decode:
                assert got == search(model, src, **settings_)
            else:
                assert_same_hypotheses(got, search(model, src, **settings_))
        assert states[0] is states[1] is states[2]  # the first batch's buffers, reused
        assert states[3] is not states[2] and states[4] is not states[3]  # 9 sentences; 19 tokens


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("drop_finished", [0.0, 0.25, 0.5])
def test_greedy_drops_finished_sentences_from_the_batch_with_the_same_output(seed, drop_finished):
    model, src = random_model(seed), random_sources(seed, batch=8)
    args = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    outputs = []
    rows = rows_per_step(model, lambda: outputs.append(greedy_decode(model, src, drop_finished=drop_finished,
                                                                     **args)))
    kept = rows_per_step(model, lambda: outputs.append(greedy_decode(model, src, drop_finished=2.0, **args)))
    assert outputs[0] == outputs[1] == uncached_greedy(model, src, 1.5, 4)
    assert rows[-1] < 8 and kept == [8] * len(kept)  # dropped rows, or kept them all
    assert len(rows) == len(kept)


def test_beam_search_over_a_large_vocabulary_gives_the_reference_output():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.0, max_len=48), 2100, 2100,
                        PAD).eval()
    with torch.no_grad():
        model.output_proj.weight.mul_(4.0)
        model.output_proj.weight[EOS] += 1.0
    src = torch.randint(4, 2100, (5, 7), generator=torch.Generator().manual_seed(0))
    settings_ = dict(bos_id=BOS, eos_id=EOS, beam_size=4, max_len_a=1.0, max_len_b=5, n_best=3)
    assert_same_hypotheses(beam_search(model, src, **settings_), reference_beam_search(model, src, **settings_))


# --- BeamState.advance's three parts ----------------------------------------------------------

def beam_state_after_a_step(K: int = 2, n_best: int = 2, V: int = 6):
    """One sentence's beam state whose K beams have distinct scores, and log-probs (K, V) for its next step."""
    from transformer_mt.decode.search import BeamState

    state = BeamState.start(torch.tensor([6]), 6, torch.zeros(1, dtype=torch.long), beam_size=K, n_best=n_best,
                            bos_id=BOS, eos_id=EOS, pad_id=PAD, alpha=1.0)
    state.scores.copy_(torch.tensor([-0.5, -1.25, -2.0][:K]))
    state.tokens[:, 1] = torch.tensor([5, 4, 6][:K])
    state.position += 1
    log_probs = torch.log_softmax(torch.randn(K, V, generator=torch.Generator().manual_seed(1)), dim=-1)
    return state, log_probs


def test_the_candidates_are_the_2k_best_continuations_of_all_beams():
    state, log_probs = beam_state_after_a_step()
    candidates = state.best_candidates(log_probs)
    every = (state.scores[:, None] + log_probs).flatten()  # (K·V,): beam k's token t at k·V + t
    best, where = every.topk(4)
    assert torch.equal(candidates.scores, best[None]) and candidates.scores.shape == (1, 4)
    assert torch.equal(candidates.rows, (where // 6)[None]) and torch.equal(candidates.tokens, (where % 6)[None])


def test_the_top_k_candidates_that_end_are_set_aside_and_the_best_others_live_on():
    from transformer_mt.decode.hypotheses import length_penalty
    from transformer_mt.decode.search import Candidates

    state, _ = beam_state_after_a_step()
    # Best first: beam 1 then EOS (ends, in the top K), beam 0 then 7, beam 0 then EOS (beyond the top K), beam 1 then 8.
    candidates = Candidates(torch.tensor([[-1.0, -1.5, -2.0, -2.5]]), torch.tensor([[1, 0, 0, 1]]),
                            torch.tensor([[EOS, 7, EOS, 8]]))
    at_cap = torch.tensor([False])
    state.set_aside_finished(candidates, at_cap)
    assert state.count.tolist() == [1]
    assert state.best_scores[0].tolist() == [-1.0 / length_penalty(2, 1.0), float("-inf")]
    assert state.best_log_probs[0, 0].item() == -1.0 and state.best_tokens[0, 0, :2].tolist() == [4, EOS]
    rows = state.continue_live(candidates, at_cap)
    assert rows.tolist() == [0, 1] and state.scores.tolist() == [-1.5, -2.5] and state.position.tolist() == [2]
    assert state.tokens[:, :3].tolist() == [[BOS, 5, 7], [BOS, 4, 8]] and state.done.tolist() == [False]


def test_advance_is_its_three_parts_in_turn():
    state, log_probs = beam_state_after_a_step(K=3, n_best=2, V=8)
    parts, _ = beam_state_after_a_step(K=3, n_best=2, V=8)
    rows = state.advance(log_probs)
    candidates = parts.best_candidates(torch.log_softmax(log_probs, dim=-1))
    at_cap = parts.position + 1 >= parts.limits
    parts.set_aside_finished(candidates, at_cap)
    assert torch.equal(parts.continue_live(candidates, at_cap), rows)
    for name in ("tokens", "scores", "position", "done", "count", "best_tokens", "best_log_probs", "best_scores"):
        assert torch.equal(getattr(parts, name), getattr(state, name)), name


# --- target prefixes ---------------------------------------------------------------------------

def prefixed_searches(model: Transformer, src: torch.Tensor, prefixes: torch.Tensor | None, **shape) -> dict:
    """Every search of `src` whose hypotheses begin with `prefixes` (B, P), by name; `shape`: graphs."""
    args = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4, prefixes=prefixes)
    return {"greedy": beam_search(model, src, beam_size=1, alpha=0.0, **args, **shape),
            "beam": beam_search(model, src, beam_size=4, n_best=3, alpha=0.6, **args, **shape),
            "samples": sample_decode(model, src, sampling=Sampling(temperature=2.0), n_samples=2,
                                     generator=torch.Generator().manual_seed(0), **args)}


@pytest.mark.parametrize("seed", range(3))
def test_a_prefix_begins_every_hypothesis_and_its_log_probability_counts_it(seed):
    model, src = random_model(seed), random_sources(seed)
    prefixes = random_prefixes(seed, src.shape[0])
    limits = decoding.max_target_lengths(src != PAD, 1.5, 4, model.cfg.max_len).tolist()
    for name, results in prefixed_searches(model, src, prefixes).items():
        for i, hyps in enumerate(results):
            prefix = prefixes[i][prefixes[i] != PAD].tolist()
            for h in hyps:
                assert h.ids[:len(prefix)] == prefix, name
                ended = len(h.ids) < limits[i]  # cut at the cap means no EOS was scored
                expected = teacher_forced_log_prob(model, src[i][src[i] != PAD], h.ids, ended)
                assert h.log_prob == pytest.approx(expected, abs=1e-4), name


@pytest.mark.parametrize("seed", range(2))
def test_prefixes_on_fixed_shape_steps_give_the_eager_output(seed):
    model, src = random_model(seed), random_sources(seed, batch=5, max_len=12)
    prefixes = random_prefixes(seed, src.shape[0])
    eager = prefixed_searches(model, src, prefixes)
    fixed = prefixed_searches(model, src, prefixes, graphs=StepGraphs())
    for name in ("greedy", "beam"):
        assert_same_hypotheses(fixed[name], eager[name])


def test_sentences_without_a_prefix_decode_as_in_a_search_without_prefixes(monkeypatch):
    model, src = random_model(3), random_sources(3)
    prefixes = random_prefixes(3, src.shape[0])
    prefixes[1:3] = PAD  # two sentences without one
    with_prefixes = prefixed_searches(model, src, prefixes)
    from transformer_mt.decode import search

    monkeypatch.setattr(search, "allowed_tokens", lambda *args: pytest.fail("a search without prefixes forced one"))
    monkeypatch.setattr(search.BeamState, "after_prefix", lambda *args: pytest.fail("after_prefix without prefixes"))
    without = prefixed_searches(model, src, None)
    for name in ("greedy", "beam"):
        assert_same_hypotheses([with_prefixes[name][i] for i in (1, 2)], [without[name][i] for i in (1, 2)])


def test_right_after_its_prefix_only_a_sentences_best_candidate_may_end():
    from transformer_mt.decode.search import Candidates

    state, _ = beam_state_after_a_step()  # K = 2, one token generated
    state.forced = torch.tensor([[9, PAD, PAD, PAD]])  # a prefix of that one token: the next step is free
    inf = float("-inf")
    # An EOS second (in the top K) is dropped, and the candidates beyond the top K too: nothing ended.
    candidates = Candidates(torch.tensor([[-1.0, -2.0, -3.0, -4.0]]), torch.tensor([[0, 0, 0, 0]]),
                            torch.tensor([[5, EOS, EOS, 7]]))
    assert state.after_prefix(candidates).scores.tolist() == [[-1.0, inf, inf, inf]]
    # The best ends: the first candidate beyond the top K that goes on replaces it.
    candidates = candidates._replace(tokens=torch.tensor([[EOS, 6, EOS, 7]]))
    assert state.after_prefix(candidates).scores.tolist() == [[-1.0, -2.0, inf, -4.0]]
    state.forced = torch.tensor([[9, 8, PAD, PAD]])  # still in its prefix: nothing changes
    assert state.after_prefix(candidates).scores.tolist() == [[-1.0, -2.0, -3.0, -4.0]]
