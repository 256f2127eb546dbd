import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import BOS, EOS, PAD, tiny_model
from tests.helpers import TINY_V as V
from transformer_mt.config.schema import ModelConfig
from transformer_mt.core.errors import CheckpointError
from transformer_mt.data.batching import PackShape, make_batch, make_pack_from_flat
from transformer_mt.decode.generator import greedy_decode
from transformer_mt.model import transformer
from transformer_mt.model.transformer import Packing, Transformer, build_model
from transformer_mt.runs.checkpoint import FORMAT_VERSION, checkpoint_state, load_checkpoint, save_atomic


def padded_logits(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits at every target position, (B, T, V)."""
    return model(src, tgt, pack=False).view(*tgt.shape, -1)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_padding_does_not_change_real_positions(norm):
    model = tiny_model(norm=norm)
    src = torch.tensor([[5, 6, 7, EOS]])
    tgt = torch.tensor([[BOS, 8, 9]])
    alone = model(src, tgt)  # (3, V)
    # The same pair inside a batch, padded on both sides by a longer neighbour.
    src_batch = torch.tensor([[5, 6, 7, EOS, PAD, PAD], [4, 5, 6, 7, 8, EOS]])
    tgt_batch = torch.tensor([[BOS, 8, 9, PAD, PAD], [BOS, 4, 4, 4, 4]])
    torch.testing.assert_close(padded_logits(model, src_batch, tgt_batch)[0, :3], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(src_batch, tgt_batch)[:3], alone, atol=1e-5, rtol=1e-5)  # packed: its rows first


def test_decoder_is_causal():
    model = tiny_model()
    src = torch.tensor([[5, 6, 7, EOS]])
    before = padded_logits(model, src, torch.tensor([[BOS, 8, 9, 10]]))
    after = padded_logits(model, src, torch.tensor([[BOS, 8, 20, 21]]))  # change positions 2 and 3 only
    torch.testing.assert_close(before[0, :2], after[0, :2])
    assert not torch.allclose(before[0, 2], after[0, 2])


def test_source_padding_is_masked_in_cross_attention():
    model = tiny_model(share_embeddings=False, tie_output=False)  # so the pad row feeds nothing else
    tgt = torch.tensor([[BOS, 8, 9]])
    # Changing the embedding of the pad token must not change anything: pads are never attended.
    a = model(torch.tensor([[5, 6, EOS, PAD]]), tgt)
    with torch.no_grad():
        model.src_embed.weight[PAD].normal_()
    b = model(torch.tensor([[5, 6, EOS, PAD]]), tgt)
    torch.testing.assert_close(a, b)


def test_build_model_makes_the_configured_transformer_for_the_vocabularies():
    cfg = ModelConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32, max_len=32, share_embeddings=False, tie_output=False)
    model = build_model(cfg, 30, 40, PAD)
    assert isinstance(model, Transformer) and model.cfg is cfg and model.pad_id == PAD
    assert model.src_embed.weight.shape == (30, 16) and model.output_proj.weight.shape == (40, 16)  # (V, D)
    # The output projection's FLOPs count the target vocabulary: 6·D·ΔV·T = 6·16·10·2 more for V = 40 than 30.
    assert model.train_flops([3], [2]) - build_model(cfg, 30, 30, PAD).train_flops([3], [2]) == 6 * 16 * 10 * 2
    torch.manual_seed(0)
    a = build_model(cfg, 30, 40, PAD).state_dict()
    torch.manual_seed(0)
    b = build_model(cfg, 30, 40, PAD).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # seeded: the same initial weights (every DDP rank's)


def test_encoder_and_decoder_depths_are_set_separately_and_n_layers_sets_both():
    deep_shallow = tiny_model(encoder_layers=2, decoder_layers=1)
    assert (len(deep_shallow.encoder_layers), len(deep_shallow.decoder_layers)) == (2, 1)
    assert (len(tiny_model(n_layers=3).encoder_layers), len(tiny_model(n_layers=3).decoder_layers)) == (3, 3)
    assert len(tiny_model(n_layers=3, decoder_layers=1).encoder_layers) == 3  # one side set, the other n_layers
    # Parameters per layer, D = 16, F = 32: a Linear(i, o) holds i·o + o, a LayerNorm 2D.
    # encoder layer: qkv 16·48 + 48 = 816, out 272, FFN 16·32 + 32 + 32·16 + 16 = 1072, 2 norms 64 -> 2224
    # decoder layer: also cross-attention q 272 and kv 16·32 + 32 = 544, out 272, a third norm 32 -> 3344
    one_one = tiny_model(n_layers=1).num_parameters()
    assert deep_shallow.num_parameters() - one_one == 2224
    assert tiny_model(encoder_layers=1, decoder_layers=2).num_parameters() - one_one == 3344
    src, tgt = torch.tensor([[5, 6, EOS]]), torch.tensor([[BOS, 8, 9]])
    assert deep_shallow.new_cache(src, 8).self_kv.shape[0] == 1  # keys and values of each decoder layer
    assert deep_shallow.cross_attention(src, tgt, layer=-1).shape == (1, 2, 3, 3)  # (B, H, T, S) of its one layer


def test_tied_weights_share_one_tensor():
    model = tiny_model(share_embeddings=True, tie_output=True)
    assert model.src_embed.weight is model.tgt_embed.weight is model.output_proj.weight
    untied = tiny_model(share_embeddings=False, tie_output=False)
    assert untied.src_embed.weight is not untied.tgt_embed.weight
    assert untied.num_parameters() > model.num_parameters()


def test_greedy_decoding_stops_at_eos_and_respects_the_length_cap():
    model = tiny_model()
    with torch.no_grad():  # make EOS win at every step: every output must be empty
        model.output_proj.weight.zero_()
        model.output_proj.weight[EOS].fill_(0.0)
    src = torch.tensor([[5, 6, EOS, PAD], [5, 6, 7, EOS]])
    bias = torch.zeros(V)
    bias[EOS] = 10.0
    model.output_proj.register_forward_hook(lambda m, i, out: out + bias)
    assert greedy_decode(model, src, bos_id=BOS, eos_id=EOS, max_len_a=1.0, max_len_b=5) == [[], []]

    bias.zero_()
    bias[9] = 10.0  # now token 9 always wins and EOS never comes: the cap a·S + b stops decoding
    out = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, max_len_a=1.0, max_len_b=2)
    assert out == [[9] * (3 + 2), [9] * (4 + 2)]  # S counts real tokens including EOS


def test_attention_weights_are_the_ones_the_layer_attends_with():
    model = tiny_model()
    attention = model.decoder_layers[0].cross_attn
    src = Packing.of(torch.tensor([[True] * 5, [True, True, True, False, False]]))
    tgt = Packing.of(torch.ones(2, 3, dtype=torch.bool))
    query, memory = torch.randn(6, 16), torch.randn(8, 16)  # rows
    weights = attention.attention_weights(query, memory, tgt, src)  # (B, H, Tq, Tk)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 3))
    assert (weights[1, :, :, 3:] == 0).all()  # padding gets no attention
    _, v = attention.keys_values(memory, src)  # (B, H, Tk, Dh)
    mixed = (weights @ v).transpose(1, 2).reshape(6, 16)
    torch.testing.assert_close(attention.out_proj(mixed), attention(query, memory, tgt, src), atol=1e-5, rtol=1e-5)


def test_cross_attention_map_has_one_row_per_target_position():
    model = tiny_model()
    src, tgt = torch.tensor([[5, 6, 7, EOS, PAD]]), torch.tensor([[BOS, 8, 9]])
    weights = model.cross_attention(src, tgt, layer=-1)
    assert weights.shape == (1, 2, 3, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 3))


def separate_projections(state: dict) -> dict:
    """`state` (a model state dict) with the fused projections split: separate q/k/v
    (self-attention) and k/v (cross-attention) `nn.Linear` weights (out, in) and biases."""
    old = {}
    for key, tensor in state.items():
        module, _, name = key.rpartition(".")
        for fused, parts in (("qkv_proj", ["q_proj", "k_proj", "v_proj"]), ("kv_proj", ["k_proj", "v_proj"])):
            if module.endswith("." + fused):
                for part, chunk in zip(parts, tensor.chunk(len(parts))):
                    old[f"{module[: -len(fused)]}{part}.{name}"] = chunk.clone()
                break
        else:
            old[key] = tensor
    return old


def unfused_attention(state: dict, prefix: str, query, key_value, mask, causal: bool, n_heads: int = 2):
    """Multi-head attention computed the plain way: separate F.linear projections of (out, in) weights."""
    def linear(name, x):
        return F.linear(x, state[f"{prefix}{name}.weight"], state[f"{prefix}{name}.bias"])

    def heads(x):  # (B, L, D) -> (B, H, L, Dh)
        return x.view(x.shape[0], x.shape[1], n_heads, -1).transpose(1, 2)

    q, k, v = heads(linear("q_proj", query)), heads(linear("k_proj", key_value)), heads(linear("v_proj", key_value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None, None, :],
                                         is_causal=causal)  # (B, H, Tq, Dh)
    return linear("out_proj", out.transpose(1, 2).flatten(2))


def test_fused_projections_compute_what_separate_ones_do():
    model = tiny_model()
    old = separate_projections(model.state_dict())
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    tgt, src = Packing.dense(torch.ones(2, 5, dtype=torch.bool)), Packing.dense(mask)
    layer = model.decoder_layers[1]
    torch.testing.assert_close(layer.self_attn(x.flatten(0, 1), tgt, causal=True).view(2, 5, 16),
                               unfused_attention(old, "decoder_layers.1.self_attn.", x, x, None, True))
    torch.testing.assert_close(layer.cross_attn(x.flatten(0, 1), memory.flatten(0, 1), tgt, src).view(2, 5, 16),
                               unfused_attention(old, "decoder_layers.1.cross_attn.", x, memory, mask, False))
    ffn = model.encoder_layers[0].ffn
    torch.testing.assert_close(ffn(x), F.linear(F.relu(F.linear(x, old["encoder_layers.0.ffn.linear1.weight"],
                                                                 old["encoder_layers.0.ffn.linear1.bias"])),
                                                old["encoder_layers.0.ffn.linear2.weight"],
                                                old["encoder_layers.0.ffn.linear2.bias"]))


@pytest.mark.parametrize("version", [1, 99])
def test_a_checkpoint_of_another_format_version_is_refused_in_one_line_naming_the_file(version, tmp_path):
    model = tiny_model()
    save_atomic({**checkpoint_state(model.state_dict(), {}, {}), "format_version": version}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(tmp_path / "other.pt")
    assert str(caught.value) == (f"{tmp_path / 'other.pt'}: checkpoint format version {version} is not supported "
                                 f"by this tmt (expects {FORMAT_VERSION})")


def test_fused_projections_start_like_separate_ones():
    # Xavier-uniform per block: each q, k, v block gets the bound of a (D, D) matrix, not of (3D, D).
    model = tiny_model(d_model=64, n_heads=4)
    weight = model.encoder_layers[0].self_attn.qkv_proj.weight  # (3D, D)
    bound = (6 / (64 + 64)) ** 0.5
    assert weight.abs().max() <= bound
    assert weight.abs().max() > 0.9 * bound  # not the smaller (3D, D) bound sqrt(6 / 4D)


def test_under_bf16_autocast_training_logits_take_its_dtype_and_decoding_logits_stay_fp32():
    """The teacher-forced projection is the step's largest matrix product (V columns): at the
    fp32 rate under bf16 autocast it would dominate a GPU step. Decoding ranks tokens: fp32."""
    model = tiny_model()
    src, tgt = torch.tensor([[5, 6, 7, EOS]]), torch.tensor([[BOS, 8, 9]])
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        training_logits = model(src, tgt)
        cache = model.new_cache(src, 3)
        decoding_logits = []
        for t in range(3):
            decoding_logits.append(model.decode_step(tgt[:, t], cache))
            cache.position += 1
        decoding_logits = torch.cat(decoding_logits)  # (3, V)
    assert training_logits.dtype == torch.bfloat16 and decoding_logits.dtype == torch.float32
    assert (decoding_logits != decoding_logits.bfloat16().float()).float().mean() > 0.5  # fp32, not bf16 cast
    torch.testing.assert_close(training_logits.float(), decoding_logits, atol=0.1, rtol=0.02)
    with torch.autocast("cpu", dtype=torch.float16):  # fp16's range: the projection stays fp32
        assert model(src, tgt).dtype == torch.float32


@pytest.mark.parametrize("attention, activation", [(None, None), (0.0, 0.0), (0.2, None)])
def test_attention_and_activation_dropout_default_to_model_dropout(attention, activation):
    cfg = ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.3, max_len=32,
                      attention_dropout=attention, activation_dropout=activation)
    model = Transformer(cfg, 50, 50, pad_id=0)
    expected_attention = 0.3 if attention is None else attention
    expected_activation = 0.3 if activation is None else activation
    for layer in (model.encoder_layers[0], model.decoder_layers[0]):
        assert layer.self_attn.dropout == expected_attention
        assert layer.ffn.dropout.p == expected_activation
        assert layer.ffn_block.dropout.p == 0.3  # sublayer outputs always use model.dropout
    assert model.decoder_layers[0].cross_attn.dropout == expected_attention
    assert model.embed_dropout.p == 0.3


# --- one forward: packed rows, padded positions, and incremental steps ------------------------------

def padded_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Three pairs padded to different source and target lengths (pads at the end)."""
    src = torch.tensor([[5, 6, 7, EOS, PAD, PAD], [4, 5, 6, 7, 8, EOS], [9, EOS, PAD, PAD, PAD, PAD]])
    tgt = torch.tensor([[BOS, 8, 9, PAD, PAD], [BOS, 4, 4, 4, 4], [BOS, 11, PAD, PAD, PAD]])
    return src, tgt


@pytest.mark.parametrize("overrides", [{"norm": "pre"}, {"norm": "post"},
                                       {"share_embeddings": False, "tie_output": False},
                                       {"encoder_layers": 3, "decoder_layers": 1}])
def test_packed_rows_give_the_padded_logits_at_real_positions(overrides):
    model = tiny_model(**overrides)
    src, tgt = padded_pairs()
    real = tgt != PAD
    packed = model(src, tgt)  # (N, V)
    assert packed.shape == (int(real.sum()), V)
    torch.testing.assert_close(packed, padded_logits(model, src, tgt)[real], atol=1e-5, rtol=1e-5)


def test_the_packed_loss_has_the_gradients_of_the_padded_loss():
    model = tiny_model(dropout=0.0).train()
    src, tgt = padded_pairs()
    real = tgt != PAD
    labels = torch.where(real, (tgt * 7 + 3) % (V - 4) + 4, PAD)  # some real token at each real position
    padded_loss = F.cross_entropy(model(src, tgt, pack=False), labels.flatten(), ignore_index=PAD,
                                  label_smoothing=0.1, reduction="sum")  # pads ignored by the loss
    padded_loss.backward()
    padded_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    packed_loss = F.cross_entropy(model(src, tgt), labels[real], label_smoothing=0.1, reduction="sum")
    packed_loss.backward()
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def sentence_pairs() -> list[tuple[list[int], list[int]]]:
    """Five pairs of different lengths, without special tokens."""
    return [([5, 6, 7], [8, 9]), ([4, 5, 6, 7, 8], [4, 4, 4, 4]), ([9], [11]), ([6, 6, 9, 4], [7, 8, 9, 10, 5, 6]),
            ([12, 13], [14, 15, 16])]


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels.flatten(), ignore_index=PAD, label_smoothing=0.1, reduction="sum")


