"""`tmt import`: a Marian (OPUS-MT) folder becomes a normal tmt run whose decoding is the original's.

The model is built here: a small MarianMTModel (swish, 2+2 layers, d 64, a non-zero final_logits_bias)
on the fixtures' SentencePiece vocabulary, trained with transformers on the demo corpus until it ends
its sentences, saved with its MarianTokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers import built_once, run_cli, tmt, tmt_limited
from tests.pretrained.marian_fixtures import DEMO, marian_tokenizer_folder

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

TEST_SOURCES = DEMO / "test.en"
MAX_NEW = 60  # far above any demo translation: every sentence ends with </s>, in tmt and in generate


@dataclass(frozen=True)
class Opus:
    folder: Path
    model: object  # transformers.MarianMTModel, in eval mode
    tokenizer: object  # transformers.MarianTokenizer


def train_marian(folder: Path) -> Opus:
    """A small OPUS-MT-like model trained 500 AdamW steps on the demo corpus, saved to `folder`."""
    tokenizer = marian_tokenizer_folder(folder)
    config = transformers.MarianConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, activation_function="swish",
        max_position_embeddings=64, scale_embedding=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=None, dropout=0.1, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config)
    with torch.no_grad():  # a buffer, not trained: the import must carry it
        model.final_logits_bias.normal_(0, 0.5)
    src = (DEMO / "train.en").read_text(encoding="utf-8").splitlines()
    tgt = (DEMO / "train.it").read_text(encoding="utf-8").splitlines()
    batch = tokenizer(src, text_target=tgt, padding=True, return_tensors="pt")
    labels = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for _ in range(500):
            rows = torch.randint(0, len(src), (32,), generator=generator)
            model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                  labels=labels[rows]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    # As OPUS-MT's: beam 4, padding never generated.
    model.generation_config.num_beams = 4
    model.generation_config.bad_words_ids = [[tokenizer.pad_token_id]]
    model.save_pretrained(folder)
    return Opus(folder, model, tokenizer)


def read_opus(folder: Path) -> Opus:
    """A saved test model and its tokenizer, as transformers reads them."""
    return Opus(folder, transformers.MarianMTModel.from_pretrained(folder).eval(),
                transformers.MarianTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def opus(tmp_path_factory) -> Opus:
    """The test model, trained once for the session and loaded from its folder in each worker."""
    folder = built_once(tmp_path_factory, "opus", lambda root: train_marian(root / "opus-mt-en-it")) / "opus-mt-en-it"
    return read_opus(folder)


@pytest.fixture(scope="module")
def imported(opus: Opus, tmp_path_factory) -> Path:
    """The run `tmt import` writes of the test model (in a subprocess, as a user runs it)."""
    root = tmp_path_factory.mktemp("runs")
    done = tmt("import", str(opus.folder), "--run-dir", "runs/opus", cwd=root)
    assert done.returncode == 0, done.stderr
    assert "runs/opus" in done.stderr and "tmt translate --run runs/opus" in done.stderr
    return root / "runs" / "opus"


def generate(opus: Opus, lines: list[str], **options) -> list[str]:
    batch = opus.tokenizer(lines, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = opus.model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False, **options)
    ends = [row.tolist()[1:].count(opus.tokenizer.eos_token_id) for row in out]
    assert all(ends), "a translation reached the length cap"
    return opus.tokenizer.batch_decode(out, skip_special_tokens=True)


def translate(run: Path, monkeypatch, capsys, *options: str) -> list[str]:
    code, out, err = run_cli(["translate", "--run", str(run), "--input", str(TEST_SOURCES), "--quiet", *options],
                             monkeypatch, capsys, run.parent)
    assert code == 0, err
    return out.splitlines()


def test_the_imported_run_holds_a_config_tokenizers_checkpoint_and_summary(opus, imported):
    from transformer_mt.config.loading import load_config
    from transformer_mt.runs.checkpoint import load_checkpoint

    cfg = load_config(imported / "config.yaml")
    assert cfg.data.format == "none" and cfg.data.path == "" and (cfg.data.src_lang, cfg.data.tgt_lang) == ("en", "it")
    assert cfg.model.activation == "swish" and cfg.model.output_bias and cfg.model.norm == "post"
    assert cfg.model.max_len == 64 and cfg.decode.beam_size == 4
    assert cfg.tokenizer.vocab_size == len(opus.tokenizer) + 1  # tmt's BOS beside Marian's <pad>
    assert not cfg.tokenizer.joint and cfg.model.share_embeddings  # two spm models over one vocabulary, one embedding
    assert (imported / ".tmt-run").is_file()
    assert (imported / "tokenizer.src.json").is_file() and (imported / "tokenizer.tgt.json").is_file()
    state = load_checkpoint(imported / "checkpoints" / "best.pt")
    assert state["train_state"]["step"] == 0 and state["tokenizers"]
    summary = json.loads((imported / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "imported" and summary["origin"]["model"] == str(opus.folder)
    from transformer_mt.runs.checkpoint import load_run
    assert summary["parameters"] == load_run(imported).model.num_parameters()
    import hashlib
    files = summary["origin"]["files_sha256"]
    assert files["model.safetensors"] == hashlib.sha256((opus.folder / "model.safetensors").read_bytes()).hexdigest()
    assert {"config.json", "source.spm", "target.spm", "vocab.json"} <= set(files)
    assert not [p for p in imported.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_torch_greedy_equals_generate_on_the_demo_test_sentences(opus, imported, monkeypatch, capsys):
    lines = TEST_SOURCES.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 60
    assert translate(imported, monkeypatch, capsys, "--engine", "torch", "--beam", "1") == \
        generate(opus, lines, num_beams=1)


def test_torch_beam_4_without_length_penalty_equals_generate(opus, imported, monkeypatch, capsys):
    lines = TEST_SOURCES.read_text(encoding="utf-8").splitlines()
    got = translate(imported, monkeypatch, capsys, "--engine", "torch", "--beam", "4", "--length-penalty", "0")
    assert got == generate(opus, lines, num_beams=4, length_penalty=0.0)
    assert got != generate(opus, lines, num_beams=1)  # the beams found other translations: a real search


def test_the_ctranslate2_engine_translates_as_torch(imported, monkeypatch, capsys):
    pytest.importorskip("ctranslate2")
    torch_lines = translate(imported, monkeypatch, capsys, "--engine", "torch", "--beam", "1")
    assert translate(imported, monkeypatch, capsys, "--engine", "ctranslate2", "--beam", "1") == torch_lines


def test_the_hf_export_of_the_imported_run_generates_as_the_original(opus, imported, monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(["export", "--format", "hf", "--run", str(imported), "--output", str(tmp_path / "hf")],
                           monkeypatch, capsys, tmp_path)
    assert code == 0, err
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    lines = TEST_SOURCES.read_text(encoding="utf-8").splitlines()
    batch = tokenizer(lines, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=MAX_NEW)
    assert tokenizer.batch_decode(out, skip_special_tokens=True) == generate(opus, lines, num_beams=1)
    card = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    assert "imported into tmt from `opus-mt-en-it` with `tmt import`" in card and "trained with tmt" not in card
    assert "language: [en, it]" in card
    code, _, err = run_cli(["export", "--run", str(imported), "--output", str(tmp_path / "ct2")],
                           monkeypatch, capsys, tmp_path)
    assert code == 0 and (tmp_path / "ct2" / "model.bin").is_file(), err


def test_runs_evaluate_score_and_average_use_the_imported_run(imported, monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(["runs", "--dir", str(imported.parent)], monkeypatch, capsys, tmp_path)
    assert code == 0 and any(line.split()[:2] == ["opus", "imported"] for line in out.splitlines()), out + err
    code, out, err = run_cli(["evaluate", "--run", str(imported), "--src", str(TEST_SOURCES), "--ref",
                              str(DEMO / "test.it"), "--beam", "1", "--quiet", "--no-diagnostics", "--bootstrap", "0",
                              "--output", str(tmp_path / "hyp.txt")], monkeypatch, capsys, tmp_path)
    assert code == 0 and "BLEU" in out + err, err
    code, out, err = run_cli(["score", "--run", str(imported), "--source", str(TEST_SOURCES), "--target",
                              str(tmp_path / "hyp.txt"), "--output", str(tmp_path / "scores.txt")], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    code, _, err = run_cli(["average", "--run", str(imported)], monkeypatch, capsys, tmp_path)
    assert code != 0 and err.count("\n") == 1 and "no step checkpoint" in err


def test_training_the_imported_config_itself_says_it_has_no_data(imported, monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(["train", "--config", str(imported / "config.yaml"), "--run-dir", str(tmp_path / "t")],
                           monkeypatch, capsys, tmp_path)
    assert code != 0 and err.count("\n") == 1 and "data.format: none" in err, err
    assert not (tmp_path / "t").exists()


def test_an_imported_run_is_a_train_init_from_parent(imported, tmp_path):
    import dataclasses

    from transformer_mt.config.loading import load_config
    from transformer_mt.config.schema import DataConfig
    from transformer_mt.runs.init_from import load_parent

    cfg = load_config(imported / "config.yaml")
    child = dataclasses.replace(cfg, data=DataConfig(path=str(DEMO)),
                                train=dataclasses.replace(cfg.train, init_from=str(imported)))
    parent = load_parent(child)
    assert parent.checkpoint.name == "best.pt" and parent.record["step"] == 0
    assert "output_proj.bias" in parent.weights


def test_the_imported_model_keeps_one_embedding_for_both_sides_and_the_output(imported):
    # Marian's two SentencePiece models share one vocabulary, and the model one embedding: tmt's
    # too, so fine-tuning updates (and AdamW holds state for) one copy, as transformers does.
    from transformer_mt.runs.checkpoint import load_run

    model = load_run(imported).model
    assert model.src_embed.weight is model.tgt_embed.weight is model.output_proj.weight


def test_an_existing_run_dir_is_refused_and_kept(opus, monkeypatch, capsys, tmp_path):
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "notes.txt").write_text("keep\n", encoding="utf-8")
    code, _, err = run_cli(["import", str(opus.folder), "--run-dir", "runs/mine"], monkeypatch, capsys, tmp_path)
    assert code == 2 and err.count("\n") == 1 and "runs/mine already exists" in err, err
    assert [p.name for p in (tmp_path / "runs" / "mine").iterdir()] == ["notes.txt"]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["mine"]


def test_a_folder_that_is_no_marian_model_is_refused_in_one_line(opus, monkeypatch, capsys, tmp_path):
    other = tmp_path / "bart"
    other.mkdir()
    config = json.loads((opus.folder / "config.json").read_text(encoding="utf-8"))
    (other / "config.json").write_text(json.dumps({**config, "model_type": "bart"}), encoding="utf-8")
    code, _, err = run_cli(["import", str(other), "--run-dir", "runs/bart"], monkeypatch, capsys, tmp_path)
    assert code != 0 and err.count("\n") == 1 and "model_type 'bart'" in err, err
    code, _, err = run_cli(["import", str(tmp_path / "absent"), "--run-dir", "runs/x"], monkeypatch, capsys, tmp_path)
    assert code != 0 and err.count("\n") == 1 and "absent" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_hub_id_offline_says_so_and_asks_for_a_folder(monkeypatch, capsys, tmp_path):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # nothing cached
    code, _, err = run_cli(["import", "Helsinki-NLP/opus-mt-en-it", "--run-dir", "runs/opus-en-it"],
                           monkeypatch, capsys, tmp_path)
    assert code != 0 and err.count("\n") == 1, err
    assert "Helsinki-NLP/opus-mt-en-it" in err and "offline (HF_HUB_OFFLINE is set)" in err and "folder" in err
    assert not (tmp_path / "runs").exists()


def test_a_write_that_fails_midway_is_named_and_leaves_nothing(opus, tmp_path):
    done = tmt_limited("import", str(opus.folder), "--run-dir", "runs/opus", cwd=tmp_path, limit=500_000)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "runs/opus/checkpoints/best.pt" in done.stderr and "File too large" in done.stderr, done.stderr
    assert list((tmp_path / "runs").iterdir()) == []  # no run, no temp folder


def test_a_hub_id_is_downloaded_and_recorded_with_its_commit(opus, monkeypatch, capsys, tmp_path):
    import shutil

    huggingface_hub = pytest.importorskip("huggingface_hub")
    snapshot = tmp_path / "cache" / "snapshots" / "0123abcd"
    shutil.copytree(opus.folder, snapshot)
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        asked.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    code, _, err = run_cli(["import", "Helsinki-NLP/opus-mt-en-it", "--run-dir", "runs/hub"], monkeypatch, capsys,
                           tmp_path)
    assert code == 0, err
    assert asked[0][0] == "Helsinki-NLP/opus-mt-en-it" and "model.safetensors" in asked[0][1]
    assert len(asked) == 1 and "pytorch_model.bin" not in asked[0][1]  # one weights file, not both
    origin = json.loads((tmp_path / "runs" / "hub" / "summary.json").read_text(encoding="utf-8"))["origin"]
    assert origin["model"] == "Helsinki-NLP/opus-mt-en-it" and origin["revision"] == "0123abcd"


@pytest.mark.parametrize("data, key", [({"format": "none", "path": "corpus"}, "data.path"),
                                       ({"format": "none", "corpora": [{"path": "a"}]}, "data.corpora")])
def test_data_format_none_names_no_corpus(data, key):
    from transformer_mt.config.loading import config_from_dict
    from transformer_mt.core.errors import ConfigError

    assert config_from_dict({"data": {"format": "none"}}).data.path == ""
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"data": data})
    assert refused.value.problems == [f"data.format: none names no corpus; set data.format to text, tsv, jsonl, tmx or "
                                      f"hub for {key}"]


def test_serve_translates_with_the_imported_run_as_translate_does(imported, monkeypatch, capsys, tmp_path):
    import shutil

    from tests.serve.test_serve import Server

    shutil.copytree(imported, tmp_path / "runs" / "tiny")  # where the serving helper looks
    lines = TEST_SOURCES.read_text(encoding="utf-8").splitlines()[:8]
    code, out, err = run_cli(["translate", "--run", "runs/tiny", *lines], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    server = Server(tmp_path)
    try:
        status, body = server.post({"sentences": lines})
    finally:
        server.stop()
    assert status == 200 and body["translations"] == out.splitlines()


def _valid_log_prob(run: Path, monkeypatch, capsys, cwd: Path) -> float:
    """The demo validation targets' summed log-probability under `run` (tmt score, torch)."""
    code, out, err = run_cli(["score", "--run", str(run), "--engine", "torch", "--source", str(DEMO / "valid.en"),
                              "--target", str(DEMO / "valid.it"), "--quiet"], monkeypatch, capsys, cwd)
    assert code == 0, err
    return sum(float(line.split("\t")[0]) for line in out.splitlines())


