"""A Marian (OPUS-MT) model folder, as transformers' `save_pretrained` writes a `MarianMTModel`, read
into tmt's one Transformer: its `ModelConfig`, its weights under tmt's names and the vocabulary order
(`MarianVocab`). The inverse of `export/hf_export.py`: token rows reordered to tmt's ids, residual
columns from transformers' [sin | cos] position layout back to tmt's interleaved one."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer_mt.config.schema import Config, ModelConfig
from transformer_mt.core.errors import Problems, TmtError
from transformer_mt.data.tokenization import PAD_ID
from transformer_mt.export.hf_export import residual_order
from transformer_mt.model.transformer import Transformer, build_model
from transformer_mt.pretrained.marian_vocab import MarianVocab

# transformers' MarianConfig defaults, for the keys a config.json may leave out
MARIAN_DEFAULTS = {"vocab_size": 58101, "decoder_vocab_size": None, "d_model": 1024, "encoder_layers": 12,
                   "decoder_layers": 12, "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096,
                   "encoder_attention_heads": 16, "decoder_attention_heads": 16, "activation_function": "gelu",
                   "max_position_embeddings": 1024, "dropout": 0.1, "attention_dropout": 0.0,
                   "activation_dropout": 0.0, "scale_embedding": False, "pad_token_id": 58100, "eos_token_id": 0,
                   "decoder_start_token_id": 58100, "share_encoder_decoder_embeddings": True,
                   "tie_word_embeddings": True, "normalize_before": False}
# The type each of those keys must have (bool is no integer here)
INTEGERS = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim", "decoder_ffn_dim",
            "encoder_attention_heads", "decoder_attention_heads", "max_position_embeddings", "pad_token_id",
            "eos_token_id", "decoder_start_token_id")
KINDS = {**{key: (int,) for key in INTEGERS}, "decoder_vocab_size": (int, type(None)),
         **{key: (int, float) for key in ("dropout", "attention_dropout", "activation_dropout")},
         "activation_function": (str,), **{key: (bool,) for key in (
             "scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings", "normalize_before")}}
KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
# transformers' activation names (ACT2FN) -> tmt's `model.activation`
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}
MARIAN_UNK = 1  # Marian's own vocabularies put <unk> at 1 (</s> at 0); a folder's vocab.json says so too
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class MarianModel:
    """A Marian model in tmt's terms: `state` loads into `build_model(config, len(vocab), len(vocab), PAD_ID)`."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    vocab: MarianVocab

    def build(self) -> Transformer:
        """The Transformer holding these weights, on the CPU, in eval mode."""
        model = build_model(self.config, len(self.vocab), len(self.vocab), PAD_ID)
        model.load_state_dict(self.state)
        return model.eval()


