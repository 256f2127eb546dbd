"""A trained model as a CTranslate2 model, the same network with the same weights (CTranslate2's
greedy output is tmt's, token for token): `tmt export`, and the CTranslate2 engine's cache."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from transformer_mt.core.errors import TmtError, UsageError
from transformer_mt.core.files import check_new_dir, write_new_dir
from transformer_mt.data.tokenization import BOS, BOS_ID, EOS, PAD_ID, UNK, TokenizerPair
from transformer_mt.model.transformer import Transformer, sinusoidal_positions
from transformer_mt.runs.checkpoint import load_run
from transformer_mt.runs.run_dir import check_free_if_inside, write_export

logger = logging.getLogger(__name__)

CT2_PAD = "<blank>"  # CTranslate2's (OpenNMT's) padding token; its other special tokens are tmt's
# Rows of the exported position table: CTranslate2's default caps (inputs 1024, outputs 256), past
# which a position would fail a whole batch; the first max_len rows are the trained model's own.
CT2_POSITIONS = 1024
# `model.activation` -> CTranslate2's (common_spec.Activation); GELU is the exact, erf-based one
CT2_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "swish": "SWISH"}
FORBIDDEN_LOGIT_BIAS = -1e4  # on padding and a second BOS: far below any logit, finite in fp16


def export_ctranslate2(run_dir: Path, output_dir: Path, checkpoint: Path | None = None,
                       quantization: str | None = None) -> None:
    """Write a CTranslate2 model directory for a run (`checkpoint`, default as `tmt translate`
    chooses, its EMA weights when it has them): `model.bin`, `config.json`, the vocabularies and
    tmt's tokenizer files. `quantization`: CTranslate2's weight type (int8, float16, ...); None: fp32.
    the Exporting guide shows its use (tmt's cap a·S + b: `max_decoding_length`)."""
    try:
        import ctranslate2  # noqa: F401  (a dependency, but a platform may lack its wheel)
        from ctranslate2.specs import model_spec
    except ImportError:
        raise TmtError("exporting to CTranslate2 needs the ctranslate2 package: pip install ctranslate2") from None
    if quantization is not None and quantization not in model_spec.ACCEPTED_MODEL_TYPES:
        raise UsageError(f"--quantization: {quantization!r} is not one of "
                         f"{', '.join(model_spec.ACCEPTED_MODEL_TYPES)}")
    target = check_new_dir(output_dir, "--output")

    check_free_if_inside(run_dir, output_dir)  # before reading a checkpoint its trainer may delete
    run = load_run(run_dir, checkpoint)
    spec = ctranslate2_spec(run.model, run.tokenizers, run_dir, quantization)
    write_export(run_dir, output_dir, target, lambda folder: spec.save(str(folder)), "CTranslate2 model")
    logger.info("exported %s to %s (CTranslate2, %s)", run_dir, output_dir, quantization or "float32")


def ctranslate2_spec(model: Transformer, tokenizers: TokenizerPair, run_dir: Path, quantization: str | None = None):
    """The run's model as a CTranslate2 spec, ready to save: weights (`build_ctranslate2_spec`),
    both vocabularies, the run's tokenizer files, tied weights aliased and `quantization` applied."""
    spec = build_ctranslate2_spec(model)
    spec.register_source_vocabulary(ctranslate2_vocabulary(tokenizers.src))
    spec.register_target_vocabulary(ctranslate2_vocabulary(tokenizers.tgt))
    for tokenizer_file in sorted(run_dir.glob("tokenizer*.json")):
        spec.register_file(str(tokenizer_file))  # so the directory alone can translate text
    spec.validate()
    spec.optimize(quantization=quantization)  # aliases tied/shared weights, then quantizes
    return spec


def save_model_dir(spec, target: Path, files: dict[str, str] | None = None) -> None:
    """Save `spec` and `files` (name -> text) as the folder `target` (`write_new_dir`: never
    half-written). `OSError` when it cannot."""
    def write(folder: Path) -> None:
        spec.save(str(folder))
        for name, text in (files or {}).items():
            (folder / name).write_text(text, encoding="utf-8")

    write_new_dir(target, write)


def ctranslate2_vocabulary(tokenizer) -> list[str]:
    """The tokenizer's tokens in id order, so CTranslate2 token i is tmt id i; `<pad>` becomes `<blank>`."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)  # token -> id
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise TmtError("the tokenizer's ids are not contiguous from 0; cannot write a CTranslate2 vocabulary")
    if CT2_PAD in vocab:
        raise TmtError(f"the tokenizer has a token {CT2_PAD!r}, which CTranslate2 reserves for padding")
    tokens[PAD_ID] = CT2_PAD
    return tokens


def build_ctranslate2_spec(model: Transformer):
    """A `ctranslate2.specs.TransformerSpec` holding `model`'s weights (fp32 numpy arrays): fused
    projections as CTranslate2's, in `nn.Linear`'s layout; each `Residual`'s LayerNorm as the
    sublayer's; tmt's own position table (CTranslate2's differs); the FFN's activation; the output
    bias (`model.output_bias`'s, else zeros) forbidding padding and BOS, which tmt's search never emits."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (len(model.encoder_layers), len(model.decoder_layers)), cfg.n_heads, pre_norm=cfg.norm == "pre",
        activation=getattr(common_spec.Activation, CT2_ACTIVATIONS[cfg.activation]))
    spec.config.layer_norm_epsilon = model.decoder_layers[0].ffn_block.norm.eps  # nn.LayerNorm's 1e-5
    spec.config.add_source_eos = True  # tmt appends EOS to every source
    spec.config.decoder_start_token = BOS
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = BOS, EOS, UNK

    # (P, D): row i is position i, as in `Transformer.embed`; P >= max_len (see CT2_POSITIONS)
    positions = _array(sinusoidal_positions(max(cfg.max_len, CT2_POSITIONS), cfg.d_model))
    if not math.isclose(model.embed_scale, math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0):
        raise TmtError(f"unexpected embedding scale {model.embed_scale} for model.scale_embedding: {cfg.scale_embedding}")

    encoder, decoder = spec.encoder, spec.decoder
    for stack, embeddings, embed, layers, norm in (
            (encoder, encoder.embeddings[0], model.src_embed, model.encoder_layers, model.encoder_norm),
            (decoder, decoder.embeddings, model.tgt_embed, model.decoder_layers, model.decoder_norm)):
        embeddings.weight = _array(embed.weight)
        stack.scale_embeddings = cfg.scale_embedding  # CTranslate2 multiplies by sqrt(D) when True
        stack.position_encodings.encodings = positions
        if cfg.norm == "pre":
            _set(stack.layer_norm, norm)
        for layer_spec, layer in zip(stack.layer, layers):
            attention, ffn = layer_spec.self_attention, layer_spec.ffn
            attention_block = layer.attn_block if stack is encoder else layer.self_block
            parts = [(attention.linear[0], layer.self_attn.qkv_proj),  # (3D, D): q rows, k rows, then v rows
                     (attention.linear[1], layer.self_attn.out_proj),
                     (attention.layer_norm, attention_block.norm),
                     (ffn.linear_0, layer.ffn.linear1), (ffn.linear_1, layer.ffn.linear2),
                     (ffn.layer_norm, layer.ffn_block.norm)]
            if stack is decoder:
                cross = layer_spec.attention
                parts += [(cross.linear[0], layer.cross_attn.q_proj),
                          (cross.linear[1], layer.cross_attn.kv_proj),  # (2D, D): k rows, then v rows
                          (cross.linear[2], layer.cross_attn.out_proj),
                          (cross.layer_norm, layer.cross_block.norm)]
            for part_spec, module in parts:
                _set(part_spec, module)
    decoder.projection.weight = _array(model.output_proj.weight)  # (V, D), tied weights alias on save
    bias = np.zeros(model.output_proj.weight.shape[0], dtype=np.float32) if model.output_proj.bias is None \
        else _array(model.output_proj.bias)  # model.output_bias
    bias[[PAD_ID, BOS_ID]] = FORBIDDEN_LOGIT_BIAS
    decoder.projection.bias = bias
    return spec


def _set(spec, module: nn.Linear | nn.LayerNorm) -> None:
    """A linear layer's weight (out, in; CTranslate2 computes x @ Wᵀ too) and bias, or a LayerNorm's."""
    weight, bias = _array(module.weight), _array(module.bias)
    if isinstance(module, nn.LayerNorm):
        spec.gamma, spec.beta = weight, bias
    else:
        spec.weight, spec.bias = weight, bias


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy().copy()
