"""A trained model as a Hugging Face `transformers` model folder computing the same function
(post-norm: MarianMTModel, pre-norm: PegasusForConditionalGeneration): `tmt export --format hf`."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from torch import nn

from transformer_mt.config.schema import Config
from transformer_mt.core.errors import TmtError, UsageError
from transformer_mt.core.files import check_new_dir, naming
from transformer_mt.data.tokenization import (BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID, UNK, TokenizerPair,
                                              is_language_tag)
from transformer_mt.export.ct2_conversion import FORBIDDEN_LOGIT_BIAS
from transformer_mt.model.transformer import Transformer, sinusoidal_positions
from transformer_mt.runs.checkpoint import load_run
from transformer_mt.runs.run_dir import check_free_if_inside, write_export

logger = logging.getLogger(__name__)

# tmt's norm -> (transformers' model_type, its class): the classes whose layers compute tmt's
MODEL_CLASSES = {"post": ("marian", "MarianMTModel"), "pre": ("pegasus", "PegasusForConditionalGeneration")}


def export_hf(run_dir: Path, output_dir: Path, checkpoint: Path | None = None) -> None:
    """Write a folder that `transformers` loads (`AutoModelForSeq2SeqLM`, `AutoTokenizer`) for a run
    (`checkpoint` as `tmt translate` chooses, its EMA weights when it has them): safetensors weights,
    config.json, generation_config.json (the run's decoding), the tokenizer and a model card."""
    from safetensors.torch import save

    target = check_new_dir(output_dir, "--output")
    check_free_if_inside(run_dir, output_dir)  # before reading a checkpoint its trainer may delete
    run = load_run(run_dir, checkpoint)
    check_exportable(run.cfg, run.tokenizers)
    weights = hf_state_dict(run.model)
    files = {"config.json": _json(hf_config(run.model, run.cfg)),
             "generation_config.json": _json(generation_config(run.cfg)),
             "tokenizer.json": hf_tokenizer(run.tokenizers, run.cfg.model.max_len),
             "tokenizer_config.json": _json(tokenizer_config(run.cfg.model.max_len)),
             "special_tokens_map.json": _json(SPECIAL_TOKENS_MAP),
             "README.md": model_card(_read_summary(run_dir), run.cfg, run.model, run.checkpoint.name)}

    def write(folder: Path) -> None:
        with naming(folder / "model.safetensors"):
            (folder / "model.safetensors").write_bytes(save(weights, metadata={"format": "pt"}))
        for name, text in files.items():
            with naming(folder / name):
                (folder / name).write_text(text, encoding="utf-8")

    write_export(run_dir, output_dir, target, write, "model")
    logger.info("exported %s to %s (transformers %s)", run_dir, output_dir, MODEL_CLASSES[run.cfg.model.norm][1])


def check_exportable(cfg: Config, tokenizers: TokenizerPair) -> None:
    """Refuse, in one line naming the setting, what no transformers class computes as tmt does. Two
    tokenizers over one vocabulary (an imported Marian model's) export the source one."""
    if not tokenizers.one_vocabulary:
        raise UsageError("tokenizer.joint: false (one vocabulary per side) cannot be exported to Hugging Face: "
                         "AutoTokenizer loads one tokenizer for both sides")
    if cfg.model.norm == "pre" and not cfg.model.share_embeddings:
        raise UsageError("model.share_embeddings: false cannot be exported to Hugging Face with model.norm: pre "
                         "(Pegasus shares one embedding between encoder and decoder)")


def residual_order(d_model: int) -> torch.Tensor:
    """(D,) long: transformers' column c of the residual stream is tmt's column order[c]. tmt's
    position table interleaves sin (even columns) and cos (odd); transformers' puts the sines in the
    first half, the cosines in the second, at the same frequencies. Every weight that reads or writes
    the residual stream takes this order (LayerNorm does not depend on it): the same function."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """`model`'s weights under transformers' names (fp32, contiguous, none shared), the residual
    stream in `residual_order`; the output bias (`model.output_bias`'s, else zeros) forbidding
    padding and BOS, as tmt's search does."""
    cfg = model.cfg
    order = residual_order(cfg.d_model)
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        out[name] = tensor.detach().to("cpu", torch.float32).contiguous().clone()

    def reads(name: str, linear: nn.Linear, rows: slice = slice(None)) -> None:  # input from the stream
        put(f"{name}.weight", linear.weight[rows][:, order])
        put(f"{name}.bias", linear.bias[rows])

    def writes(name: str, linear: nn.Linear) -> None:  # output into the stream
        put(f"{name}.weight", linear.weight[order])
        put(f"{name}.bias", linear.bias[order])

    def norm(name: str, layer_norm: nn.LayerNorm) -> None:
        put(f"{name}.weight", layer_norm.weight[order])
        put(f"{name}.bias", layer_norm.bias[order])

    D = cfg.d_model
    blocks = slice(0, D), slice(D, 2 * D), slice(2 * D, 3 * D)  # row blocks of a fused projection
    positions = sinusoidal_positions(cfg.max_len, D)[:, order]  # (max_len, D), tmt's own table
    src_embed, tgt_embed = model.src_embed.weight[:, order], model.tgt_embed.weight[:, order]  # (V, D)
    put("model.shared.weight", src_embed)
    put("model.encoder.embed_tokens.weight", src_embed)
    put("model.decoder.embed_tokens.weight", tgt_embed)
    for side, layers in (("encoder", model.encoder_layers), ("decoder", model.decoder_layers)):
        put(f"model.{side}.embed_positions.weight", positions)
        for i, layer in enumerate(layers):
            prefix = f"model.{side}.layers.{i}"
            attention_block = layer.attn_block if side == "encoder" else layer.self_block
            for proj, rows in zip(("q_proj", "k_proj", "v_proj"), blocks):  # (3D, D): q, k, v rows
                reads(f"{prefix}.self_attn.{proj}", layer.self_attn.qkv_proj, rows)
            writes(f"{prefix}.self_attn.out_proj", layer.self_attn.out_proj)
            norm(f"{prefix}.self_attn_layer_norm", attention_block.norm)
            if side == "decoder":
                reads(f"{prefix}.encoder_attn.q_proj", layer.cross_attn.q_proj)
                for proj, rows in zip(("k_proj", "v_proj"), blocks):  # (2D, D): k rows, then v rows
                    reads(f"{prefix}.encoder_attn.{proj}", layer.cross_attn.kv_proj, rows)
                writes(f"{prefix}.encoder_attn.out_proj", layer.cross_attn.out_proj)
                norm(f"{prefix}.encoder_attn_layer_norm", layer.cross_block.norm)
            reads(f"{prefix}.fc1", layer.ffn.linear1)
            writes(f"{prefix}.fc2", layer.ffn.linear2)
            norm(f"{prefix}.final_layer_norm", layer.ffn_block.norm)
    if cfg.norm == "pre":
        norm("model.encoder.layer_norm", model.encoder_norm)
        norm("model.decoder.layer_norm", model.decoder_norm)
    put("lm_head.weight", model.output_proj.weight[:, order])  # (V, D)
    if cfg.share_embeddings and cfg.tie_output:  # transformers ties these to model.shared itself
        for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
            del out[name]
    bias = torch.zeros(1, model.output_proj.weight.shape[0])
    if model.output_proj.bias is not None:  # model.output_bias
        bias[0] = model.output_proj.bias.detach().float()
    bias[0, [PAD_ID, BOS_ID]] = FORBIDDEN_LOGIT_BIAS
    put("final_logits_bias", bias)
    return out


def hf_config(model: Transformer, cfg: Config) -> dict:
    """config.json: the architecture, sizes and special ids."""
    m = cfg.model
    model_type, architecture = MODEL_CLASSES[m.norm]
    if not math.isclose(model.embed_scale, math.sqrt(m.d_model) if m.scale_embedding else 1.0):
        raise TmtError(f"unexpected embedding scale {model.embed_scale} for model.scale_embedding: {m.scale_embedding}")
    vocab_size = model.src_embed.weight.shape[0]
    config = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
        "d_model": m.d_model, "encoder_layers": m.n_encoder_layers, "decoder_layers": m.n_decoder_layers,
        "encoder_attention_heads": m.n_heads, "decoder_attention_heads": m.n_heads,
        "encoder_ffn_dim": m.d_ff, "decoder_ffn_dim": m.d_ff, "activation_function": m.activation,
        "max_position_embeddings": m.max_len, "scale_embedding": m.scale_embedding,
        "dropout": m.dropout, "attention_dropout": m.dropout if m.attention_dropout is None else m.attention_dropout,
        "activation_dropout": m.dropout if m.activation_dropout is None else m.activation_dropout,
        "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "decoder_start_token_id": BOS_ID,
        "forced_eos_token_id": None, "is_encoder_decoder": True, "tie_word_embeddings": m.tie_output,
        "dtype": "float32",
    }
    if m.norm == "post":
        config.update(decoder_vocab_size=vocab_size, share_encoder_decoder_embeddings=m.share_embeddings)
    return config


def generation_config(cfg: Config) -> dict:
    """generation_config.json: the run's decoding, which transformers' own beam search runs as tmt's:
    log-prob / length^α (`length_penalty`), a sentence done once `num_beams` hypotheses have ended
    (`early_stopping`). A greedy run leaves both out (transformers warns of them beside one beam)."""
    d = cfg.decode
    beams = {"length_penalty": d.length_penalty, "early_stopping": True} if d.beam_size > 1 else {}
    return {"decoder_start_token_id": BOS_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
            "forced_eos_token_id": None, "num_beams": d.beam_size, **beams,
            "max_length": cfg.model.max_len + 1}  # the start token and max_len tokens


SPECIAL_TOKENS_MAP = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}


