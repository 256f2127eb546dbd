import os
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from tests.helpers import SOURCES, TARGETS, encode_pairs, make_run
from transformer_mt.core.errors import TmtError, UsageError
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID, TokenizerPair
from transformer_mt.export.ct2_conversion import export_ctranslate2
from transformer_mt.decode.generator import greedy_decode
from transformer_mt.runs.checkpoint import load_checkpoint, save_atomic

MAX_TOKENS = 5  # generation cap, EOS included: short enough that some outputs hit it


@pytest.fixture
def ct2():
    return pytest.importorskip("ctranslate2")


def src_tokens(tokenizers: TokenizerPair) -> list[list[str]]:
    return [encoding.tokens for encoding in tokenizers.src.encode_batch(SOURCES, add_special_tokens=False)]


def ct2_greedy(ct2, export_dir: Path, tokenizers) -> list[list[int]]:
    """CTranslate2's greedy translations of the test sources, as target ids."""
    translator = ct2.Translator(str(export_dir), device="cpu", intra_threads=1)
    # CTranslate2 forbids EOS as the first token unless min_decoding_length=0; tmt allows it.
    results = translator.translate_batch(src_tokens(tokenizers), beam_size=1, max_decoding_length=MAX_TOKENS,
                                         min_decoding_length=0)
    return [[tokenizers.tgt.token_to_id(token) for token in result.hypotheses[0]] for result in results]


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_ctranslate2_greedy_output_equals_tmt_greedy_output(ct2, tmp_path: Path, norm: str, share: bool):
    model, tokenizers = make_run(tmp_path / "run", norm, share)
    export_ctranslate2(tmp_path / "run", tmp_path / "ct2")

    src_ids, _, _ = encode_pairs(tokenizers)
    expected = greedy_decode(model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID, max_len_a=0, max_len_b=MAX_TOKENS)
    assert ct2_greedy(ct2, tmp_path / "ct2", tokenizers) == expected
    lengths = {len(ids) for ids in expected}
    assert MAX_TOKENS in lengths and min(lengths) < MAX_TOKENS - 1  # some hit the cap, some stop at EOS


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_deep_encoder_shallow_decoder_model_exports_with_each_sides_depth(ct2, tmp_path: Path, norm: str):
    model, tokenizers = make_run(tmp_path / "run", norm, True, encoder_layers=2, decoder_layers=1)
    assert (len(model.encoder_layers), len(model.decoder_layers)) == (2, 1)
    export_ctranslate2(tmp_path / "run", tmp_path / "ct2")

    src_ids, tgt_in_ids, tgt_out_ids = encode_pairs(tokenizers)
    expected = greedy_decode(model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID, max_len_a=0, max_len_b=MAX_TOKENS)
    assert ct2_greedy(ct2, tmp_path / "ct2", tokenizers) == expected
    with torch.no_grad():
        logits = model(src_ids, tgt_in_ids, pack=False).view(*tgt_in_ids.shape, -1)  # (B, T, V)
    logits[..., [PAD_ID, BOS_ID]] = torch.finfo(logits.dtype).min
    log_probs = torch.log_softmax(logits, dim=-1).gather(2, tgt_out_ids[..., None])[..., 0]  # (B, T)
    targets = [e.tokens for e in tokenizers.tgt.encode_batch(TARGETS, add_special_tokens=False)]
    translator = ct2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    for row, result in enumerate(translator.score_batch(src_tokens(tokenizers), targets)):
        assert result.log_probs == pytest.approx(log_probs[row, :len(targets[row]) + 1].tolist(), abs=1e-4)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_ctranslate2_scores_equal_tmt_log_probs(ct2, tmp_path: Path, norm: str, share: bool):
    model, tokenizers = make_run(tmp_path / "run", norm, share)
    export_ctranslate2(tmp_path / "run", tmp_path / "ct2")

    src_ids, tgt_in_ids, tgt_out_ids = encode_pairs(tokenizers)
    with torch.no_grad():
        logits = model(src_ids, tgt_in_ids, pack=False).view(*tgt_in_ids.shape, -1)  # (B, T, V)
    # tmt's search never emits padding or BOS; the export forbids them in the same way.
    logits[..., [PAD_ID, BOS_ID]] = torch.finfo(logits.dtype).min
    log_probs = torch.log_softmax(logits, dim=-1).gather(2, tgt_out_ids[..., None])[..., 0]  # (B, T)
    translator = ct2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    targets = [e.tokens for e in tokenizers.tgt.encode_batch(TARGETS, add_special_tokens=False)]
    results = translator.score_batch(src_tokens(tokenizers), targets)

    for row, result in enumerate(results):
        n = len(targets[row]) + 1  # target tokens and EOS
        assert result.log_probs == pytest.approx(log_probs[row, :n].tolist(), abs=1e-4)


