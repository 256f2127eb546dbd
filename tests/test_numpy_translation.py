"""The numpy engine of `tmt translate` (`checkpoint_reader`, `numpy_decoder`, `numpy_translator`):
the same weights as `torch.load`, the same translations as `Translator.translate`, torch never
imported on its path, and torch used (with its messages) wherever numpy cannot do the same."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import PYTHONPATH, TINY_PAIRS, run_cli, tiny_config, write_corpus
from transformer_mt.cli_parser import NUMPY_AUTO_MAX_SENTENCES
from transformer_mt.checkpoint import load_checkpoint, save_atomic, translation_weights
from transformer_mt.checkpoint_reader import UnsupportedCheckpoint, read_translation_state
from transformer_mt.config import ModelConfig
from transformer_mt.config_loading import config_from_dict
from transformer_mt.errors import CheckpointError
from transformer_mt.numpy_decoder import best_indices, descending_order, unsupported_reason
from transformer_mt.numpy_translator import EngineUnavailable, NumpyTranslator
from transformer_mt.run_dir import prepare_run_dir
from transformer_mt.training import train
from transformer_mt.translator import Translator

# More than 20 sentences: the training ones, unseen ones, empty-ish and long ones (over
# model.max_len = 64 tokens: truncated, and decoded up to the length cap).
SENTENCES = [src for src, _ in TINY_PAIRS] + [
    "", "   ", "?", "Good", "The station is hot.", "Why is the coffee beautiful?", "We read water.",
    "Thank you, the man is here.", "She eats a book and he drinks the coffee.",
    "The city " * 30, "Where is the station? " * 12, "à è ì ò ù l'uomo",
]


def trained_run(directory: Path, steps: int = 40, **sections) -> Path:
    """A tiny run trained `steps` updates (enough to translate something other than one token)."""
    corpus = write_corpus(directory / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    run = directory / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train_section = {"max_steps": steps, "eval_every_steps": steps, "save_every_steps": steps // 2,
                     "keep_last": 3, **sections.pop("train", {})}
    train(tiny_config(corpus, train=train_section, **sections), run, progress=False)
    return run


@pytest.fixture(scope="module")
def pre_norm_run(tmp_path_factory) -> Path:
    """The default model (pre-norm, shared and tied embeddings), with an EMA of its weights."""
    return trained_run(tmp_path_factory.mktemp("pre"), train={"ema_decay": 0.9})


@pytest.fixture(scope="module")
def post_norm_run(tmp_path_factory) -> Path:
    """Post-norm, separate vocabularies and embeddings, untied output, a deeper encoder."""
    return trained_run(tmp_path_factory.mktemp("post"), tokenizer={"joint": False},
                       model={"norm": "post", "share_embeddings": False, "tie_output": False,
                              "encoder_layers": 3, "decoder_layers": 1})


def assert_same_weights(checkpoint: Path) -> None:
    state = read_translation_state(checkpoint)
    weights, which = translation_weights(load_checkpoint(checkpoint))
    assert state.which == which and set(state.weights) == set(weights)
    for name, tensor in weights.items():
        array = state.weights[name]
        assert array.dtype == np.float32 and array.shape == tuple(tensor.shape), name
        assert np.array_equal(array.view(np.uint32), tensor.float().numpy().view(np.uint32)), name  # bit for bit


def test_the_reader_gives_torch_loads_weights_bit_for_bit(pre_norm_run: Path, post_norm_run: Path, tmp_path: Path,
                                                          monkeypatch, capsys):
    for run in (pre_norm_run, post_norm_run):
        for checkpoint in sorted((run / "checkpoints").glob("*.pt")):
            assert_same_weights(checkpoint)
    assert read_translation_state(pre_norm_run / "checkpoints" / "best.pt").which == "ema"
    assert read_translation_state(post_norm_run / "checkpoints" / "best.pt").which == "model"
    code, _, err = run_cli(["average", "--run", str(post_norm_run), "--last", "2",
                            "--output", str(tmp_path / "checkpoints" / "average.pt")], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert_same_weights(tmp_path / "checkpoints" / "average.pt")


def test_the_reader_widens_bf16_fp16_and_fp64_and_follows_views_of_a_storage(tmp_path: Path):
    base = torch.randn(6, 5)
    weights = {"a": base, "a_t": base.t(), "a_rows": base[2:5], "a_cols": base[:, 1:4],  # views of one storage
               "bf16": torch.randn(4, 3).to(torch.bfloat16), "fp16": torch.randn(7).half(),
               "fp64": torch.randn(3, 2, dtype=torch.float64), "scalar": torch.tensor(2.5)}
    save_atomic({"model": weights, "config": {}, "model_args": {}, "format_version": 2}, tmp_path / "c.pt")
    arrays = read_translation_state(tmp_path / "c.pt").weights
    for name, tensor in weights.items():
        assert np.array_equal(arrays[name], tensor.float().numpy()), name


@pytest.mark.parametrize("state", [
    {"model": {"w": torch.ones(2)}, "config": {}, "model_args": {}, "format_version": 1},  # torch's loader refuses it
    {"model": {"w": torch.ones(2, dtype=torch.long)}, "config": {}, "model_args": {}, "format_version": 2},
    {"model": {"w": torch.ones(2)}, "config": {}, "format_version": 2},  # no model_args
])
def test_the_reader_refuses_what_torchs_loader_is_to_read(state: dict, tmp_path: Path):
    save_atomic(state, tmp_path / "c.pt")
    with pytest.raises(UnsupportedCheckpoint):
        read_translation_state(tmp_path / "c.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(UnsupportedCheckpoint):
        read_translation_state(tmp_path / "empty.pt")


@pytest.mark.parametrize("run_name", ["pre_norm_run", "post_norm_run"])
def test_numpy_translations_are_torchs_greedy_and_beam(run_name: str, request):
    run = request.getfixturevalue(run_name)
    numpy_translator, torch_translator = NumpyTranslator.from_run(run), Translator.from_run(run, device="cpu")
    greedy = torch_translator.translate(SENTENCES, beam_size=1)
    assert len(set(greedy)) > 5  # the model says different things to different sentences
    assert numpy_translator.translate(SENTENCES, beam_size=1) == greedy
    for alpha in (0.0, 0.6, 1.0):
        numpy_translator.set_decoding(length_penalty=alpha)
        torch_translator.set_decoding(length_penalty=alpha)
        for beam in (2, 3, 4, 5):
            assert numpy_translator.translate(SENTENCES, beam_size=beam) == \
                torch_translator.translate(SENTENCES, beam_size=beam), (alpha, beam)


def test_best_indices_are_the_head_of_the_full_stable_sort():
    generator = np.random.default_rng(0)
    for size in (1, 5, 64, 1000):
        for values in (generator.standard_normal(size).astype(np.float32),
                       generator.integers(0, 4, size).astype(np.float32)):  # many ties at every boundary
            values[generator.integers(0, size)] = -np.inf
            for k in (1, 2, 5, 10, size, size + 3):
                assert np.array_equal(best_indices(values, k), descending_order(values)[:k]), (size, k)


def test_a_model_option_numpy_does_not_implement_is_named():
    cfg = config_from_dict({"data": {"path": "x"}})
    assert unsupported_reason(cfg) is None
    # A field added to ModelConfig later (say an activation) is refused unless at its default.
    extended = dataclasses.make_dataclass("ModelConfig", [("activation", str, "relu")], bases=(ModelConfig,),
                                          frozen=True)
    assert unsupported_reason(dataclasses.replace(cfg, model=extended())) is None
    assert "activation = 'gelu'" in unsupported_reason(dataclasses.replace(cfg, model=extended(activation="gelu")))
    assert "bf16" in unsupported_reason(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="bf16")))


def test_a_run_numpy_cannot_decode_is_translated_with_torch(tmp_path: Path, monkeypatch, capsys):
    run = trained_run(tmp_path, steps=4, decode={"quantize": "int8"})  # torch's int8 CPU decoding
    with pytest.raises(EngineUnavailable, match="decode.quantize: int8"):
        NumpyTranslator.from_run(run)
    expected = Translator.from_run(run, device="cpu").translate(["Good morning.", "I am tired."])
    code, out, err = run_cli(["translate", "--run", str(run), "--device", "cpu", "Good morning.", "I am tired."],
                             monkeypatch, capsys, tmp_path)
    assert code == 0 and out.splitlines() == expected, err
    code, _, err = run_cli(["translate", "--run", str(run), "--engine", "numpy", "Good morning."],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and err == ("tmt: error: --engine numpy: the run's decode.quantize: int8 is not implemented in "
                                 "numpy; leave out --engine to translate with torch\n")
    code, _, err = run_cli(["translate", "--run", str(run), "--engine", "numpy", "--n-best", "2", "--beam", "2", "Hi."],
                           monkeypatch, capsys, tmp_path)
    assert code == 2 and err == "tmt: error: --engine numpy: --n-best needs torch; leave out --engine to translate with torch\n"


def tmt_translate_in_python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`tmt translate ARGS` in a fresh interpreter that fails unless torch stayed unimported."""
    code = ("import sys; from transformer_mt.cli import main; rc = main(['translate', *sys.argv[1:]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"})