def test_a_fine_tuning_config_naming_only_data_and_train_starts_from_the_import(imported, monkeypatch, capsys,
                                                                               tmp_path):
    # model.* and tokenizer.* come from the imported run; no tokenizer is trained; 50 steps on
    # the demo corpus raise the validation targets' log-probability.
    (tmp_path / "ft.yaml").write_text(
        f"name: opus-ft\ndata: {{path: {DEMO}}}\n"
        f"train: {{init_from: {imported}, max_steps: 50, lr: 1.0e-3, warmup_steps: 10, eval_every_steps: 50, "
        "save_every_steps: 50, log_every_steps: 10, freeze: [embeddings], test_at_end: false}\n", encoding="utf-8")
    before = _valid_log_prob(imported, monkeypatch, capsys, tmp_path)
    code, _, err = run_cli(["train", "--config", "ft.yaml", "--run-dir", "runs/ft", "--no-progress"],
                           monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert "trained BPE" not in err and "embeddings" in err
    saved = (tmp_path / "runs" / "ft" / "config.yaml").read_text(encoding="utf-8")
    assert "activation: swish" in saved and "output_bias: true" in saved
    for name in ("tokenizer.src.json", "tokenizer.tgt.json"):
        assert (tmp_path / "runs" / "ft" / name).read_bytes() == (imported / name).read_bytes()
    assert _valid_log_prob(tmp_path / "runs" / "ft", monkeypatch, capsys, tmp_path) > before


def test_a_hub_model_without_safetensors_downloads_its_pytorch_weights(opus, monkeypatch, capsys, tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    snapshot = tmp_path / "cache" / "snapshots" / "4567cdef"
    snapshot.mkdir(parents=True)
    torch.save(opus.model.state_dict(), snapshot / "pytorch_model.bin")  # as older transformers saved weights
    for name in ("config.json", "generation_config.json", "vocab.json", "source.spm", "target.spm",
                 "tokenizer_config.json"):
        (snapshot / name).write_bytes((opus.folder / name).read_bytes())
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        asked.append(allow_patterns)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    code, _, err = run_cli(["import", "Helsinki-NLP/opus-mt-en-it", "--run-dir", "runs/hub"], monkeypatch, capsys,
                           tmp_path)
    assert code == 0, err
    assert "pytorch_model.bin" not in asked[0] and asked[1] == ["pytorch_model.bin"]


# --- a multilingual model: target-language tags -------------------------------------------------

TAGS = (">>fra<<", ">>ita<<")


@pytest.fixture(scope="module")
def opus_tagged(opus: Opus, tmp_path_factory) -> Opus:
    """The test model made multilingual as OPUS-MT's en-roa: the tags >>fra<< and >>ita<< added to its
    vocab.json, with new embedding rows (built once for the session)."""
    def build(root: Path) -> None:
        import shutil

        folder = root / "opus-mt-en-roa"
        shutil.copytree(opus.folder, folder)
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        vocab.update({tag: len(vocab) + i for i, tag in enumerate(TAGS)})
        (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        model = transformers.MarianMTModel.from_pretrained(opus.folder)
        torch.manual_seed(0)
        model.resize_token_embeddings(len(vocab), mean_resizing=False)
        with torch.no_grad():  # rows that change the translations: each tag asks for other ones
            model.get_input_embeddings().weight[-len(TAGS):].normal_(0, 0.1)
        model.save_pretrained(folder)

    folder = built_once(tmp_path_factory, "opus-tagged", build) / "opus-mt-en-roa"
    return read_opus(folder)


@pytest.fixture(scope="module")
def imported_tagged(opus_tagged: Opus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    done = tmt("import", str(opus_tagged.folder), "--run-dir", "runs/roa", cwd=root)
    assert done.returncode == 0, done.stderr
    return root / "runs" / "roa"


def test_a_multilingual_model_needs_a_target_language_it_knows(imported_tagged, monkeypatch, capsys):
    def refusal(*options: str) -> str:
        code, _, err = run_cli(["translate", "--run", str(imported_tagged), *options, "Good morning."],
                               monkeypatch, capsys, imported_tagged.parent)
        assert code == 2 and err.count("\n") == 1, err
        return err

    assert "this model translates into 2 languages (fra, ita): choose one with --target-lang" in refusal()
    assert "target language 'spa': this model has no tag >>spa<< (it knows fra, ita)" in refusal("--target-lang", "spa")
    assert "did you mean 'ita'?" in refusal("--target-lang", "itl")
    with pytest.raises(SystemExit):  # argparse's refusal
        run_cli(["translate", "--run", str(imported_tagged), "--target-lang", ">>ita<<", "Good morning."],
                monkeypatch, capsys, imported_tagged.parent)
    assert "--target-lang: give the language code alone, e.g. 'ita'" in capsys.readouterr().err
    code, out, err = run_cli(["translate", "--run", str(imported_tagged), ">>spa<< Good morning."],
                             monkeypatch, capsys, imported_tagged.parent)
    assert code == 2 and "line 1 begins with >>spa<<, not a tag of this model" in err, err


def test_tagged_sources_get_marian_tokenizers_ids(opus_tagged, imported_tagged):
    from transformer_mt.decode.translator import Translator
    from transformer_mt.pretrained.marian_tokenizer import marian_tokenizers

    tmt_id = marian_tokenizers(opus_tagged.folder)[1].tmt_ids()
    translator = Translator.from_run(imported_tagged, engine="torch")
    lines = TEST_SOURCES.read_text(encoding="utf-8").splitlines()
    assert list(translator.tokenizers.language_tags) == list(TAGS)

    def marian(texts: list[str]) -> list[list[int]]:
        return [[tmt_id[i] for i in ids[:-1]] for ids in opus_tagged.tokenizer(texts).input_ids]  # no </s>

    assert translator.source_ids(lines, "ita") == marian([">>ita<< " + line for line in lines])
    # A line's own tag wins over --target-lang's, and is one token however it is spaced.
    own = [">>fra<< " + lines[0], ">>fra<<" + lines[1], lines[2]]
    assert translator.source_ids(own, "ita") == marian([own[0], own[1], ">>ita<< " + lines[2]])
    assert translator.source_ids(own[:2]) == marian(own[:2])  # no --target-lang needed


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_translate_with_a_target_language_equals_generate_on_tagged_sources(opus_tagged, imported_tagged, engine,
                                                                            monkeypatch, capsys):
    if engine == "ctranslate2":
        pytest.importorskip("ctranslate2")
    lines = TEST_SOURCES.read_text(encoding="utf-8").splitlines()[:20]
    code, out, err = run_cli(["translate", "--run", str(imported_tagged), "--engine", engine, "--beam", "1",
                              "--target-lang", "ita", "--quiet", *lines], monkeypatch, capsys, imported_tagged.parent)
    assert code == 0, err
    assert out.splitlines() == generate(opus_tagged, [">>ita<< " + line for line in lines], num_beams=1)


def test_serve_takes_a_target_language_per_request(imported_tagged, monkeypatch, capsys, tmp_path):
    import shutil

    from tests.serve.test_serve import Server

    shutil.copytree(imported_tagged, tmp_path / "runs" / "tiny")  # where the serving helper looks
    lines = TEST_SOURCES.read_text(encoding="utf-8").splitlines()[:8]
    answers = {}
    for lang in ("ita", "fra"):
        code, out, err = run_cli(["translate", "--run", "runs/tiny", "--target-lang", lang, *lines], monkeypatch,
                                 capsys, tmp_path)
        assert code == 0, err
        answers[lang] = out.splitlines()
    assert answers["ita"] != answers["fra"]
    server = Server(tmp_path, "--target-lang", "fra")  # the server's default
    try:
        asked = {lang: server.post({"sentences": lines, "target_lang": lang}) for lang in ("ita", "spa")}
        default = server.post({"sentences": lines})
        status, health = server.get("health")
    finally:
        server.stop()
    assert asked["ita"] == (200, {"translations": answers["ita"]})
    assert default == (200, {"translations": answers["fra"]})
    assert asked["spa"][0] == 422 and "no tag >>spa<<" in asked["spa"][1]["error"]
    assert health["target_lang"] == "fra" and health["target_tags"] == list(TAGS)


def test_the_hf_export_of_a_multilingual_run_reads_a_leading_tag_as_one_token(opus_tagged, imported_tagged,
                                                                             monkeypatch, capsys, tmp_path):
    from transformer_mt.data.tokenization import EOS_ID
    from transformer_mt.decode.translator import Translator

    code, _, err = run_cli(["export", "--format", "hf", "--run", str(imported_tagged), "--output",
                            str(tmp_path / "hf")], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    lines = TEST_SOURCES.read_text(encoding="utf-8").splitlines()[:10]
    tagged = [">>ita<< " + line for line in lines]
    expected = Translator.from_run(imported_tagged, engine="torch").source_ids(lines, "ita")
    assert tokenizer(tagged).input_ids == [ids + [EOS_ID] for ids in expected]
    with torch.no_grad():
        out = model.generate(**tokenizer(tagged, padding=True, return_tensors="pt"), num_beams=1, do_sample=False,
                             max_new_tokens=MAX_NEW)
    assert tokenizer.batch_decode(out, skip_special_tokens=True) == generate(opus_tagged, tagged, num_beams=1)