def test_a_checkpoint_with_an_ema_exports_its_ema_weights(ct2, tmp_path: Path):
    model, tokenizers = make_run(tmp_path / "run", "pre", True)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    state = load_checkpoint(best)
    # The briefly trained weights as the EMA (train.ema_decay), zeros as the trained weights.
    state["ema"] = {"decay": 0.9, "updates": 20, "model": state["model"]}
    state["model"] = {name: torch.zeros_like(tensor) for name, tensor in state["model"].items()}
    save_atomic(state, best)
    export_ctranslate2(tmp_path / "run", tmp_path / "ct2")

    src_ids, _, _ = encode_pairs(tokenizers)
    expected = greedy_decode(model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID, max_len_a=0, max_len_b=MAX_TOKENS)
    assert len({tuple(ids) for ids in expected}) > 1  # zero weights would give every sentence one output
    assert ct2_greedy(ct2, tmp_path / "ct2", tokenizers) == expected


def test_int8_export_is_smaller_and_translates(ct2, tmp_path: Path):
    _, tokenizers = make_run(tmp_path / "run", "pre", True)
    export_ctranslate2(tmp_path / "run", tmp_path / "fp32")
    export_ctranslate2(tmp_path / "run", tmp_path / "int8", quantization="int8")
    assert (tmp_path / "int8" / "model.bin").stat().st_size < (tmp_path / "fp32" / "model.bin").stat().st_size
    translator = ct2.Translator(str(tmp_path / "int8"), device="cpu", intra_threads=1)
    results = translator.translate_batch(src_tokens(tokenizers), beam_size=1, max_decoding_length=MAX_TOKENS)
    for result in results:
        hypothesis = result.hypotheses[0]
        assert len(hypothesis) <= MAX_TOKENS
        assert all(tokenizers.tgt.token_to_id(token) not in (None, PAD_ID, BOS_ID) for token in hypothesis)


def test_export_without_ctranslate2_says_how_to_install_it(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # makes `import ctranslate2...` fail
    with pytest.raises(TmtError, match="pip install ctranslate2"):
        export_ctranslate2(tmp_path / "run", tmp_path / "ct2")


def test_export_refuses_a_non_empty_output_directory(ct2, tmp_path: Path):
    make_run(tmp_path / "run", "pre", True)
    (tmp_path / "ct2").mkdir()
    (tmp_path / "ct2" / "keep.txt").write_text("user data")
    with pytest.raises(UsageError, match="not an empty directory"):
        export_ctranslate2(tmp_path / "run", tmp_path / "ct2")
    assert (tmp_path / "ct2" / "keep.txt").read_text() == "user data"


def test_export_refuses_an_output_under_a_file_or_the_current_directory(ct2, tmp_path: Path, monkeypatch):
    make_run(tmp_path / "run", "pre", True)
    (tmp_path / "in.txt").write_text("user data")
    with pytest.raises(UsageError, match="in.txt/sub: .*in.txt is not a directory"):
        export_ctranslate2(tmp_path / "run", tmp_path / "in.txt" / "sub")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    with pytest.raises(UsageError, match="--output . is the current directory"):
        export_ctranslate2(tmp_path / "run", Path("."))
    assert (tmp_path / "in.txt").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "in.txt", "run"]
    assert not any((tmp_path / "empty").iterdir())


def test_export_leaves_a_users_folder_named_like_its_temp_folder_alone(ct2, tmp_path: Path):
    make_run(tmp_path / "run", "pre", True)
    (tmp_path / ".ct2.tmp").mkdir()  # the name the export once wrote through, and removed
    (tmp_path / ".ct2.tmp" / "keep.txt").write_text("user data")
    export_ctranslate2(tmp_path / "run", tmp_path / "ct2")
    assert (tmp_path / ".ct2.tmp" / "keep.txt").read_text() == "user data"
    assert (tmp_path / "ct2" / "model.bin").is_file()
    # Its own temp folder is gone, renamed to ct2, and had the usual permissions, not mkdtemp's 0700.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ct2.tmp", "ct2", "run"]
    assert (tmp_path / "ct2").stat().st_mode & 0o777 == 0o777 & ~_umask()