def hf_tokenizer(tokenizers: TokenizerPair, max_len: int) -> str:
    """tokenizer.json: the run's BPE tokenizer, appending EOS to each source as tmt does; its
    target-language tags (>>ita<<) are not special there, so that a sentence written with one reads it."""
    settings = json.loads(tokenizers.src.to_str())
    for added in settings["added_tokens"]:
        if is_language_tag(added["content"]):
            added["special"] = False
    settings["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": EOS, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}},
                 {"SpecialToken": {"id": EOS, "type_id": 0}}],
        "special_tokens": {EOS: {"id": EOS, "ids": [EOS_ID], "tokens": [EOS]}}}
    settings["truncation"] = None
    settings["padding"] = None
    return json.dumps(settings, ensure_ascii=False, indent=2)


def tokenizer_config(max_len: int) -> dict:
    """tokenizer_config.json: a fast tokenizer with tmt's special tokens; sources cut as tmt cuts them
    (max_len - 1 tokens, then EOS) under `truncation=True`."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL_TOKENS_MAP, "model_max_length": max_len,
            "clean_up_tokenization_spaces": False, "padding_side": "right",
            "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids, which generate refuses
            "split_special_tokens": True}  # a "</s>" typed in a sentence is text, as in tmt


def _read_summary(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def model_card(summary: dict, cfg: Config, model: Transformer, checkpoint: str) -> str:
    """README.md: data, sizes, training time and hardware, test scores with their sacreBLEU
    signatures, and how to use the folder with transformers, from the run's summary.json."""
    provenance, data = summary.get("provenance") or {}, summary.get("data") or {}
    source = provenance.get("data") or {}
    src, tgt = source.get("src_lang") or "source", source.get("tgt_lang") or "target"
    name = summary.get("name") or cfg.name
    m, versions = cfg.model, provenance.get("versions") or {}
    architecture = MODEL_CLASSES[m.norm][1]
    if source.get("format") == "hub":
        corpus = f"the Hugging Face dataset `{source.get('path')}`" + (
            f" ({source['hub_config']})" if source.get("hub_config") else "")
    else:  # a local folder: its name, not where it was on the training machine
        corpus = f"local {source.get('format', 'text')} files (`{Path(str(source.get('path', '?'))).name}`)"
    pairs = data.get("pairs") or {}
    intro = (f"A Transformer encoder-decoder trained with tmt (transformer-mt {versions.get('transformer-mt', '')}) "
             f"and exported as `{architecture}`, which computes the same function ({m.norm}-norm layers, sinusoidal "
             f"positions); weights of checkpoint `{checkpoint}`.")
    about_data = f"{src} → {tgt} sentence pairs from {corpus}: " + (", ".join(
        f"{pairs[split]:,} {split}" for split in ("train", "valid", "test") if split in pairs) or "not recorded") + "."
    origin = summary.get("origin") if isinstance(summary.get("origin"), dict) else None  # `tmt import`'s
    if origin:  # what tmt knows of a model trained elsewhere
        src, tgt = cfg.data.src_lang, cfg.data.tgt_lang
        model_name = str(origin.get("model")) if origin.get("revision") else Path(str(origin.get("model"))).name
        where = f"`{model_name}`" + (f" (revision {origin['revision']})" if origin.get("revision") else "")
        intro = (f"A Marian (OPUS-MT) model imported into tmt from {where} with `tmt import` and exported as "
                 f"`{architecture}`; weights of checkpoint `{checkpoint}`.")
        about_data = "Trained elsewhere: see the original model's card for its data."
    lines = [
        "---", "library_name: transformers", "pipeline_tag: translation", f"language: [{src}, {tgt}]",
        "tags: [translation, tmt]", "---", "",
        f"# {name}: {src} → {tgt} translation", "",
        intro, "",
        "## Model", "",
        "| d_model | heads | encoder layers | decoder layers | FFN | vocabulary (joint BPE) | parameters "
        "| max tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {m.d_model} | {m.n_heads} | {m.n_encoder_layers} | {m.n_decoder_layers} | {m.d_ff} | "
        f"{model.src_embed.weight.shape[0]} | {model.num_parameters():,} | {m.max_len} |", "",
        "## Data", "",
        about_data, "",
        "## Training", "",
    ]
    seconds = summary.get("train_seconds")
    if origin:
        lines.append("Not trained by tmt: the weights are those imported (step 0).")
    elif summary.get("step") is not None and seconds is not None:
        processes = provenance.get("processes") or 1
        hardware = provenance.get("device", "an unrecorded device") + (
            f" × {processes} processes" if processes > 1 else "")
        software = ", ".join(f"{package} {version}" for package, version in versions.items() if version)
        lines.append(f"{summary['step']:,} of {summary.get('max_steps', summary['step']):,} steps "
                     f"({summary.get('status', 'status not recorded')}), {_duration(seconds)} of training on "
                     f"{hardware}, {summary.get('tgt_tokens_seen', 0):,} target tokens seen. Software: {software}.")
    else:
        lines.append("No training record (summary.json) was found beside the checkpoint.")
    lines += ["", "## Evaluation", ""]
    test = summary.get("test")
    if isinstance(test, dict) and "bleu" in test:
        lines += [f"Test split, {test.get('sentences', '?')} sentences, checkpoint `{test.get('checkpoint', '?')}`, "
                  f"beam {test.get('beam_size', '?')}, length penalty {test.get('length_penalty', '?')}:", "",
                  f"- BLEU {test['bleu']:.2f} (sacreBLEU `{test.get('bleu_signature', '')}`)",
                  f"- chrF {test.get('chrf', float('nan')):.2f} (sacreBLEU `{test.get('chrf_signature', '')}`)"]
    else:
        lines.append("The run has no test scores.")
    if isinstance(summary.get("best_bleu"), (int, float)) and summary["best_bleu"] >= 0:
        lines += ["", f"Best validation BLEU {summary['best_bleu']:.2f} at step {summary.get('best_step')}."]
    alpha = cfg.decode.length_penalty
    beams = (f" with `num_beams` {cfg.decode.beam_size}" if cfg.decode.beam_size > 1 else
             f" (greedily; with `num_beams` above 1, pass `length_penalty={alpha:g}` and `early_stopping=True`)")
    lines += [
        "", "## How to use", "", "```python",
        "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer", "",
        'tokenizer = AutoTokenizer.from_pretrained("MODEL_DIR")  # this folder, or its Hub repository',
        'model = AutoModelForSeq2SeqLM.from_pretrained("MODEL_DIR")',
        'batch = tokenizer(["A sentence to translate."], return_tensors="pt", padding=True, truncation=True)',
        "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))", "```", "",
        f"`generate` decodes as tmt does{beams}: hypotheses ranked by log-probability / length^{alpha:g} "
        "(`length_penalty`; the length counts the end-of-sentence token), a sentence finished once `num_beams` "
        "hypotheses have ended (`early_stopping=True`), as tmt and CTranslate2 search. tmt also caps each sentence at "
        f"{cfg.decode.max_len_a:g}·S + {cfg.decode.max_len_b} tokens for a source of S tokens (its end-of-sentence "
        "token included); `generate` caps a whole batch at `max_new_tokens` (by default `max_length`): a "
        "sentence that reaches tmt's cap gets tmt's translation when `max_new_tokens` is that cap.",
        ""]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s"


def _json(value: dict) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"
