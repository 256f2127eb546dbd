"""`tmt import`: a Marian (OPUS-MT) model folder, or a Hub id downloaded to one, written as a tmt run:
config.yaml, the tokenizers, `checkpoints/best.pt` at step 0 and a summary.json whose `origin` names
the model and the digest of every file read. Everything is read and converted before anything is
written; the run directory is written as a new folder beside it and renamed into place."""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer_mt.config.loading import config_from_dict, save_config
from transformer_mt.config.schema import Config, DataConfig, DecodeConfig, TokenizerConfig, config_to_dict
from transformer_mt.core.errors import ConfigError, TmtError
from transformer_mt.core.files import check_new_dir, make_parent_dir, naming, sha256_of, write_error, write_new_dir
from transformer_mt.core.run_layout import BEST_NAME, RunDir
from transformer_mt.data.tokenization import PAD_ID, TokenizerPair
from transformer_mt.model.transformer import build_model
from transformer_mt.pretrained.marian import read_json_object, read_marian
from transformer_mt.pretrained.marian_tokenizer import marian_tokenizers
from transformer_mt.runs.checkpoint import checkpoint_state
from transformer_mt.runs.run_dir import RunLock
from transformer_mt.runs.summary import write_summary

# What a Marian folder holds that the import reads (the weights: one of the two).
WEIGHTS_BIN = "pytorch_model.bin"
READ_FILES = ("config.json", "generation_config.json", "model.safetensors", WEIGHTS_BIN, "vocab.json",
              "source.spm", "target.spm", "tokenizer_config.json")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
OPUS_NAME = re.compile(r"opus-mt-([a-z]{2,3})-([a-z]{2,3})$")  # Helsinki-NLP/opus-mt-en-it: en -> it


@dataclass(frozen=True)
class Imported:
    """What `import_marian` wrote: the run's config, and the model's parameter count."""

    run_dir: Path
    cfg: Config
    parameters: int


