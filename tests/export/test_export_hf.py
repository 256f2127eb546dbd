import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, SOURCES, encode_pairs, make_run, run_cli
from transformer_mt.core.errors import UsageError
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
from transformer_mt.decode.generator import greedy_decode, max_target_lengths
from transformer_mt.decode.hypotheses import length_caps
from transformer_mt.export.hf_export import export_hf
from transformer_mt.decode.translator import Translator
from transformer_mt.runs.checkpoint import load_checkpoint, save_atomic

# Short caps, so that some translations end at their cap and others with EOS before it.
CAP = {"max_len_a": 0.5, "max_len_b": 2}
DEMO_TEST = REPO / "transformer_mt" / "corpora" / "demo_en_it" / "test.en"


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture
def hf_dir(tmp_path: Path, request) -> Path:
    """The export's folder, named for the test."""
    return tmp_path / re.sub(r"\W", "_", request.node.name)


def load_folder(transformers, folder: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder)
    return tokenizer, model.eval()


def tmt_translate(run_dir: Path, beam: int, lines: list[str] = SOURCES, engine: str = "torch", **decode) -> list[str]:
    translator = Translator.from_run(run_dir, device="cpu", engine=engine)
    translator.set_decoding(**decode)
    return translator.translate(lines, beam_size=beam)


def hf_translate(tokenizer, model, beam: int | None, lines: list[str] = SOURCES, *, max_len_a: float,
                 max_len_b: int, **generate) -> list[str]:
    """The folder's stock `generate` (`beam` None: the folder's `num_beams`) with tmt's cap of each
    sentence, a·S + b tokens: one call per cap (`max_length`: the start token and the cap), as the CTranslate2 engine decodes."""
    sources = tokenizer(lines, truncation=True).input_ids
    caps = length_caps([len(ids) for ids in sources], max_len_a, max_len_b, model.config.max_position_embeddings)
    beams = {} if beam is None else {"num_beams": beam}
    translations = [""] * len(lines)
    for cap in set(caps):
        members = [i for i, c in enumerate(caps) if c == cap]
        batch = tokenizer.pad({"input_ids": [sources[i] for i in members]}, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**batch, max_length=cap + 1, **beams, **generate)  # the start token, then cap
        for i, text in zip(members, tokenizer.batch_decode(ids, skip_special_tokens=True)):
            translations[i] = text
    return translations


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("beam", [1, 4])
def test_transformers_generate_equals_tmt_translate(transformers, tmp_path: Path, hf_dir: Path, norm: str, beam: int):
    make_run(tmp_path / "run", norm, True)
    export_hf(tmp_path / "run", hf_dir)
    tokenizer, model = load_folder(transformers, hf_dir)
    assert type(model).__name__ == {"pre": "PegasusForConditionalGeneration", "post": "MarianMTModel"}[norm]

    for alpha in (1.0, 2.0):  # the default, and one that ranks long hypotheses far higher
        expected = tmt_translate(tmp_path / "run", beam, length_penalty=alpha, **CAP)
        assert hf_translate(tokenizer, model, beam, length_penalty=alpha, early_stopping=True, **CAP) == expected
    assert len(set(expected)) > 1


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_the_batch_compared_ends_both_at_caps_and_before(tmp_path: Path, norm: str):
    model, tokenizers = make_run(tmp_path / "run", norm, True)
    src_ids, _, _ = encode_pairs(tokenizers)
    caps = max_target_lengths(src_ids != PAD_ID, CAP["max_len_a"], CAP["max_len_b"], model.cfg.max_len).tolist()
    outputs = greedy_decode(model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID, **CAP)
    at_cap = [len(ids) == cap for ids, cap in zip(outputs, caps)]  # no EOS within the cap
    assert any(at_cap) and not all(at_cap)


