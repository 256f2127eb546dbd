"""A Marian (OPUS-MT) model folder read into tmt's Transformer computes what transformers' MarianMTModel
computes, decodes as its `generate` does, and exports back (Hugging Face, CTranslate2) unchanged."""

import json
from pathlib import Path

import pytest
import torch

from transformer_mt.config.schema import Config
from transformer_mt.core.errors import TmtError
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
from transformer_mt.decode.generator import greedy_decode
from transformer_mt.export.ct2_conversion import build_ctranslate2_spec
from transformer_mt.export.hf_export import hf_config, hf_state_dict
from transformer_mt.pretrained.marian import read_marian

transformers = pytest.importorskip("transformers")

V, EOS, UNK, PAD = 100, 0, 1, 99  # OPUS-MT's layout: </s> 0, <unk> 1, <pad> last and the decoder start
CAP = 7  # generated tokens at most (EOS included in tmt's cap, not in generate's max_new_tokens)


def marian_config(**overrides):
    settings = dict(vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                    activation_function="swish", max_position_embeddings=64, scale_embedding=True,
                    pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, forced_eos_token_id=None,
                    dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, init_std=0.1)
    return transformers.MarianConfig(**{**settings, **overrides})


def random_marian(seed: int = 0, **overrides):
    """A MarianMTModel with random weights, perturbed layer norms and a non-zero final_logits_bias."""
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(marian_config(**overrides))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "layer_norm" in name:
                tensor.copy_(torch.randn_like(tensor) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
        embeddings = (model.model.shared, model.model.encoder.embed_tokens, model.model.decoder.embed_tokens)
        for weight in {id(e.weight): e.weight for e in embeddings}.values():  # one when tied
            weight.normal_(0, 0.1)
        model.final_logits_bias.normal_(0, 0.3)
        model.final_logits_bias[0, EOS] += 2.0  # some greedy translations end before the cap, some at it
    return model.eval()


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    folder = tmp_path_factory.mktemp("marian") / "opus-mt-test"
    model = random_marian()
    model.save_pretrained(folder)
    return folder, model


def sources(n: int = 6, seed: int = 1) -> list[list[int]]:
    """Marian ids of n sources of different lengths, each ending with </s>."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, PAD, (3 + 2 * i,), generator=generator).tolist() + [EOS] for i in range(n)]


def padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), pad)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row)
    return out


def to_tmt(rows: list[list[int]], vocab) -> list[list[int]]:
    ids = vocab.tmt_ids()
    return [[ids[m] for m in row] for row in rows]


def test_tmt_computes_the_marian_models_log_probs_on_a_padded_batch(marian):
    folder, hf = marian
    imported = read_marian(folder)
    model = imported.build()
    assert imported.config.activation == "swish" and imported.config.output_bias and imported.config.norm == "post"
    src = sources()
    tgt = [row[1:] for row in sources(seed=2)]  # target inputs after the decoder start
    with torch.no_grad():
        hf_logits = hf(input_ids=padded(src, PAD), attention_mask=padded(src, PAD) != PAD,
                       decoder_input_ids=padded([[PAD] + row for row in tgt], PAD)).logits  # (B, T, V)
        tgt_in = padded([[BOS_ID] + row for row in to_tmt(tgt, imported.vocab)], PAD_ID)
        logits = model(padded(to_tmt(src, imported.vocab), PAD_ID), tgt_in, pack=False).view(*tgt_in.shape, -1)
    real = tgt_in != PAD_ID
    rows = torch.tensor(imported.vocab.rows)
    torch.testing.assert_close(logits[real], hf_logits[real][:, rows], atol=1e-4, rtol=0)
    # Log-probs as search sees them: no padding (Marian: its pad row; tmt: PAD and BOS, two ids of that row).
    hf_logits[..., PAD] = float("-inf")
    logits[..., [PAD_ID, BOS_ID]] = float("-inf")
    allowed = torch.ones(len(rows), dtype=torch.bool)
    allowed[[PAD_ID, BOS_ID]] = False
    torch.testing.assert_close(logits[real].log_softmax(-1)[:, allowed],
                               hf_logits[real].log_softmax(-1)[:, rows[allowed]], atol=1e-5, rtol=0)


def test_tmt_greedy_decoding_equals_generate(marian):
    folder, hf = marian
    imported = read_marian(folder)
    src = sources(8)
    with torch.no_grad():
        out = hf.generate(input_ids=padded(src, PAD), attention_mask=padded(src, PAD) != PAD, num_beams=1,
                          do_sample=False, max_new_tokens=CAP, bad_words_ids=[[PAD]])
    expected = []
    for row in out[:, 1:].tolist():  # after the decoder start
        expected.append(row[:row.index(EOS)] if EOS in row else row)
    got = greedy_decode(imported.build(), padded(to_tmt(src, imported.vocab), PAD_ID), bos_id=BOS_ID,
                        eos_id=EOS_ID, max_len_a=0, max_len_b=CAP)
    assert got == to_tmt(expected, imported.vocab)
    lengths = {len(ids) for ids in got}
    assert CAP in lengths and min(lengths) < CAP - 1  # some hit the cap, some stop at EOS


def test_the_hf_export_of_an_imported_model_computes_the_original(marian, tmp_path: Path):
    from safetensors.torch import save_file

    folder, hf = marian
    imported = read_marian(folder)
    model = imported.build()
    config = hf_config(model, Config(model=imported.config))
    assert config["activation_function"] == "swish"
    save_file(hf_state_dict(model), tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    exported = transformers.MarianMTModel.from_pretrained(tmp_path).eval()

    src = sources()
    tgt = [row[1:] for row in sources(seed=3)]
    with torch.no_grad():
        hf_logits = hf(input_ids=padded(src, PAD), attention_mask=padded(src, PAD) != PAD,
                       decoder_input_ids=padded([[PAD] + row for row in tgt], PAD)).logits
        tmt_src = padded(to_tmt(src, imported.vocab), PAD_ID)
        tgt_in = padded([[BOS_ID] + row for row in to_tmt(tgt, imported.vocab)], PAD_ID)
        logits = exported(input_ids=tmt_src, attention_mask=tmt_src != PAD_ID, decoder_input_ids=tgt_in).logits
    real = tgt_in != PAD_ID
    allowed = torch.ones(len(imported.vocab), dtype=torch.bool)
    allowed[[PAD_ID, BOS_ID]] = False
    rows = torch.tensor(imported.vocab.rows)
    torch.testing.assert_close(logits[real][:, allowed], hf_logits[real][:, rows[allowed]], atol=1e-4, rtol=0)
    assert (logits[real][:, ~allowed] < -1000).all()  # padding and BOS forbidden, as in tmt's search


def test_the_ctranslate2_conversion_of_an_imported_model_decodes_as_torch(marian, tmp_path: Path):
    ct2 = pytest.importorskip("ctranslate2")
    folder, _ = marian
    imported = read_marian(folder)
    model = imported.build()
    spec = build_ctranslate2_spec(model)
    tokens = ["<blank>", "<unk>", "<s>", "</s>"] + [f"p{t}" for t in range(4, len(imported.vocab))]
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    spec.validate()
    spec.optimize()
    (tmp_path / "ct2").mkdir()
    spec.save(str(tmp_path / "ct2"))

    src = to_tmt(sources(8), imported.vocab)
    expected = greedy_decode(model, padded(src, PAD_ID), bos_id=BOS_ID, eos_id=EOS_ID, max_len_a=0, max_len_b=CAP)
    translator = ct2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    results = translator.translate_batch([[tokens[t] for t in row[:-1]] for row in src],  # CT2 appends EOS
                                         beam_size=1, max_decoding_length=CAP, min_decoding_length=0)
    assert [[tokens.index(token) for token in result.hypotheses[0]] for result in results] == expected


def test_a_pytorch_model_bin_folder_reads_as_the_safetensors_one(marian, tmp_path: Path):
    folder, hf = marian
    (tmp_path / "config.json").write_text((folder / "config.json").read_text(encoding="utf-8"), encoding="utf-8")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    a, b = read_marian(folder), read_marian(tmp_path)
    assert a.config == b.config and a.vocab == b.vocab
    assert a.state.keys() == b.state.keys()
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def test_untied_output_and_gelu_read_as_such(tmp_path: Path):
    hf = random_marian(seed=4, tie_word_embeddings=False, activation_function="gelu", scale_embedding=False)
    with torch.no_grad():
        hf.lm_head.weight.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    imported = read_marian(tmp_path)
    assert not imported.config.tie_output and imported.config.activation == "gelu"
    assert not imported.config.share_embeddings  # transformers 5 unties each side's embedding too
    assert not imported.config.scale_embedding
    model = imported.build()
    src, tgt = sources(3), [row[1:] for row in sources(3, seed=5)]
    with torch.no_grad():
        hf_logits = hf(input_ids=padded(src, PAD), attention_mask=padded(src, PAD) != PAD,
                       decoder_input_ids=padded([[PAD] + row for row in tgt], PAD)).logits
        tgt_in = padded([[BOS_ID] + row for row in to_tmt(tgt, imported.vocab)], PAD_ID)
        logits = model(padded(to_tmt(src, imported.vocab), PAD_ID), tgt_in, pack=False).view(*tgt_in.shape, -1)
    real = tgt_in != PAD_ID
    torch.testing.assert_close(logits[real], hf_logits[real][:, list(imported.vocab.rows)], atol=1e-4, rtol=0)


def edited(marian, tmp_path: Path, **changes) -> Path:
    """A copy of the Marian folder whose config.json has `changes` (None: the key removed)."""
    folder, _ = marian
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    target = tmp_path / "edited"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (target / "model.safetensors").symlink_to(folder / "model.safetensors")
    return target


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "bart"}, r"model_type 'bart' .*only Marian"),
    ({"model_type": "m2m_100"}, r"M2M100 and NLLB models are not supported yet"),
    ({"model_type": "nllb_moe"}, r"M2M100 and NLLB models are not supported yet"),
    ({"normalize_before": True}, r"normalize_before: true .*pre-norm"),
    ({"share_encoder_decoder_embeddings": False}, r"share_encoder_decoder_embeddings: false"),
    ({"activation_function": "tanh"}, r"activation_function 'tanh' .*relu, gelu, swish"),
    ({"decoder_ffn_dim": 256}, r"encoder_ffn_dim 128 and decoder_ffn_dim 256"),
    ({"model_type": None}, r"no model_type"),
    ({"d_model": "64"}, r"d_model: '64' is not an integer"),
    ({"eos_token_id": [0, 5]}, r"eos_token_id: \[0, 5\] is not an integer"),
    ({"scale_embedding": 1}, r"scale_embedding: 1 is not true or false"),
    ({"encoder_attention_heads": 5, "decoder_attention_heads": 5}, r"model.n_heads: 5 does not divide"),
])
def test_what_tmt_cannot_compute_is_refused_in_one_line_naming_it(marian, tmp_path: Path, changes, message):
    folder = edited(marian, tmp_path, **changes)
    with pytest.raises(TmtError, match=message) as refused:
        read_marian(folder)
    assert "\n" not in str(refused.value) and str(folder / "config.json") in str(refused.value)


def test_missing_files_are_refused_in_one_line_naming_them(marian, tmp_path: Path):
    with pytest.raises(TmtError, match=r"no config.json") as refused:
        read_marian(tmp_path)
    assert str(tmp_path) in str(refused.value)
    with pytest.raises(TmtError, match=r"not a folder"):
        read_marian(tmp_path / "absent")
    folder = edited(marian, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(TmtError, match=r"no model.safetensors or pytorch_model.bin"):
        read_marian(folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(TmtError, match=r"model.safetensors: not readable") as refused:
        read_marian(folder)
    assert "\n" not in str(refused.value)


def test_weights_that_do_not_fit_the_config_are_refused_naming_the_tensor(marian, tmp_path: Path):
    folder = edited(marian, tmp_path, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4)
    with pytest.raises(TmtError, match=r"model.safetensors: .*model.shared.weight has shape") as refused:
        read_marian(folder)
    assert "\n" not in str(refused.value)


def test_a_vocab_json_beside_the_model_gives_unks_id_and_must_agree_with_the_config(marian, tmp_path: Path):
    folder = edited(marian, tmp_path)
    pieces = {"</s>": EOS, "<unk>": 2, **{f"p{i}": i for i in range(3, PAD)}, "<pad>": PAD, "p1": 1}
    (folder / "vocab.json").write_text(json.dumps(pieces), encoding="utf-8")
    assert read_marian(folder).vocab.unk == 2
    (folder / "vocab.json").write_text(json.dumps({**pieces, "<pad>": 5}), encoding="utf-8")
    with pytest.raises(TmtError, match=r"vocab.json: '<pad>' is id 5, where config.json has pad_token_id 99"):
        read_marian(folder)