def model_folder(model: str) -> Path:
    """The folder `model` names: a local folder, else a Hub id downloaded (or found in the local
    Hub cache) with `huggingface_hub`; offline, one line saying so."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not HUB_ID.fullmatch(model):
        raise TmtError(f"{model}: no such folder (give the folder a Marian model was saved to, or a Hub id such "
                       "as Helsinki-NLP/opus-mt-en-it)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise TmtError(f"{model}: downloading from the Hugging Face Hub needs huggingface_hub "
                       "(pip install huggingface_hub), or pass a folder the model was saved to") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")  # as huggingface_hub reads it
    try:
        # The safetensors weights when the model has them, else pytorch_model.bin: never both.
        folder = Path(snapshot_download(model, allow_patterns=[name for name in READ_FILES if name != WEIGHTS_BIN],
                                        local_files_only=offline))
        if not (folder / "model.safetensors").is_file():
            folder = Path(snapshot_download(model, allow_patterns=[WEIGHTS_BIN], local_files_only=offline))
        return folder
    except LocalEntryNotFoundError:  # HF_HUB_OFFLINE, or no network, and nothing in the local cache
        offline = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise TmtError(f"{model}: offline ({offline}) and not in the local Hub cache; download the model where "
                       "there is a network (save_pretrained, or `hf download`) and pass its folder") from None
    except RepositoryNotFoundError:
        raise TmtError(f"{model}: no such folder, nor a model on the Hugging Face Hub (or it is private)") from None
    except (HfHubHTTPError, OSError) as err:
        raise TmtError(f"{model}: cannot download from the Hugging Face Hub ({str(err).splitlines()[0]}); "
                       "pass a folder the model was saved to") from None


def import_marian(model: str, run_dir: Path) -> Imported:
    """Write the tmt run `run_dir` (new, or an empty folder) for the Marian model `model`."""
    target = check_new_dir(run_dir, "--run-dir")  # refused before the model is read (it may be large)
    folder = model_folder(model)
    marian = read_marian(folder)
    tokenizers, vocab = marian_tokenizers(folder)
    if vocab != marian.vocab:
        ids = [f"{name} {getattr(vocab, name)} and {getattr(marian.vocab, name)}" for name in ("pad", "unk", "eos")]
        raise TmtError(f"{folder}: vocab.json and config.json disagree on the special tokens' ids ({', '.join(ids)}; "
                       "the decoder start counts too)")
    cfg = run_config(folder, model, run_dir, marian.config, tokenizers, len(vocab))
    local = Path(model).expanduser().is_dir()
    origin = {"model": str(folder.resolve()) if local else model, "folder": str(folder.resolve()),
              "revision": None if local else folder.name,  # the Hub cache names each snapshot by its commit
              "files_sha256": {name: sha256_of(folder / name) for name in READ_FILES if (folder / name).is_file()}}
    state = checkpoint_state(marian.state, config_to_dict(cfg),
                             {"src_vocab_size": len(vocab), "tgt_vocab_size": len(vocab), "pad_id": PAD_ID},
                             tokenizers=tokenizers.fingerprint(), train_state={"step": 0})
    buffer = io.BytesIO()
    torch.save(state, buffer)  # in memory: the folder is renamed into place only once all is written
    checkpoint = buffer.getvalue()
    parameters = build_model(cfg.model, len(vocab), len(vocab), PAD_ID).num_parameters()  # as the run builds it
    summary = {"name": cfg.name, "status": "imported", "step": 0, "max_steps": 0, "origin": origin,
               "parameters": parameters}

    def write(tmp: Path) -> None:
        layout = RunDir(tmp)
        with RunLock.acquire(tmp, "tmt import"):
            layout.marker.write_text("a run directory made by tmt import\n", encoding="utf-8")
            save_config(cfg, layout.config)
            tokenizers.save(tmp)
            layout.checkpoints.mkdir()
            with naming(layout.checkpoints / BEST_NAME):  # a plain write: its OSError names the file
                (layout.checkpoints / BEST_NAME).write_bytes(checkpoint)
            write_summary(tmp, summary)
        layout.lock.unlink()

    make_parent_dir(run_dir, "--run-dir")
    try:
        write_new_dir(target, write)
    except OSError as err:
        if err.filename and Path(err.filename).is_relative_to(target):  # named as the user gave --run-dir
            err.filename = str(run_dir / Path(err.filename).relative_to(target))
        raise write_error(err, "the run") from None
    return Imported(run_dir, cfg, parameters)


def run_config(folder: Path, model: str, run_dir: Path, model_cfg, tokenizers: TokenizerPair,
               vocab_size: int) -> Config:
    """The run's config: the model's, its tokenizers' size, its languages, no corpus (`data.format:
    none`), and decoding with the beams of its generation_config.json."""
    src, tgt = languages(folder, model)
    generation = read_json_object(folder / "generation_config.json")
    beams = generation.get("num_beams")
    decode = DecodeConfig(**({"beam_size": beams} if isinstance(beams, int) and not isinstance(beams, bool)
                             and beams >= 1 else {}))
    name = run_dir.resolve().name
    cfg = Config(name=name, data=DataConfig(format="none", path="", src_lang=src, tgt_lang=tgt),
                 tokenizer=TokenizerConfig(vocab_size=vocab_size, joint=tokenizers.joint), model=model_cfg,
                 decode=decode)
    try:
        return config_from_dict(config_to_dict(cfg))  # the checks any run's config passes
    except ConfigError as err:
        raise TmtError(f"{folder}: gives a run config tmt cannot use: {err.problems[0]}") from None


def languages(folder: Path, model: str) -> tuple[str, str]:
    """The source and target language: tokenizer_config.json's, else an OPUS-MT name's, else src/tgt."""
    settings = read_json_object(folder / "tokenizer_config.json")
    pair = settings.get("source_lang"), settings.get("target_lang")
    if all(isinstance(lang, str) and re.fullmatch(r"[\w-]+", lang) for lang in pair) and pair[0] != pair[1]:
        return pair
    for name in (model, folder.name):
        if match := OPUS_NAME.search(name.rstrip("/")):
            if match[1] != match[2]:
                return match[1], match[2]
    return "src", "tgt"