def test_an_export_stopped_midway_leaves_no_temp_folder(ct2, tmp_path: Path, monkeypatch):
    from ctranslate2.specs import model_spec

    make_run(tmp_path / "run", "pre", True)

    def interrupted(self, output_dir):
        (Path(output_dir) / "model.bin").write_bytes(b"half")  # part of the model written
        raise KeyboardInterrupt  # Ctrl-C; CTranslate2's own errors are not OSErrors either

    monkeypatch.setattr(model_spec.ModelSpec, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_ctranslate2(tmp_path / "run", tmp_path / "ct2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_unknown_quantization_lists_the_valid_choices(ct2, tmp_path: Path):
    with pytest.raises(UsageError, match="int8_float16"):
        export_ctranslate2(tmp_path / "run", tmp_path / "ct2", quantization="int3")


def test_a_source_longer_than_max_len_translates_and_cuts_as_tmt_does(ct2, tmp_path: Path):
    model, tokenizers = make_run(tmp_path / "run", "pre", True)
    export_ctranslate2(tmp_path / "run", tmp_path / "ct2")
    max_len = model.cfg.max_len
    long_source = tokenizers.src.encode(" ".join(SOURCES * 20), add_special_tokens=False).tokens  # (> max_len)
    assert len(long_source) > 2 * max_len
    translator = ct2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)

    # CTranslate2's defaults (inputs up to 1,024 tokens) must not run past the position table.
    translator.translate_batch([long_source], beam_size=1, max_decoding_length=MAX_TOKENS)
    # max_input_length = max_len cuts the source as tmt does: max_len - 1 tokens, then EOS.
    cut_ids = [tokenizers.src.token_to_id(token) for token in long_source[: max_len - 1]] + [EOS_ID]
    expected = greedy_decode(model, torch.tensor([cut_ids]), bos_id=BOS_ID, eos_id=EOS_ID, max_len_a=0,
                             max_len_b=MAX_TOKENS)
    result = translator.translate_batch([long_source], beam_size=1, max_decoding_length=MAX_TOKENS,
                                        min_decoding_length=0, max_input_length=max_len)[0]
    assert [tokenizers.tgt.token_to_id(token) for token in result.hypotheses[0]] == expected[0]


def test_the_documented_tokenizer_recipe_keeps_special_token_strings_as_text(ct2, tmp_path: Path):
    _, tokenizers = make_run(tmp_path / "run", "pre", False)
    export_ctranslate2(tmp_path / "run", tmp_path / "ct2")
    text = "Grazie </s> mille <s> <pad>"
    exported = Tokenizer.from_file(str(tmp_path / "ct2" / "tokenizer.src.json"))
    exported.encode_special_tokens = True  # the export's docstring: the file cannot hold this flag
    tokens = exported.encode(text, add_special_tokens=False).tokens
    assert [exported.token_to_id(token) for token in tokens] == tokenizers.encode_src([text])[0]
    assert not {"</s>", "<s>", "<pad>"} & set(tokens)


@pytest.mark.parametrize("fmt", ["ctranslate2", "hf"])
def test_an_export_into_a_run_being_trained_is_refused_before_its_checkpoints_are_read(ct2, tmp_path: Path,
                                                                                     monkeypatch, fmt):
    # The trainer deletes old step checkpoints as it goes: reading one first could fail on a file
    # that vanished, instead of saying that the run is in use.
    from transformer_mt.export import ct2_conversion, hf_export
    from transformer_mt.runs.run_dir import RunLock

    make_run(tmp_path / "run", "post", True)
    module, export = (ct2_conversion, export_ctranslate2) if fmt == "ctranslate2" else (hf_export, hf_export.export_hf)
    monkeypatch.setattr(module, "load_run", lambda *args: pytest.fail("read the run's checkpoint"))
    with RunLock.acquire(tmp_path / "run", "tmt train"):
        with pytest.raises(UsageError, match="is in use by tmt train"):
            export(tmp_path / "run", tmp_path / "run" / "exported")
    assert not (tmp_path / "run" / "exported").exists()


@pytest.mark.parametrize("model", [{"activation": "swish", "output_bias": True},
                                   {"activation": "gelu", "output_bias": True, "scale_embedding": False}],
                         ids=["swish-bias", "gelu-bias-unscaled"])
def test_model_options_convert_to_ctranslate2_and_decode_as_tmt(ct2, tmp_path: Path, model: dict):
    tmt_model, tokenizers = make_run(tmp_path / "run", "post", True, **model)
    assert tmt_model.output_proj.bias.abs().min() > 0  # perturbed: a dropped bias would change the outputs
    export_ctranslate2(tmp_path / "run", tmp_path / "ct2")
    src_ids, _, _ = encode_pairs(tokenizers)
    expected = greedy_decode(tmt_model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID, max_len_a=0, max_len_b=MAX_TOKENS)
    assert ct2_greedy(ct2, tmp_path / "ct2", tokenizers) == expected