def loss_and_grads(model: Transformer, batch, offsets=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    if offsets is None:  # padded: the real target rows
        loss = summed_loss(model(batch.src_ids, batch.tgt_in_ids), batch.tgt_out_ids[batch.tgt_in_ids != PAD])
    else:  # packed: every row, the filler's targets are pad
        loss = summed_loss(model(batch.src_ids, batch.tgt_in_ids, offsets=offsets), batch.tgt_out_ids)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("overrides", [{"norm": "pre"}, {"norm": "post", "share_embeddings": False,
                                                         "tie_output": False}])
def test_a_pack_computes_the_padded_batchs_loss_and_gradients(static, overrides):
    pairs = sentence_pairs()
    model = tiny_model(**overrides).train()  # dropout 0: the same sums in another order
    padded = make_batch([s for s, _ in pairs], [t for _, t in pairs], PAD, BOS, EOS)
    flat = [np.array([i for ids in seqs for i in ids]) for seqs in ([s for s, _ in pairs], [t for _, t in pairs])]
    lengths = [np.array([len(ids) for ids in seqs]) for seqs in ([s for s, _ in pairs], [t for _, t in pairs])]
    shape = PackShape(src_tokens=24, tgt_tokens=28, longest=8)  # tails of 4 and 7 filler tokens
    pack = make_pack_from_flat(flat[0], lengths[0], flat[1], lengths[1], shape, PAD, BOS, EOS, static=static)
    assert (pack.n_src_tokens, pack.n_tgt_tokens) == (padded.n_src_tokens, padded.n_tgt_tokens)
    assert len(pack.src_offsets) == (shape.slots + 1 if static else len(pairs) + 2)  # one filler piece per side
    expected_loss, expected = loss_and_grads(model, padded)
    loss, grads = loss_and_grads(model, pack, (pack.src_offsets, pack.tgt_offsets, pack.longest))
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pack_positions_restart_at_each_sentence_and_filler_pieces_fit_the_position_table():
    src = [[5, 6], [7], [8, 9, 10]]
    pack = make_pack_from_flat(np.array([i for s in src for i in s]), np.array([2, 1, 3]), np.array([4, 4, 4]),
                               np.array([1, 1, 1]), PackShape(src_tokens=20, tgt_tokens=16, longest=4), PAD, BOS, EOS)
    assert pack.src_ids[0, :9].tolist() == [5, 6, EOS, 7, EOS, 8, 9, 10, EOS]
    assert pack.tgt_in_ids[0, :6].tolist() == [BOS, 4, BOS, 4, BOS, 4]
    assert pack.tgt_out_ids[0, :6].tolist() == [4, EOS, 4, EOS, 4, EOS]
    # Tails of 11 source and 10 target tokens, in three pieces of at most 4 on each side.
    assert pack.src_offsets.tolist() == [0, 3, 5, 9, 13, 17, 20]
    assert pack.tgt_offsets.tolist() == [0, 2, 4, 6, 10, 13, 16]
    positions = Packing.packed(pack.src_offsets, 20, pack.longest).positions()
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]