def test_the_exported_network_computes_tmts_log_probs(hf_dir: Path, transformers, tmp_path: Path):
    model, tokenizers = make_run(tmp_path / "run", "post", True)
    export_hf(tmp_path / "run", hf_dir)
    _, hf_model = load_folder(transformers, hf_dir)
    src_ids, tgt_in_ids, _ = encode_pairs(tokenizers)
    with torch.no_grad():
        logits = model(src_ids, tgt_in_ids, pack=False).view(*tgt_in_ids.shape, -1)  # (B, T, V)
        hf_logits = hf_model(input_ids=src_ids, attention_mask=src_ids != PAD_ID, decoder_input_ids=tgt_in_ids).logits
    real = tgt_in_ids != PAD_ID
    logits[..., [PAD_ID, BOS_ID]] = torch.finfo(logits.dtype).min  # what tmt's search never emits
    log_probs, hf_log_probs = logits.log_softmax(-1)[real], hf_logits.log_softmax(-1)[real]  # (N, V)
    allowed = torch.ones(log_probs.shape[1], dtype=torch.bool)
    allowed[[PAD_ID, BOS_ID]] = False
    torch.testing.assert_close(hf_log_probs[:, allowed], log_probs[:, allowed], atol=1e-5, rtol=0)
    assert (hf_log_probs[:, ~allowed] < -1000).all()


@pytest.mark.parametrize("norm, model", [("post", {"share_embeddings": False}), ("post", {"tie_output": False}),
                                         ("pre", {"tie_output": False})],
                         ids=["post-unshared", "post-untied", "pre-untied"])
def test_untied_embeddings_export_and_translate_as_tmt(transformers, tmp_path: Path, hf_dir: Path, norm: str,
                                                       model: dict):
    make_run(tmp_path / "run", norm, True, **model)
    export_hf(tmp_path / "run", hf_dir)
    tokenizer, hf_model = load_folder(transformers, hf_dir)
    output, tgt, src = (hf_model.lm_head.weight, hf_model.model.decoder.embed_tokens.weight,
                        hf_model.model.encoder.embed_tokens.weight)
    assert torch.equal(output, tgt) == model.get("tie_output", True)
    assert torch.equal(tgt, src) == model.get("share_embeddings", True)
    assert hf_translate(tokenizer, hf_model, 1, **CAP) == tmt_translate(tmp_path / "run", 1, **CAP)


