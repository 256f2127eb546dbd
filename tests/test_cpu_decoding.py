"""The CPU decoding model (`cpu_decoding.decoding_model`) computes what the model computes: its
products (MKL for one row, oneDNN's packed weights for more), its flat decoder step, and int8
weights that stay close; `decode.quantize` / `--quantize` choose int8."""

import logging
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.test_evaluation import tiny_run  # noqa: F401  (a fixture: a tiny trained run)

from transformer_mt import cpu_decoding
from transformer_mt.config import ModelConfig
from transformer_mt.cpu_decoding import ArgmaxScreen, CpuDecodingTransformer, DecodingLinear, Int8Linear, best_tokens, \
    decoding_model, onednn_available
from transformer_mt.decoding import Sampling, beam_search, greedy_decode, sample_decode
from transformer_mt.errors import UsageError
from transformer_mt.model import Transformer
from transformer_mt.translator import Translator

PAD, BOS, EOS, V = 0, 2, 3, 40
CLOSE = dict(atol=1e-5, rtol=1e-5)


def random_model(seed: int, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "dropout": 0.1, "max_len": 48,
                         **overrides})
    model = Transformer(cfg, V, V, PAD).eval()
    with torch.no_grad():  # make EOS likely enough that sentences end at different steps
        model.output_proj.weight.mul_(4.0)
    return model


def random_sources(seed: int, batch: int, max_len: int = 9) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (batch,), generator=gen).tolist()
    rows = [torch.randint(4, V, (n,), generator=gen).tolist() + [EOS] for n in lengths]
    src = torch.full((batch, max(map(len, rows))), PAD)
    for i, row in enumerate(rows):
        src[i, : len(row)] = torch.tensor(row)
    return src  # (B, S), padded unless batch is 1


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_a_decoding_linear_computes_the_linear_its_relu_and_its_residual_sum_for_one_and_many_rows(onednn, bias):
    if onednn and not onednn_available():
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    fast = DecodingLinear(layer.weight, layer.bias, onednn)
    for x in (torch.randn(1, 24), torch.randn(7, 24), torch.randn(3, 5, 24)):  # MKL's row, oneDNN's rows, (B, T, in)
        with torch.no_grad():
            expected = layer(x)
        torch.testing.assert_close(fast(x), expected, **CLOSE)
        rows, residual = x.reshape(-1, 24), torch.randn(expected.reshape(-1, 40).shape)
        torch.testing.assert_close(fast.relu(rows), expected.reshape(-1, 40).relu(), **CLOSE)
        torch.testing.assert_close(fast.plus(rows, residual), residual + expected.reshape(-1, 40), **CLOSE)


@pytest.mark.parametrize("norm", ["pre", "post"])
# One row (MKL, SDPA, no source mask); several (oneDNN, attention by baddbmm/bmm), padded sources or none.
@pytest.mark.parametrize("batch, max_len", [(1, 9), (5, 9), (3, 2)])
@pytest.mark.parametrize("onednn_above", [None, 0])  # a tiny model's products on MKL, or all on oneDNN
def test_each_cached_step_gives_the_models_logits(norm, batch, max_len, onednn_above, monkeypatch):
    if onednn_above is not None:
        monkeypatch.setattr(cpu_decoding, "ONEDNN_ABOVE_ELEMENTS", onednn_above)
    model = random_model(0, norm=norm)
    fast = decoding_model(model)
    assert isinstance(fast, CpuDecodingTransformer)
    assert not any(isinstance(m, torch.nn.Linear) for m in fast.modules())  # every product a DecodingLinear
    assert (fast.output_proj.packed is not None) == (onednn_above == 0 and onednn_available())
    src = random_sources(batch, batch, max_len)
    assert bool((src != PAD).all()) == (max_len == 2 or batch == 1)
    mask = src != PAD
    with torch.inference_mode():
        memory = model.encode(src, mask)
        torch.testing.assert_close(fast.encode(src, mask)[mask], memory[mask], **CLOSE)  # padding: see below
        plain_cache, fast_cache = model.new_cache(6), fast.new_cache(6)
        tokens = torch.full((batch, 1), BOS)
        for _ in range(6):  # the model's own cached steps against the flat step, fed the same tokens
            expected = model.decode(tokens, memory, mask, plain_cache)
            got = fast.decode(tokens, memory, mask, fast_cache)
            torch.testing.assert_close(got, expected, **CLOSE)
            tokens = expected[:, -1].argmax(dim=-1, keepdim=True)
        tgt = torch.cat([torch.full((batch, 1), BOS), torch.randint(4, V, (batch, 4))], dim=1)
        # a whole prefix (no cache) takes the model's path, on the fast products
        torch.testing.assert_close(fast.decode(tgt, memory, mask), model.decode(tgt, memory, mask), **CLOSE)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_the_encoder_skips_the_padded_positions_of_a_batch_that_has_enough_of_them(norm):
    model = random_model(3, norm=norm)
    fast = decoding_model(model)
    src = random_sources(3, 6)  # lengths 2-9 padded to the longest
    mask = src != PAD
    assert 1 - mask.float().mean() > fast.pack_above
    rows = []  # the rows each encoder FFN product gets
    for layer in fast.encoder_layers:
        product = layer.ffn.linear1
        product.relu = lambda h, product=product: rows.append(h.shape[0]) or type(product).relu(product, h)
    with torch.inference_mode():
        expected = model.encode(src, mask)
        packed = fast.encode(src, mask)
        assert rows == [int(mask.sum())] * len(fast.encoder_layers)  # the real positions only
        torch.testing.assert_close(packed[mask], expected[mask], **CLOSE)
        assert not packed[~mask].any()  # zero at the padding, which cross-attention never reads
        fast.pack_above = 1.0  # never packed: every position, as the model
        torch.testing.assert_close(fast.encode(src, mask), expected, **CLOSE)
        assert rows[-1] == src.numel()