def test_translating_arguments_on_the_cpu_never_imports_torch(pre_norm_run: Path, tmp_path: Path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "tiny").symlink_to(pre_norm_run)
    expected = Translator.from_run(pre_norm_run, device="cpu").translate(["Good morning.", "Where is the station?"],
                                                                         beam_size=3)
    done = tmt_translate_in_python(["--beam", "3", "Good morning.", "Where is the station?"], tmp_path)
    assert done.returncode == 0 and done.stdout.splitlines() == expected, done.stderr
    assert done.stderr == ("tmt: using runs/tiny (en->it, best.pt), the most recently updated run under runs/; "
                           "choose another with --run DIR (`tmt runs` lists them)\n")
    # Many sentences go to torch's batches, unless numpy is asked for.
    many = [f"Sentence {i}." for i in range(NUMPY_AUTO_MAX_SENTENCES + 1)]
    assert "torch was imported" in tmt_translate_in_python(["--run", str(pre_norm_run), *many], tmp_path).stderr
    done = tmt_translate_in_python(["--run", str(pre_norm_run), "--engine", "numpy", *many], tmp_path)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == len(many), done.stderr
    # Options only torch implements: the same command imports it.
    done = tmt_translate_in_python(["--n-best", "2", "--beam", "3", "Good morning."], tmp_path)
    assert done.returncode == 1 and "torch was imported" in done.stderr