def read_marian(folder: Path) -> MarianModel:
    """Read a `MarianMTModel` folder: config.json, the weights (model.safetensors, else
    pytorch_model.bin) and, when present, vocab.json (for `<unk>`'s id). `TmtError` in one line naming
    the file and what tmt cannot compute: another architecture, a pre-norm Marian, a separate decoder
    vocabulary, an activation tmt lacks, a missing or unreadable file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TmtError(f"{folder}: not a folder; give the folder a Marian model was saved to (save_pretrained)")
    config_path = folder / "config.json"
    missing = f"{config_path.parent}: no config.json (not a transformers model folder)"
    settings = {**MARIAN_DEFAULTS, **read_json_object(config_path, missing)}
    cfg = model_config(settings, config_path)
    vocab = marian_vocab(settings, folder, config_path)
    weights_path = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if weights_path is None:
        raise TmtError(f"{folder}: no {' or '.join(WEIGHT_FILES)} (the model's weights)")
    weights = _read_weights(weights_path)
    if not cfg.tie_output:  # transformers 5 then unties each side's embedding too (4 kept them equal)
        sides = [weights.get(f"model.{side}.embed_tokens.weight", weights.get("model.shared.weight"))
                 for side in ("encoder", "decoder")]
        if not any(side is None for side in sides) and not torch.equal(*sides):
            cfg = dataclasses.replace(cfg, share_embeddings=False)
    return MarianModel(cfg, tmt_state(weights, cfg, vocab, settings, weights_path), vocab)


def model_config(settings: dict, path: Path) -> ModelConfig:
    """tmt's model options for a Marian config.json's `settings` (defaults filled in)."""
    model_type = settings.get("model_type")
    if model_type in ("m2m_100", "nllb_moe"):
        raise TmtError(f"{path}: model_type {model_type!r}: M2M100 and NLLB models are not supported yet (pre-norm "
                       "layers, fairseq's position table, language-code tokens); tmt reads Marian (OPUS-MT) models")
    if model_type is None:
        raise TmtError(f"{path}: no model_type; tmt reads Marian (OPUS-MT) models")
    if model_type != "marian":
        raise TmtError(f"{path}: model_type {model_type!r} is not supported; tmt reads only Marian (OPUS-MT) models")
    for key, kinds in KINDS.items():
        value = settings[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise TmtError(f"{path}: {key}: {value!r} is not {' or '.join(KIND_NAMES[k] for k in kinds)}")
    if settings["normalize_before"]:
        raise TmtError(f"{path}: normalize_before: true (a pre-norm Marian model) is not supported; tmt reads "
                       "post-norm Marian models")
    vocab_size = settings["vocab_size"]
    if not settings["share_encoder_decoder_embeddings"] or settings["decoder_vocab_size"] not in (None, vocab_size):
        raise TmtError(f"{path}: share_encoder_decoder_embeddings: false (decoder_vocab_size "
                       f"{settings['decoder_vocab_size']}, vocab_size {vocab_size}): a separate decoder vocabulary "
                       "is not supported; tmt reads Marian models with one vocabulary for both sides")
    activation = ACTIVATIONS.get(settings["activation_function"])
    if activation is None:
        raise TmtError(f"{path}: activation_function {settings['activation_function']!r} is not supported (tmt has "
                       f"{', '.join(dict.fromkeys(ACTIVATIONS.values()))})")
    for key in ("ffn_dim", "attention_heads"):
        encoder, decoder = settings[f"encoder_{key}"], settings[f"decoder_{key}"]
        if encoder != decoder:
            raise TmtError(f"{path}: encoder_{key} {encoder} and decoder_{key} {decoder} differ; tmt's encoder and "
                           "decoder have one size")
    encoder_layers, decoder_layers = settings["encoder_layers"], settings["decoder_layers"]
    cfg = ModelConfig(d_model=settings["d_model"], n_heads=settings["encoder_attention_heads"],
                      n_layers=encoder_layers, decoder_layers=None if decoder_layers == encoder_layers else decoder_layers,
                      d_ff=settings["encoder_ffn_dim"], dropout=settings["dropout"],
                      attention_dropout=settings["attention_dropout"], activation_dropout=settings["activation_dropout"],
                      norm="post", max_len=settings["max_position_embeddings"], share_embeddings=True,
                      tie_output=bool(settings["tie_word_embeddings"]), activation=activation,
                      output_bias=True, scale_embedding=bool(settings["scale_embedding"]))
    problems = Problems()
    cfg.validate(problems, Config(model=cfg))
    if problems.found:  # tmt's key names, the Marian sizes that gave them
        raise TmtError(f"{path}: gives a model tmt cannot build: {problems.found[0]}")
    return cfg


def marian_vocab(settings: dict, folder: Path, config_path: Path) -> MarianVocab:
    """The id order of the model's vocabulary: special ids from config.json, `<unk>` from vocab.json."""
    pad, eos, start = settings["pad_token_id"], settings["eos_token_id"], settings["decoder_start_token_id"]
    unk = MARIAN_UNK
    vocab_path = folder / "vocab.json"
    if vocab_path.is_file():
        pieces = read_json_object(vocab_path, f"{vocab_path.parent}: no vocab.json")
        if not isinstance(pieces.get("<unk>"), int):
            raise TmtError(f"{vocab_path}: no '<unk>' piece")
        unk = pieces["<unk>"]
        for piece, key in (("<pad>", "pad_token_id"), ("</s>", "eos_token_id")):
            if piece in pieces and pieces[piece] != settings[key]:
                raise TmtError(f"{vocab_path}: {piece!r} is id {pieces[piece]}, where {config_path.name} has "
                               f"{key} {settings[key]}")
    try:
        return MarianVocab.of(settings["vocab_size"], pad=pad, unk=unk, eos=eos, decoder_start=start)
    except (TypeError, ValueError) as err:  # None or a list where an id belongs; ids that collide
        raise TmtError(f"{config_path}: {err}".replace("\n", " ")) from None