@pytest.mark.parametrize("batch, groups", [(1, 3), (4, 3), (3, 1)])
def test_steps_with_one_memory_row_per_group_of_rows_give_the_models_logits(batch, groups):
    # Beam search's K beams of a sentence: one memory row (and cross-attention K/V) for all.
    model = random_model(1)
    fast = decoding_model(model)
    assert fast.shares_source_rows("cpu")
    src = random_sources(2, batch)
    mask = src != PAD
    with torch.inference_mode():
        memory = model.encode(src, mask)
        wide_memory, wide_mask = memory.repeat_interleave(groups, 0), mask.repeat_interleave(groups, 0)
        plain_cache, fast_cache = model.new_cache(5), fast.new_cache(5)
        tokens = torch.randint(4, V, (batch * groups, 5), generator=torch.Generator().manual_seed(0))
        for t in range(5):
            expected = model.decode(tokens[:, t:t + 1], wide_memory, wide_mask, plain_cache)
            torch.testing.assert_close(fast.decode(tokens[:, t:t + 1], memory, mask, fast_cache), expected, **CLOSE)
        assert fast_cache.layers[0].cross_k.shape[0] == batch
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the model's own step: memory repeated for it
            assert not fast.shares_source_rows("cpu")
            got = fast.decode(tokens[:, :1], memory, mask, fast.new_cache(2))
            torch.testing.assert_close(got, model.decode(tokens[:, :1], wide_memory, wide_mask, model.new_cache(2)),
                                       atol=0.05, rtol=0.02)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("screen", [False, True])  # greedy's tokens from the full projection, or through the screen
def test_greedy_beam_and_sampled_translations_are_the_models(seed, norm, screen, monkeypatch):
    monkeypatch.setattr(cpu_decoding, "SCREEN_MIN_ELEMENTS", 0 if screen else 2 ** 62)
    model = random_model(seed, norm=norm)
    fast = decoding_model(model)
    assert (fast._screen is not None) == screen
    src = random_sources(seed, 6)
    args = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    greedy = greedy_decode(fast, src, **args)
    assert greedy == greedy_decode(model, src, **args)
    assert len({len(ids) for ids in greedy}) > 1  # sentences really stopped at different steps
    assert [greedy_decode(fast, src[i:i + 1], **args)[0] for i in range(6)] == greedy  # batch 1: no source mask
    beams = [[h.ids for h in hyps] for hyps in beam_search(fast, src, beam_size=3, n_best=3, **args)]
    assert beams == [[h.ids for h in hyps] for hyps in beam_search(model, src, beam_size=3, n_best=3, **args)]
    sampling = Sampling(temperature=1.0, top_k=5, seed=seed)
    draws = [sample_decode(m, src, sampling=sampling, generator=torch.Generator().manual_seed(seed), n_samples=2,
                           **args) for m in (fast, model)]
    assert [[h.ids for h in hyps] for hyps in draws[0]] == [[h.ids for h in hyps] for hyps in draws[1]]


def test_under_autocast_the_step_is_the_models_own():
    model = random_model(0)
    fast = decoding_model(model)
    src = random_sources(0, 4)
    mask = src != PAD
    tokens = torch.full((4, 1), BOS)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        memory = model.encode(src, mask)
        expected = model.decode(tokens, memory, mask, model.new_cache(4))
        got = fast.decode(tokens, memory, mask, fast.new_cache(4))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)  # bf16 products either way, not bitwise