@pytest.mark.parametrize("damage", ["truncated", "other tokenizers", "missing"])
def test_a_bad_checkpoint_gives_the_torch_engines_error(damage: str, pre_norm_run: Path, tmp_path: Path,
                                                        monkeypatch, capsys):
    checkpoint = tmp_path / "run" / "checkpoints" / "best.pt"
    checkpoint.parent.mkdir(parents=True)
    for name in ("tokenizer.json", "config.yaml"):
        (tmp_path / "run" / name).write_bytes((pre_norm_run / name).read_bytes())
    original = (pre_norm_run / "checkpoints" / "best.pt").read_bytes()
    if damage == "truncated":
        checkpoint.write_bytes(original[: len(original) // 2])
    elif damage == "other tokenizers":
        state = load_checkpoint(pre_norm_run / "checkpoints" / "best.pt")
        save_atomic({**state, "tokenizers": "0" * 32}, checkpoint)
        with pytest.raises(CheckpointError, match="other tokenizers"):  # numpy's engine says it itself
            NumpyTranslator.from_run(tmp_path / "run")
    errors = []
    for engine in ("auto", "torch"):
        code, out, err = run_cli(["translate", "--run", str(tmp_path / "run"), "--engine", engine, "Good morning."],
                                 monkeypatch, capsys, tmp_path)
        assert code == 1 and out == "" and err.startswith("tmt: error: ") and len(err.splitlines()) == 1, err
        errors.append(err)
    assert errors[0] == errors[1]