def test_the_folder_encodes_and_cuts_sources_as_tmt_does(hf_dir: Path, transformers, tmp_path: Path):
    _, tokenizers = make_run(tmp_path / "run", "pre", True)
    export_hf(tmp_path / "run", hf_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert type(tokenizer).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    special = tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    assert special == (PAD_ID, 1, BOS_ID, EOS_ID)
    text = "Grazie </s> mille <s> <pad>"  # special tokens' strings typed in a sentence stay text
    assert tokenizer(text).input_ids == tokenizers.encode_src([text])[0] + [EOS_ID]
    long_text = " ".join(SOURCES * 20)
    max_len = json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"]
    cut = tokenizers.encode_src([long_text])[0][:max_len - 1] + [EOS_ID]
    assert tokenizer(long_text, truncation=True).input_ids == cut
    ids = tokenizers.encode_tgt(["Buongiorno a tutti."])[0]
    assert tokenizer.decode(ids + [EOS_ID], skip_special_tokens=True) == tokenizers.decode_tgt([ids])[0]


def test_a_model_card_from_the_runs_summary(hf_dir: Path, transformers, workdir: Path, tmp_path: Path):
    run_dir = workdir / "runs" / "tiny"
    summary = json.loads((run_dir / "summary.json").read_text())
    export_hf(run_dir, hf_dir)
    card = (hf_dir / "README.md").read_text()
    test = summary["test"]
    for fact in (f"{test['bleu']:.2f}", test["bleu_signature"], f"{test['chrf']:.2f}", test["chrf_signature"],
                 summary["provenance"]["device"], f"{summary['parameters']:,}",
                 f"{summary['data']['pairs']['train']:,} train",
                 "en → it", "PegasusForConditionalGeneration", "truncation=True"):
        assert fact in card
    minutes, seconds = divmod(round(summary["train_seconds"]), 60)
    assert f"{minutes} min {seconds} s of training" in card
    assert card.startswith("---\nlibrary_name: transformers\n")


def test_the_cli_exports_hf_and_refuses_what_it_cannot(transformers, tmp_path: Path, monkeypatch, capsys):
    make_run(tmp_path / "run", "pre", True)
    code, _, err = run_cli(["export", "--format", "hf", "--run", "run", "--output", "hf"], monkeypatch, capsys,
                           tmp_path)
    assert code == 0, err
    out = tmp_path / "hf"
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert names == {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "README.md"}
    before = sorted(p.name for p in out.iterdir())
    code, _, err = run_cli(["export", "--format", "hf", "--run", "run", "--output", "hf"], monkeypatch, capsys,
                           tmp_path)
    assert code == 2
    assert err.strip().endswith("hf already exists and is not an empty directory; choose another --output")
    assert sorted(p.name for p in out.iterdir()) == before
    code, _, err = run_cli(["export", "--format", "hf", "--run", "run", "--output", "int8", "--quantization", "int8"],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and "--quantization is for --format ctranslate2" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "int8").exists()
    code, _, err = run_cli(["export", "--run", "run", "--output", "ct2"], monkeypatch, capsys, tmp_path)
    assert code == 0 and (tmp_path / "ct2" / "model.bin").is_file(), err  # CTranslate2 stays the default


@pytest.mark.parametrize("norm, share, setting", [("post", False, "tokenizer.joint: false"),
                                                  ("pre", False, "tokenizer.joint: false")])
def test_separate_vocabularies_are_refused_naming_the_setting(tmp_path: Path, hf_dir: Path, norm: str, share: bool,
                                                             setting: str):
    make_run(tmp_path / "run", norm, share)
    with pytest.raises(UsageError, match=setting):
        export_hf(tmp_path / "run", hf_dir)
    assert not hf_dir.exists()


def test_pre_norm_with_unshared_embeddings_is_refused_naming_the_setting(hf_dir: Path, tmp_path: Path):
    make_run(tmp_path / "run", "pre", True, share_embeddings=False)
    with pytest.raises(UsageError, match="model.share_embeddings: false .* model.norm: pre"):
        export_hf(tmp_path / "run", hf_dir)
    assert not hf_dir.exists()


def test_an_export_stopped_midway_leaves_no_temp_folder(hf_dir: Path, tmp_path: Path, monkeypatch):
    import safetensors.torch

    make_run(tmp_path / "run", "post", True)

    def interrupted(tensors, metadata=None):
        raise KeyboardInterrupt  # Ctrl-C while the weights are serialised

    monkeypatch.setattr(safetensors.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_hf(tmp_path / "run", hf_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_export_refuses_the_current_directory_and_a_path_under_a_file(tmp_path: Path, monkeypatch):
    make_run(tmp_path / "run", "post", True)
    (tmp_path / "in.txt").write_text("user data")
    with pytest.raises(UsageError, match="in.txt/sub: .*in.txt is not a directory"):
        export_hf(tmp_path / "run", tmp_path / "in.txt" / "sub")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    with pytest.raises(UsageError, match="--output . is the current directory"):
        export_hf(tmp_path / "run", Path("."))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "in.txt", "run"]


def test_a_checkpoint_with_an_ema_exports_its_ema_weights(hf_dir: Path, transformers, tmp_path: Path):
    make_run(tmp_path / "run", "pre", True)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    state = load_checkpoint(best)
    # The briefly trained weights as the EMA (train.ema_decay), zeros as the trained weights.
    state["ema"] = {"decay": 0.9, "updates": 20, "model": state["model"]}
    state["model"] = {name: torch.zeros_like(tensor) for name, tensor in state["model"].items()}
    save_atomic(state, best)
    export_hf(tmp_path / "run", hf_dir)
    tokenizer, model = load_folder(transformers, hf_dir)
    expected = tmt_translate(tmp_path / "run", 1, **CAP)
    assert len(set(expected)) > 1  # zero weights would give every sentence one output
    assert hf_translate(tokenizer, model, 1, **CAP) == expected


def test_generate_on_a_source_cut_as_tmt_cuts_it_translates_as_tmt(hf_dir: Path, transformers, tmp_path: Path):
    model, _ = make_run(tmp_path / "run", "post", True)
    export_hf(tmp_path / "run", hf_dir)
    tokenizer, hf_model = load_folder(transformers, hf_dir)
    lines = [" ".join(SOURCES * 20), SOURCES[0]]  # the first over max_len tokens, cut by the tokenizer
    assert len(tokenizer(lines[0]).input_ids) > 2 * model.cfg.max_len
    decode = {"max_len_a": 1.5, "max_len_b": 10, "length_penalty": 1.0}
    expected = tmt_translate(tmp_path / "run", 4, lines, **decode)
    assert hf_translate(tokenizer, hf_model, 4, lines, early_stopping=True, **decode) == expected


def test_beam_search_is_identical_on_torch_ctranslate2_and_the_folders_stock_generate(hf_dir: Path, transformers,
                                                                                      tmp_path: Path):
    # One rule on the three: of each step's 2K best continuations by log-prob, the top K that end are
    # set aside, scored log-prob / length^α (length: generated tokens with the EOS); a sentence is done
    # once K have ended (transformers' early_stopping=True), or at its cap. The folder's
    # generation_config.json (4 beams, α, early_stopping) asks transformers for it.
    pytest.importorskip("ctranslate2")
    make_run(tmp_path / "run", "post", True)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    state = load_checkpoint(best)
    state["config"]["decode"].update(beam_size=4)
    save_atomic(state, best)
    export_hf(tmp_path / "run", hf_dir)
    tokenizer, model = load_folder(transformers, hf_dir)
    lines = DEMO_TEST.read_text(encoding="utf-8").splitlines()
    decode = {"max_len_a": 1.5, "max_len_b": 10}  # the run's
    greedy = tmt_translate(tmp_path / "run", 1, lines, **decode)
    for beam in (4, 5):
        on_torch = tmt_translate(tmp_path / "run", beam, lines, **decode)
        assert tmt_translate(tmp_path / "run", beam, lines, engine="ctranslate2", **decode) == on_torch
        assert hf_translate(tokenizer, model, None if beam == 4 else beam, lines, **decode) == on_torch
        # This briefly trained model's beams choose between ends of many lengths, the empty one among them.
        assert len(set(on_torch)) > 5 and sum(b != g for b, g in zip(on_torch, greedy)) > len(lines) // 4


def test_a_greedy_run_loads_without_warnings_and_beams_rank_by_the_alpha_asked(hf_dir: Path, transformers,
                                                                              tmp_path: Path):
    # transformers warns that length_penalty and early_stopping "may be ignored" when num_beams is 1:
    # a greedy run's folder leaves them out, and a generate(num_beams=4) names them.
    make_run(tmp_path / "run", "post", True)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    state = load_checkpoint(best)
    state["config"]["decode"].update(beam_size=1, length_penalty=2.0)
    save_atomic(state, best)
    export_hf(tmp_path / "run", hf_dir)
    transformers.GenerationConfig.from_pretrained(hf_dir).validate(strict=True)  # raises on flags "ignored"
    tokenizer, model = load_folder(transformers, hf_dir)
    assert hf_translate(tokenizer, model, 1, **CAP) == tmt_translate(tmp_path / "run", 1, **CAP)
    beam = hf_translate(tokenizer, model, 4, length_penalty=2.0, early_stopping=True, **CAP)
    assert beam == tmt_translate(tmp_path / "run", 4, length_penalty=2.0, **CAP)
    assert beam != tmt_translate(tmp_path / "run", 4, length_penalty=0.0, **CAP)  # α ranks these beams


@pytest.mark.parametrize("norm, model", [("post", {"activation": "swish", "output_bias": True}),
                                         ("pre", {"activation": "gelu", "output_bias": True, "scale_embedding": False})],
                         ids=["post-swish-bias", "pre-gelu-bias-unscaled"])
def test_model_options_export_and_translate_as_tmt(transformers, tmp_path: Path, hf_dir: Path, norm: str, model: dict):
    make_run(tmp_path / "run", norm, True, **model)
    export_hf(tmp_path / "run", hf_dir)
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    assert config["activation_function"] == model["activation"]
    assert config["scale_embedding"] == model.get("scale_embedding", True)
    tokenizer, hf_model = load_folder(transformers, hf_dir)
    assert hf_translate(tokenizer, hf_model, 1, **CAP) == tmt_translate(tmp_path / "run", 1, **CAP)