def test_int8_weights_stay_close_to_the_models_logits_and_choices():
    model = random_model(0, d_model=64, d_ff=128)
    fast = decoding_model(model, quantize="int8")
    assert not any(isinstance(m, (torch.nn.Linear, DecodingLinear)) for m in fast.modules())
    assert any(isinstance(m, Int8Linear) for m in fast.modules())
    src = random_sources(1, 16)
    mask = src != PAD
    tgt = torch.cat([torch.full((16, 1), BOS), torch.randint(4, V, (16, 6))], dim=1)
    with torch.inference_mode():
        expected = model.decode(tgt, model.encode(src, mask), mask)  # (16, 7, V)
        memory = fast.encode(src, mask)
        whole = fast.decode(tgt, memory, mask)
        cache = fast.new_cache(7)
        steps = torch.cat([fast.decode(tgt[:, t:t + 1], memory, mask, cache) for t in range(7)], dim=1)
    # Activations are quantised per call, so the steps and the whole prefix differ a little too.
    for got in (whole, steps):
        assert (got - expected).abs().max() < 0.05 * expected.abs().max()
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    assert not torch.equal(steps, expected)  # really quantised


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantize must be one of"):
        decoding_model(random_model(0), quantize="int4")



# --- decode.quantize from the command line ------------------------------------------------------

def test_quantize_int8_reaches_the_cpu_decoding_model_and_names_evaluates_output(tiny_run: Path, monkeypatch, capsys,
                                                                                 caplog):
    import transformer_mt.evaluation as evaluation_module

    seen = []  # the quantize argument of each decoding model made
    real = evaluation_module.decoding_model
    monkeypatch.setattr(evaluation_module, "decoding_model", lambda model, quantize: seen.append(quantize) or
                        real(model, quantize))
    code, _, err = run_cli(["evaluate", "--run", str(tiny_run), "--quiet", "--quantize", "int8"], monkeypatch, capsys,
                           tiny_run.parent)
    assert code == 0, err
    assert seen == ["int8"] and "beam 1, int8 weights;" in err
    assert (tiny_run / "evaluation" / "test.best.beam1.int8.txt").is_file()  # never the fp32 hypotheses' file
    code, _, err = run_cli(["translate", "--run", str(tiny_run), "--quantize", "int8", "Good morning."], monkeypatch,
                           capsys, tiny_run.parent)
    assert code == 0 and seen[-1] == "int8", err
    code, _, err = run_cli(["translate", "--run", str(tiny_run), "--engine", "torch", "Good morning."], monkeypatch,
                           capsys, tiny_run.parent)
    assert code == 0 and seen[-1] == "none", err  # the run's decode.quantize
    with pytest.raises(SystemExit) as exit_:
        run_cli(["translate", "--run", str(tiny_run), "--quantize", "int4", "hello"], monkeypatch, capsys,
                tiny_run.parent)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --quantize: invalid choice: 'int4'" in err and "Traceback" not in err


def test_quantize_on_a_gpu_warns_that_it_decodes_unquantised(tiny_run: Path, caplog):
    translator = Translator.from_run(tiny_run, device="cpu")
    translator.device = torch.device("cuda")  # only its type is read: no GPU needed
    with caplog.at_level(logging.WARNING, logger="transformer_mt.translator"):
        translator.set_decoding(quantize="int8")
    assert "decode.quantize: int8 applies to CPU decoding only; decoding on cuda unquantised" in caplog.text


@pytest.mark.parametrize("rows, vocab", [(1, 40), (8, 40), (32, 8000), (33, 8003), (9, 64), (16, 63)])
def test_best_tokens_is_the_first_argmax_of_each_row(rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # few values: many ties
    logits[0, -1] = 10.0  # a maximum in the tail (beyond the last whole block)
    if rows > 1:
        logits[1, 1] = logits[1, vocab - 1] = 10.0  # a tie across the head and the tail: the first wins
    assert torch.equal(best_tokens(logits), logits.max(dim=-1).indices)
    noise = torch.randn(rows, vocab, generator=gen)
    assert torch.equal(best_tokens(noise), noise.argmax(dim=-1))


def test_int8_on_a_torch_without_its_quantized_ops_is_one_clear_error(monkeypatch):
    def unsupported(*args):
        raise RuntimeError("Didn't find engine for operation quantized::linear_prepack NoQEngine\nmore lines")

    monkeypatch.setattr(torch.ops.quantized, "linear_prepack", unsupported)
    with pytest.raises(UsageError, match=r"decode.quantize: int8 is not available in this torch build on this CPU "
                                         r"\(\w+ engine: Didn't find engine .* NoQEngine\); use none$"):
        decoding_model(random_model(0), quantize="int8")
    monkeypatch.setattr(cpu_decoding, "SCREEN_MIN_ELEMENTS", 0)  # even where greedy would use the screen
    fast = decoding_model(random_model(0))  # fp32 decoding needs no int8 engine: greedy computes every logit
    assert fast._screen is None
    src = random_sources(0, 4)
    args = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.5, max_len_b=4)
    assert greedy_decode(fast, src, **args) == greedy_decode(random_model(0), src, **args)


