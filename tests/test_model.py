import pytest
import torch

from transformer_mt.config import ModelConfig
from transformer_mt.decoding import greedy_decode
from transformer_mt.model import Transformer

PAD, BOS, EOS, V = 0, 2, 3, 30


def tiny_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(**{"d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32, "dropout": 0.1, "max_len": 32,
                         **overrides})
    return Transformer(cfg, V, V, PAD).eval()


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_padding_does_not_change_real_positions(norm):
    model = tiny_model(norm=norm)
    src = torch.tensor([[5, 6, 7, EOS]])
    tgt = torch.tensor([[BOS, 8, 9]])
    alone = model(src, tgt)  # (1, 3, V)
    # The same pair inside a batch, padded on both sides by a longer neighbour.
    src_batch = torch.tensor([[5, 6, 7, EOS, PAD, PAD], [4, 5, 6, 7, 8, EOS]])
    tgt_batch = torch.tensor([[BOS, 8, 9, PAD, PAD], [BOS, 4, 4, 4, 4]])
    batched = model(src_batch, tgt_batch)  # (2, 5, V)
    torch.testing.assert_close(batched[0, :3], alone[0], atol=1e-5, rtol=1e-5)


def test_decoder_is_causal():
    model = tiny_model()
    src = torch.tensor([[5, 6, 7, EOS]])
    before = model(src, torch.tensor([[BOS, 8, 9, 10]]))
    after = model(src, torch.tensor([[BOS, 8, 20, 21]]))  # change positions 2 and 3 only
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
    query, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    weights = attention.attention_weights(query, memory, mask)  # (B, H, Tq, Tk)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 3))
    assert (weights[1, :, :, 3:] == 0).all()  # padding gets no attention
    _, v = attention.project_kv(memory)  # (B, H, Tk, Dh)
    mixed = (weights @ v).transpose(1, 2).reshape(2, 3, 16)
    torch.testing.assert_close(attention.out_proj(mixed), attention(query, memory, mask), atol=1e-5, rtol=1e-5)


def test_cross_attention_map_has_one_row_per_target_position():
    model = tiny_model()
    src, tgt = torch.tensor([[5, 6, 7, EOS, PAD]]), torch.tensor([[BOS, 8, 9]])
    weights = model.cross_attention(src, tgt, layer=-1)
    assert weights.shape == (1, 2, 3, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 3))