def test_packed_attention_takes_flash_varlen_on_cuda_without_dropout_and_the_reference_elsewhere(monkeypatch):
    monkeypatch.setattr(transformer, "varlen_available", lambda: True)
    assert transformer.varlen_backend(torch.device("cuda"), 0.0) is transformer._flash_varlen
    assert transformer.varlen_backend(torch.device("cuda"), 0.1) is transformer._reference_varlen  # no dropout there
    assert transformer.varlen_backend(torch.device("cuda"), 0.0, torch.float32) is transformer._reference_varlen
    assert transformer.varlen_backend(torch.device("cpu"), 0.0) is transformer._reference_varlen
    monkeypatch.setattr(transformer, "varlen_available", lambda: False)
    assert transformer.varlen_backend(torch.device("cuda"), 0.0) is transformer._reference_varlen


@pytest.mark.parametrize("norm", ["pre", "post"])
@torch.no_grad()
def test_incremental_steps_on_the_static_cache_give_the_teacher_forced_logits(norm):
    model = tiny_model(norm=norm)
    src, tgt = padded_pairs()
    cache = model.new_cache(src, capacity=8)
    steps = []
    for t in range(tgt.shape[1]):
        steps.append(model.decode_step(tgt[:, t], cache))  # (B, V)
        cache.position += 1
    steps = torch.stack(steps, dim=1)  # (B, T, V)
    real = tgt != PAD
    torch.testing.assert_close(steps[real], model(src, tgt), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_cache_follows_reordered_and_selected_rows():
    model = tiny_model()
    src, tgt = padded_pairs()
    cache = model.new_cache(src, capacity=6, rows_per_sentence=2)  # rows 2b, 2b + 1: sentence b
    tokens = tgt.repeat_interleave(2, dim=0)  # (6, T)
    tokens[3] = torch.tensor([BOS, 20, 21, 22, 23])  # sentence 1's second beam reads other tokens
    for t in range(2):
        model.decode_step(tokens[:, t], cache)
        cache.position += 1
    cache.reorder(torch.tensor([0, 1, 2, 2, 4, 5]), written=2)  # its second beam continues the first
    kept = cache.select(torch.tensor([3]), written=2)  # that beam alone
    expected = model.new_cache(src[1:2], capacity=6)
    for t in range(2):
        model.decode_step(tgt[1:2, t], expected)
        expected.position += 1
    torch.testing.assert_close(model.decode_step(tgt[1:2, 2], kept), model.decode_step(tgt[1:2, 2], expected),
                               atol=1e-5, rtol=1e-5)


def test_one_function_builds_the_checkpoint_dict_that_loading_accepts(tmp_path):
    from transformer_mt.runs.checkpoint import checkpoint_state

    model = tiny_model()
    args = {"src_vocab_size": 30, "tgt_vocab_size": 30, "pad_id": 0}
    plain = checkpoint_state(model.state_dict(), {"seed": 3}, args)
    assert set(plain) == {"model", "config", "model_args", "format_version"}
    assert plain["format_version"] == FORMAT_VERSION and plain["model_args"] == args
    save_atomic(plain, tmp_path / "plain.pt")
    loaded = load_checkpoint(tmp_path / "plain.pt")
    assert set(loaded) == set(plain) and torch.equal(loaded["model"]["output_proj.weight"],
                                                     model.state_dict()["output_proj.weight"])
    full = checkpoint_state(model.state_dict(), {}, args, tokenizers="abc", ema={"model": model.state_dict()},
                            optimizer={"state": {}}, train_state={"step": 4})
    assert full["tokenizers"] == "abc" and full["ema"]["model"] is not None
    assert full["optimizer"] == {"state": {}} and full["train_state"] == {"step": 4}
    assert "ema" not in checkpoint_state({}, {}, {}, ema=None) and "tokenizers" not in checkpoint_state({}, {}, {})


# --- options a pretrained (Marian) model needs: activation, output bias, embedding scale -------------

@pytest.mark.parametrize("activation, function", [("relu", F.relu), ("gelu", F.gelu), ("swish", F.silu)])
def test_the_ffn_applies_the_configured_activation(activation, function):
    model = tiny_model(activation=activation)
    ffn = model.encoder_layers[0].ffn
    x = torch.randn(5, 16)
    torch.testing.assert_close(ffn(x), ffn.linear2(function(ffn.linear1(x))))
    assert ModelConfig().activation == "relu"


def test_an_output_bias_is_a_parameter_only_when_asked_and_adds_to_every_logit():
    plain, biased = tiny_model(seed=1), tiny_model(seed=1, output_bias=True)
    assert "output_proj.bias" not in plain.state_dict() and not ModelConfig().output_bias
    assert set(biased.state_dict()) == set(plain.state_dict()) | {"output_proj.bias"}
    assert biased.output_proj.bias.requires_grad and not biased.output_proj.bias.any()  # starts at zero
    biased.load_state_dict({**plain.state_dict(), "output_proj.bias": torch.randn(V)})
    src, tgt = padded_pairs()
    torch.testing.assert_close(padded_logits(biased, src, tgt), padded_logits(plain, src, tgt) + biased.output_proj.bias)
    with torch.no_grad():
        step = biased.decode_step(tgt[:, 0], biased.new_cache(src, 4))  # (B, V): incremental decoding too
    torch.testing.assert_close(step, padded_logits(biased, src, tgt)[:, 0])


def test_embeddings_are_scaled_by_sqrt_d_model_unless_scale_embedding_is_false():
    assert tiny_model().embed_scale == 4.0 and ModelConfig().scale_embedding
    assert tiny_model(scale_embedding=False).embed_scale == 1.0
