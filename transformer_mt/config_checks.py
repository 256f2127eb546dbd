"""The config's range and cross-field checks: each problem as "dotted.key: what is wrong"."""

from __future__ import annotations

from transformer_mt.config import Config


def check_values(cfg: Config, defaulted: list[str] = ()) -> list[str]:
    """Cross-field and range checks, by dotted key.

    A check is skipped when a key it reads is in `defaulted` (or under a section there): that
    key's value was reported as unusable and replaced by its default, and judging the default
    would report a value nobody wrote.
    """
    p: list[str] = []

    def check(problem: str, *also_reads: str) -> None:
        """Report `problem` ("key: what is wrong"), unless its key or a key in `also_reads` was defaulted."""
        keys = [problem.split(":")[0], *also_reads]
        if not any(key == bad or key.startswith(f"{bad}.") or not bad for key in keys for bad in defaulted):
            p.append(problem)

    def at_least(key: str, value: float | None, floor: float, note: str = "") -> bool:
        """Report `key` when `value` is below `floor` (None, an unset optional key, passes); True if it passes."""
        if value is None or value >= floor:
            return True
        check(f"{key}: must be at least {floor}{note}, got {value}")
        return False

    d, tok, m, t, dec = cfg.data, cfg.tokenizer, cfg.model, cfg.train, cfg.decode
    if not 0 <= cfg.seed < 2**32:
        check(f"seed: must be in [0, 2**32), got {cfg.seed}")
    if (not cfg.name or "/" in cfg.name or "\0" in cfg.name or cfg.name in (".", "..")
            or len(cfg.name.encode("utf-8")) > 255):
        check(f"name: {cfg.name!r} must be a directory name: not empty, without '/', at most 255 bytes")
    if d.corpora:
        if d.path:
            check("data.corpora: given together with data.path; list every corpus under data.corpora (the first "
                  "gives validation and test), or use data.path alone (on the command line: --set data.path=null)", "data.path")
        for i, entry in enumerate(d.corpora):
            if not entry.path:
                check(f"data.corpora[{i}].path: missing; each corpus needs a path (a hub dataset or a local directory)")
            elif "\0" in entry.path:
                check(f"data.corpora[{i}].path: {entry.path!r} must name a hub dataset or a local directory")
            if entry.weight <= 0:
                check(f"data.corpora[{i}].weight: must be positive, got {entry.weight}")
    elif not d.path or "\0" in d.path:
        check(f"data.path: {d.path!r} must name a hub dataset or a local directory (or list corpora in data.corpora)",
              "data.corpora")
    for key, lang in (("data.src_lang", d.src_lang), ("data.tgt_lang", d.tgt_lang)):
        if not lang or any(c in lang for c in "/\\\0") or lang.strip() != lang:  # part of each file name
            check(f"{key}: {lang!r} must be a language code such as 'en' (it names the data files)")
    if d.src_lang == d.tgt_lang:
        check(f"data.tgt_lang: must differ from data.src_lang ({d.src_lang!r})", "data.src_lang")
    for key, value in [("data.valid_size", d.valid_size), ("data.test_size", d.test_size),
                       ("data.max_words", d.max_words), ("data.max_length_ratio", d.max_length_ratio)]:
        at_least(key, value, 1)
    at_least("data.num_proc", d.num_proc, 1, " (or unset for automatic)")
    n_special = 4
    if tok.vocab_size <= n_special:
        check(f"tokenizer.vocab_size: {tok.vocab_size} leaves no room beyond the {n_special} special tokens")
    at_least("tokenizer.min_frequency", tok.min_frequency, 1)
    if not 0 <= tok.bpe_dropout < 1:
        check(f"tokenizer.bpe_dropout: must be in [0, 1) (0 = off), got {tok.bpe_dropout}")
    at_least("tokenizer.bpe_dropout_variants", tok.bpe_dropout_variants, 1)
    at_least("tokenizer.bpe_dropout_start_epoch", tok.bpe_dropout_start_epoch, 0)
    at_least("tokenizer.max_train_pairs", tok.max_train_pairs, 1, " (or unset for all pairs)")
    sizes = [("model.d_model", m.d_model), ("model.n_heads", m.n_heads), ("model.d_ff", m.d_ff)]
    if m.encoder_layers is None or m.decoder_layers is None:  # else n_layers sets nothing
        sizes.append(("model.n_layers", m.n_layers))
    for key, value in sizes:
        at_least(key, value, 1)
    for key, value in (("model.encoder_layers", m.encoder_layers), ("model.decoder_layers", m.decoder_layers)):
        at_least(key, value, 1, " (or unset for model.n_layers)")
    if m.n_heads >= 1 and m.d_model % m.n_heads:
        check(f"model.n_heads: {m.n_heads} does not divide model.d_model={m.d_model}", "model.d_model")
    at_least("model.max_len", m.max_len, 2, " (a token and end-of-sentence)")
    if not 0 <= m.dropout < 1:
        check(f"model.dropout: must be in [0, 1), got {m.dropout}")
    for key, value in (("model.attention_dropout", m.attention_dropout), ("model.activation_dropout", m.activation_dropout)):
        if value is not None and not 0 <= value < 1:
            check(f"{key}: must be in [0, 1), got {value}")
    if m.share_embeddings and not tok.joint:
        check("model.share_embeddings: true needs tokenizer.joint: true (one vocabulary for both sides)",
              "tokenizer.joint")
    for key, value in [("train.max_steps", t.max_steps), ("train.eval_every_steps", t.eval_every_steps),
                       ("train.save_every_steps", t.save_every_steps), ("train.log_every_steps", t.log_every_steps),
                       ("train.keep_last", t.keep_last), ("train.max_nonfinite_steps", t.max_nonfinite_steps),
                       ("train.accum_steps", t.accum_steps), ("train.pad_to_multiple", t.pad_to_multiple)]:
        at_least(key, value, 1)
    if t.batch_tokens != "auto" and t.batch_tokens < m.max_len:
        check(f"train.batch_tokens: {t.batch_tokens} cannot hold one sequence of model.max_len={m.max_len} tokens",
              "model.max_len")
    if t.lr <= 0:
        check(f"train.lr: must be positive, got {t.lr}")
    if at_least("train.min_lr", t.min_lr, 0) and t.lr > 0 and t.min_lr > t.lr:
        check(f"train.min_lr: {t.min_lr} is above the peak train.lr={t.lr}; the decay goes down to it", "train.lr")
    if at_least("train.warmup_steps", t.warmup_steps, 0) and t.lr_schedule in ("linear", "cosine") \
            and t.max_steps >= 1 and t.warmup_steps >= t.max_steps:
        check(f"train.warmup_steps: {t.warmup_steps} is not below train.max_steps={t.max_steps}, so "
              f"train.lr_schedule={t.lr_schedule} would never decay (from the end of warmup to train.min_lr at "
              "max_steps); lower it", "train.max_steps", "train.lr_schedule")
    if not 0 <= t.label_smoothing < 1:
        check(f"train.label_smoothing: must be in [0, 1), got {t.label_smoothing}")
    at_least("train.weight_decay", t.weight_decay, 0)
    if not all(0 <= b < 1 for b in t.betas):
        check(f"train.betas: each must be in [0, 1), got {list(t.betas)}")
    at_least("train.clip_grad_norm", t.clip_grad_norm, 0, " (0 disables)")
    decoder_layers = m.n_decoder_layers
    if decoder_layers >= 1 and not -decoder_layers <= t.attention_layer < decoder_layers:
        check(f"train.attention_layer: {t.attention_layer} is not a decoder layer (0..{decoder_layers - 1}, "
              "or negative to count from the last)", "model.n_layers", "model.decoder_layers")
    if at_least("train.average_last", t.average_last, 0, " (0 = use best.pt)") and t.average_last > t.keep_last:
        check(f"train.average_last: {t.average_last} is more than the train.keep_last={t.keep_last} "
              "step checkpoints a run keeps", "train.keep_last")
    if not 0 <= t.ema_decay < 1:
        check(f"train.ema_decay: must be in [0, 1) (0 = no EMA; 0.999 or 0.9999 are usual), got {t.ema_decay}")
    if t.init_from and "\0" in t.init_from:
        check(f"train.init_from: {t.init_from!r} must be the path of a run directory or a checkpoint")
    at_least("train.patience", t.patience, 0, " (0 = no early stopping)")
    at_least("train.eval_max_sentences", t.eval_max_sentences, 0, " (0 = all)")
    at_least("train.n_examples", t.n_examples, 0)
    for key, value in (("decode.max_len_a", dec.max_len_a), ("decode.max_len_b", dec.max_len_b)):
        at_least(key, value, 0)
    if dec.max_len_a == 0 and dec.max_len_b == 0:
        check("decode.max_len_b: 0 with decode.max_len_a 0 leaves no room for a translation (a·S + b must be ≥ 1)",
              "decode.max_len_a")
    if dec.batch_tokens < m.max_len:
        check(f"decode.batch_tokens: {dec.batch_tokens} cannot hold one source of model.max_len={m.max_len} tokens",
              "model.max_len")
    if at_least("decode.beam_size", dec.beam_size, 1, " (1 = greedy)") and dec.beam_size > tok.vocab_size - 3:
        check(f"decode.beam_size: {dec.beam_size} is more than the {tok.vocab_size - 3} hypotheses beam search can "
              f"keep with tokenizer.vocab_size={tok.vocab_size} (all tokens but PAD, BOS and EOS)", "tokenizer.vocab_size")
    at_least("decode.length_penalty", dec.length_penalty, 0)
    return p