def tmt_state(weights: dict[str, torch.Tensor], cfg: ModelConfig, vocab: MarianVocab, settings: dict,
              path: Path) -> dict[str, torch.Tensor]:
    """Marian's `weights` under tmt's names (fp32): rows in tmt's id order, residual columns in tmt's."""
    D, V = cfg.d_model, settings["vocab_size"]
    inverse = torch.argsort(residual_order(D))  # tmt's column j is transformers' column inverse[j]
    rows = torch.tensor(vocab.rows)

    def get(name: str, *shape: int, fallback: str | None = None) -> torch.Tensor:
        key = name if name in weights or fallback is None else fallback
        if key not in weights:
            raise TmtError(f"{path}: no tensor {name} (a MarianMTModel's weights?)")
        tensor = weights[key]
        if tuple(tensor.shape) != shape:
            raise TmtError(f"{path}: {key} has shape {tuple(tensor.shape)} where config.json's sizes need {shape}")
        return tensor.float()

    state: dict[str, torch.Tensor] = {}

    def reads(name: str, *parts: str) -> None:  # projections of the residual stream, stacked as tmt fuses them
        state[f"{name}.weight"] = torch.cat([get(f"{p}.weight", D, D)[:, inverse] for p in parts])
        state[f"{name}.bias"] = torch.cat([get(f"{p}.bias", D) for p in parts])

    def linear(name: str, part: str, out: int, inp: int, read: bool, write: bool) -> None:
        weight, bias = get(f"{part}.weight", out, inp), get(f"{part}.bias", out)
        state[f"{name}.weight"] = weight[inverse] if write else weight[:, inverse] if read else weight
        state[f"{name}.bias"] = bias[inverse] if write else bias

    def norm(name: str, part: str) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = get(f"{part}.weight", D)[inverse], get(f"{part}.bias", D)[inverse]

    def embedding(name: str, fallback: str) -> torch.Tensor:  # (V_tmt, D)
        return get(name, V, D, fallback=fallback)[rows][:, inverse]

    if cfg.share_embeddings:  # transformers ties both sides' embeddings and the output to model.shared
        state["src_embed.weight"] = state["tgt_embed.weight"] = embedding(
            "model.shared.weight", "model.encoder.embed_tokens.weight")
    else:  # transformers 5 unties them all when tie_word_embeddings is false
        state["src_embed.weight"] = embedding("model.encoder.embed_tokens.weight", "model.shared.weight")
        state["tgt_embed.weight"] = embedding("model.decoder.embed_tokens.weight", "model.shared.weight")
    for side, depth in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(depth):
            hf, tmt = f"model.{side}.layers.{i}", f"{side}_layers.{i}"
            reads(f"{tmt}.self_attn.qkv_proj", *(f"{hf}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")))
            linear(f"{tmt}.self_attn.out_proj", f"{hf}.self_attn.out_proj", D, D, True, True)
            norm(f"{tmt}.{'attn_block' if side == 'encoder' else 'self_block'}.norm", f"{hf}.self_attn_layer_norm")
            if side == "decoder":
                reads(f"{tmt}.cross_attn.q_proj", f"{hf}.encoder_attn.q_proj")
                reads(f"{tmt}.cross_attn.kv_proj", f"{hf}.encoder_attn.k_proj", f"{hf}.encoder_attn.v_proj")
                linear(f"{tmt}.cross_attn.out_proj", f"{hf}.encoder_attn.out_proj", D, D, True, True)
                norm(f"{tmt}.cross_block.norm", f"{hf}.encoder_attn_layer_norm")
            linear(f"{tmt}.ffn.linear1", f"{hf}.fc1", cfg.d_ff, D, True, False)
            linear(f"{tmt}.ffn.linear2", f"{hf}.fc2", D, cfg.d_ff, False, True)
            norm(f"{tmt}.ffn_block.norm", f"{hf}.final_layer_norm")
    state["output_proj.weight"] = state["tgt_embed.weight"] if cfg.tie_output else \
        get("lm_head.weight", V, D)[rows][:, inverse]
    bias = weights.get("final_logits_bias", torch.zeros(1, V))  # transformers' default when it is absent
    if tuple(bias.shape) != (1, V):
        raise TmtError(f"{path}: final_logits_bias has shape {tuple(bias.shape)} where config.json's sizes need {(1, V)}")
    state["output_proj.bias"] = bias.float()[0, rows]
    return {name: tensor.contiguous() for name, tensor in state.items()}


def read_json_object(path: Path, missing: str | None = None) -> dict:
    """`path`'s JSON object: {} when the file is absent and `missing` is None, else one line, the
    `missing` message or what is wrong with the file."""
    if not path.is_file():
        if missing is None:
            return {}
        raise TmtError(missing)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise TmtError(f"{path}: not readable as JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise TmtError(f"{path}: not a JSON object")
    return value


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file or of a `torch.save`d state dict (loaded as data alone)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(path)
        else:
            weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch raise many types for a truncated or foreign file
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise TmtError(f"{path}: not readable ({detail})") from None
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise TmtError(f"{path}: not readable (not a dict of tensors)")
    return weights