def screened_rows(vocab: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (V, D), bias (V,) and rows x (64, D) at several scales, some lopsided."""
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(vocab, dim, generator=gen) / dim ** 0.5, torch.randn(vocab, generator=gen)
    x = torch.randn(64, dim, generator=gen) * torch.logspace(-3, 2, 64)[:, None]
    x[::5] = x[::5].abs()  # no negative value: the activations' zero point at the bottom of its range
    x[1::7, 0] *= 50.0  # one value far outside the rest: a coarse quantisation step
    return weight, bias, x


def spied(screen: ArgmaxScreen, exact: DecodingLinear, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The rows the screen sent on from the int8 logits (close calls), and those whose every fp32 logit it
    computed, as they go."""
    rescored, exact_rows = [], []
    rescore, rows = screen._rescored, exact.rows
    monkeypatch.setattr(screen, "_rescored", lambda x, *more: rescored.append(x.clone()) or rescore(x, *more))
    monkeypatch.setattr(exact, "rows", lambda x: exact_rows.append(x.clone()) or rows(x))
    return rescored, exact_rows


@pytest.mark.parametrize("vocab, dim, seed", [(40, 16, 0), (3000, 64, 1), (8003, 32, 2)])
def test_the_argmax_screens_bound_holds_and_its_tokens_are_the_fp32_argmax(vocab, dim, seed, monkeypatch):
    weight, bias, x = screened_rows(vocab, dim, seed)
    screen, exact = ArgmaxScreen(weight, bias), DecodingLinear(weight, bias, onednn=False)
    logits = torch.addmm(bias, x, weight.t())  # (64, V)
    assert bool(((logits - screen.int8.rows(x)).abs().amax(dim=1) <= screen.bound(x)).all())
    forbidden = (0, 2)
    expected = logits.clone()
    expected[:, list(forbidden)] = torch.finfo(logits.dtype).min
    rescored, _ = spied(screen, exact, monkeypatch)
    assert torch.equal(screen.best(x, forbidden, exact), expected.max(dim=-1).indices)
    assert rescored  # some rows were close calls
    # Rows whose best token leads clearly, as a trained decoder's mostly do, are settled by the int8 logits.
    targets = torch.arange(64) * 37 % vocab
    leading = weight[targets] * 10.0 + 0.1 * x / x.norm(dim=1, keepdim=True)  # (64, D)
    rescored.clear()
    assert torch.equal(screen.best(leading, (), exact), torch.addmm(bias, leading, weight.t()).max(dim=-1).indices)
    assert sum(rows.shape[0] for rows in rescored) < 32


def test_a_close_call_is_decided_by_fp32_logits_of_its_few_candidates_and_a_tie_goes_to_the_first(monkeypatch):
    weight, bias, x = screened_rows(500, 32, 3)
    x = torch.layer_norm(x, (32,))  # rows of one scale, as a decoder's output
    weight[[7, 300]] = x[40] / x[40].norm()  # tokens 7 and 300 tie for row 40, far ahead of the rest
    bias[[7, 300]] = 5.0
    screen, exact = ArgmaxScreen(weight, bias), DecodingLinear(weight, bias, onednn=False)
    rescored, exact_rows = spied(screen, exact, monkeypatch)
    ids = screen.best(x, (), exact)
    assert ids[40] == 7 and any(bool((rows == x[40]).all(dim=1).any()) for rows in rescored)
    assert torch.equal(ids, torch.addmm(bias, x, weight.t()).max(dim=-1).indices)
    assert not exact_rows  # the close calls had few candidates: their fp32 logits alone were computed
    x[3, 5] = float("nan")  # a broken row: no bound holds, so all its logits are computed, as the full path does
    assert screen.best(x, (), exact)[3] == best_tokens(torch.addmm(bias, x, weight.t()))[3] and exact_rows
