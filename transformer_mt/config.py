"""Typed, validated configuration: one frozen dataclass per section, loaded from YAML.

`load_config(path, overrides)` reads YAML, applies `--set a.b=value` overrides (values parsed
as YAML), checks every key and type, and raises one `ConfigError` listing every problem.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from transformer_mt.errors import ConfigError
from transformer_mt.files import write_text_atomic


@dataclass(frozen=True)
class CorpusEntry:
    """One corpus of `data.corpora`: where it is, and how often an epoch draws its pairs."""

    path: str = ""
    """Hub dataset name or local directory, as `data.path`."""
    weight: float = 1.0
    """Pairs of this corpus per epoch, per pair (see `data.corpora`); must be positive."""
    format: Literal["hub", "text", "tsv", "jsonl"] | None = None
    """As `data.format`; unset: `data.format`."""
    hub_config: str | None = None
    """As `data.hub_config`; unset: `data.hub_config`."""
    revision: str | None = None
    """As `data.revision`; unset: `data.revision`."""


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel corpus comes from and how it is filtered."""

    format: Literal["hub", "text", "tsv", "jsonl"] = "text"
    """`hub`: a HuggingFace Hub dataset with a `translation` column or a text column per language;
    `text`: aligned files `{split}.{lang}[.gz]`; `tsv`: `{split}.tsv` (source, a tab, target);
    `jsonl`: `{split}.jsonl`."""
    path: str = ""
    """Hub dataset name (e.g. `Helsinki-NLP/opus_books`) or a local directory; a relative
    directory is resolved against the config file's directory, or, given with `--set`, against
    the current directory."""
    hub_config: str | None = None
    """Hub dataset configuration name, e.g. `en-it`."""
    revision: str | None = None
    """Hub dataset revision (branch, tag or commit) to pin the data; `refs/convert/parquet` reads
    the hub's Parquet conversion of a dataset (`hub_config` then names its folder there)."""
    src_lang: str = "en"
    """Source language code, as in file suffixes, JSON keys and hub dataset columns."""
    tgt_lang: str = "it"
    """Target language code."""
    valid_size: int = 1000
    """Pairs carved from train (seeded) when the dataset has no validation split."""
    test_size: int = 1000
    """Pairs carved from train (seeded) when the dataset has no test split."""
    max_words: int = 128
    """Training pairs with more words on either side are dropped (words: whitespace-separated; in
    Chinese and Japanese, each character; Thai and other unspaced scripts need segmenting first)."""
    max_length_ratio: float = 3.0
    """Training pairs whose longer side has more than this many times the words (as counted for
    `max_words`) of the shorter side are dropped (likely misaligned)."""
    num_proc: int | None = None
    """Processes that tokenize a large split (100,000 pairs or more) into the token cache;
    unset: the machine's cores, at most 8. Smaller splits take one process."""
    corpora: tuple[CorpusEntry, ...] = ()
    """Several corpora trained on together, instead of `path`: a list of `{path: ..., weight: 2.0}`,
    each entry with its own `path` (required), `weight` (default 1) and optionally `format`,
    `hub_config`, `revision` (default: the `data.*` keys); languages and filters are `data.*`'s.
    Corpus c of n_c training pairs gives each epoch m = round(weight × n_c) pairs: each pair
    m // n_c times, plus m mod n_c distinct pairs drawn afresh each epoch (seeded by `seed` and the
    epoch): weight 2 shows each pair twice an epoch, 0.5 a random half of them, drawn anew each epoch
    (independently: two epochs need not cover the corpus). A weight giving a corpus no pair is refused.
    Validation and test come from the first corpus (its own splits, else carved from its train)."""


@dataclass(frozen=True)
class TokenizerConfig:
    """BPE tokenizers trained on the training split (HuggingFace `tokenizers`)."""

    vocab_size: int = 8000
    """Vocabulary size per tokenizer, special tokens included."""
    joint: bool = True
    """One tokenizer for both languages (needed for `model.share_embeddings`), else one each."""
    min_frequency: int = 2
    """A merge must occur at least this often in the training split."""
    max_train_pairs: int | None = None
    """Train the BPE on at most this many training pairs, a seeded random sample; unset: all.
    Counting words is most of the tokenizer's training time (10 M pairs: 7.5 min on 2 cores)."""
    bpe_dropout: float = 0.0
    """BPE-dropout (Provilkov et al. 2020) on the training pairs: each merge is skipped with this
    probability, so words are split into varied, smaller pieces (0.1 is the paper's; 0: off).
    Validation, test and translation always use plain BPE, and the saved tokenizers never drop.
    The training split is encoded `bpe_dropout_variants` times ahead into the token cache;
    epoch e trains on number 1 + (e mod that number); a resume reads the same cached ones.
    Use it with `model.norm: pre`: Multi30k's post-norm recipe (lr 0.005) stalls under it, as a
    target-side language model, with clipping too; pre-norm learns (docs/results.md)."""
    bpe_dropout_variants: int = 8
    """Segmentations of the training split cached for `bpe_dropout`, cycled by epoch; each costs
    one more encoding of the training split and its token ids on disk."""
    bpe_dropout_start_epoch: int = 0
    """The first epoch trained on `bpe_dropout` segmentations; the epochs before it train on plain
    BPE (epoch e >= it on number 1 + (e mod `bpe_dropout_variants`)). A post-norm model at a high
    rate can fail to learn to read its source under dropout from the first update
    (configs/multi30k-en-de.yaml, docs/results.md); starting after the warm-up avoided it there
    (warmup_steps / the steps per epoch `tmt data` reports), but trailed plain BPE."""


@dataclass(frozen=True)
class ModelConfig:
    """Encoder-decoder Transformer dimensions (defaults: Vaswani et al. 2017, base)."""

    d_model: int = 512
    """Width of embeddings and every sublayer output."""
    n_heads: int = 8
    """Attention heads; must divide `d_model`."""
    n_layers: int = 6
    """Layers in the encoder and in the decoder, unless the two keys below say otherwise."""
    encoder_layers: int | None = None
    """Encoder layers; unset: `n_layers`. A deep encoder with a shallow decoder decodes faster at
    about the same BLEU (Kasai et al. 2021: 12 and 1 against 6 and 6). A deeper post-norm stack at a
    high peak rate without clipping may never learn to read its source (Multi30k's recipe with 6 or
    8 encoder layers: docs/results.md); pre-norm (`norm: pre`) trains deep stacks more stably (Xiong
    et al. 2020)."""
    decoder_layers: int | None = None
    """Decoder layers; unset: `n_layers`."""
    d_ff: int = 2048
    """Inner width of the position-wise feed-forward network."""
    dropout: float = 0.1
    """Dropout on embeddings and on every sublayer output before the residual sum; also on
    attention weights and FFN activations unless the two keys below say otherwise."""
    attention_dropout: float | None = None
    """Dropout on attention probabilities; unset: `dropout`. fairseq's Transformer recipes use 0."""
    activation_dropout: float | None = None
    """Dropout on the FFN's hidden activations (after ReLU); unset: `dropout`. fairseq's recipes use 0."""
    norm: Literal["pre", "post"] = "pre"
    """`pre`: LayerNorm before each sublayer (stable without long warmup); `post`: the
    original paper's LayerNorm after the residual sum."""
    max_len: int = 256
    """Longest sequence in tokens: longer training pairs are dropped, longer inputs to
    translate are truncated."""
    share_embeddings: bool = True
    """Share source and target embeddings (requires `tokenizer.joint`)."""
    tie_output: bool = True
    """Tie the output projection to the target embedding (Press & Wolf 2017)."""

    # Unset depths stay None in the config (and in saved configs and checkpoints), so a run
    # written before these keys existed reads the same, and `n_layers` alone means what it did.
    @property
    def n_encoder_layers(self) -> int:
        """The encoder's depth: `encoder_layers`, else `n_layers`."""
        return self.n_layers if self.encoder_layers is None else self.encoder_layers

    @property
    def n_decoder_layers(self) -> int:
        """The decoder's depth: `decoder_layers`, else `n_layers`."""
        return self.n_layers if self.decoder_layers is None else self.decoder_layers


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, validation and checkpointing."""

    max_steps: int = 100_000
    """Optimizer updates to run."""
    batch_tokens: int | Literal["auto"] = "auto"
    """Token budget per batch: batch size × padded length (the longer of source and target).
    `auto`: on a CUDA GPU, sized for its memory and the model (`batch_budget`: the largest power
    of two whose activations fill at most half the memory, at most 65,536), said in the log; 4,096
    on a CPU or MPS. Set a number to keep a recipe's tokens per update on every device."""
    accum_steps: int = 1
    """Batches accumulated into one optimizer update (gradient accumulation). The loss is
    normalised by the target tokens of all of them, so the update equals one batch of
    accum_steps × batch_tokens; a step still means one update."""
    pad_to_multiple: int = 8
    """Batch lengths are padded up to a multiple of this on CUDA, where tensor cores want multiples
    of 8, and with `compile`, where it bounds the distinct shapes; elsewhere padding only costs
    time, so it is not applied. 1 disables. Never past `model.max_len`; `batch_tokens` counts the
    padded lengths. The loss ignores the padding."""
    compile: bool = False
    """Run the model through `torch.compile` for training steps (checkpoints still hold the plain
    module's weights). The first steps of each new batch shape are slow while it compiles; with
    `cuda_graphs` each shape compiles once, before its capture, and the graphs replay its kernels."""
    cuda_graphs: bool = True
    """On one CUDA GPU, capture each batch shape's whole update (forward, backward, clipping and
    the AdamW step) once as a CUDA graph and replay it: an update is then a few kernel launches
    instead of hundreds. Batches get a fixed row
    count per padded length (filler rows, no loss) so shapes repeat. Not with torchrun or fp16;
    `false` runs every step eagerly."""
    lr: float = 7e-4
    """Peak learning rate, reached at the end of warmup."""
    warmup_steps: int = 4000
    """Steps of linear warmup to `lr`, then the decay `lr_schedule` names."""
    lr_schedule: Literal["inverse_sqrt", "linear", "cosine"] = "inverse_sqrt"
    """Decay after warmup: `inverse_sqrt` ∝ 1/sqrt(step) (Vaswani et al. 2017 §5.3), never below
    `min_lr`; `linear` and `cosine` (half a period, Loshchilov & Hutter 2017) from `lr` down to
    `min_lr` at `max_steps`, the last update's rate. The rate of update N depends only on N and
    these keys, so resuming is exact; changed on resume (schedule, `lr`, `min_lr`, `max_steps`),
    the new curve sets the rate from the next update on."""
    min_lr: float = 0.0
    """The floor of the decay: where `linear` and `cosine` end, below which `inverse_sqrt` never goes."""
    label_smoothing: float = 0.1
    """Label-smoothing ε (Vaswani et al. 2017 §5.4)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW β1, β2 (Vaswani et al. 2017 §5.3)."""
    clip_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """`auto`: bf16 on GPUs that support it, else fp16 with a grad scaler on CUDA, fp32 elsewhere.
    `bf16` also runs on a CPU; with AVX512-BF16 it trained 1.6-1.9x faster (docs/benchmarks.md)."""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """`auto` picks cuda, then mps, then cpu."""
    attention_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto"
    """Attention kernel of training steps and the validation loss: `auto` on CUDA tries the
    memory-efficient kernel, then flash, then math, never cuDNN's (it plans every new shape anew:
    slower, docs/benchmarks.md); elsewhere PyTorch chooses. A named kernel is tried first, math
    after it (flash takes no padding mask: masked attention then runs on math). A kernel the device
    cannot run falls back to `auto` with a warning."""
    log_every_steps: int = 100
    """Steps between training-loss log lines and TensorBoard points."""
    eval_every_steps: int = 1000
    """Steps between validations (loss, perplexity, greedy BLEU and chrF); the last step is always validated too."""
    eval_max_sentences: int = 500
    """Validation sentences decoded for BLEU (a fixed seeded subset); 0 decodes all."""
    n_examples: int = 3
    """Example translations logged at each validation."""
    save_every_steps: int = 1000
    """Steps between checkpoints (one is also written at the end and at each new best validation
    BLEU, which `best.pt` then links to)."""
    keep_last: int = 3
    """Step checkpoints kept on disk, the newest by step (new bests between saves count too, see
    `save_every_steps`); `best.pt` is kept in addition."""
    bleu_tokenize: Literal["13a", "none", "intl", "zh", "char", "ja-mecab", "ko-mecab", "spm", "flores101",
                           "flores200"] = "13a"
    """sacreBLEU tokenizer for validation BLEU, `tmt evaluate` and the final test score: `13a`
    (sacreBLEU's default) for raw text, `none` for pre-tokenized text such as Multi30k's `tok/`."""
    patience: int = 0
    """Stop early when validation BLEU has not improved for this many validations in a row;
    0 trains to `max_steps`."""
    test_at_end: bool = True
    """After the last step, translate the test split with `decode.beam_size` beams using `best.pt`
    (or the average below) and write BLEU/chrF with their sacreBLEU signatures to
    `evaluation/test_scores.json`."""
    average_last: int = 0
    """For that final test, average the newest this-many step checkpoints instead of using
    `best.pt` (0: best.pt); see also `tmt average`. To average evenly spaced checkpoints, make
    `eval_every_steps` a multiple of `save_every_steps` (a new best between saves adds one)."""
    attention_layer: int = 0
    """Decoder layer (0 = first, -1 = last) whose cross-attention over one validation sentence
    is drawn in TensorBoard at each validation, next to the last layer's."""
    max_nonfinite_steps: int = 25
    """A batch whose loss or gradient is NaN/inf is skipped (no update, not counted as a step);
    this many in a row stop the run. With fp16, gradient-scaler overflows count too."""
    ema_decay: float = 0.0
    """Keep an exponential moving average (EMA) of the weights, in fp32 beside the model, updated
    after every update (skipped batches leave it alone) with decay min(ema_decay, (1 + n) / (10 + n))
    at its n-th update: the warm-up of TensorFlow's and timm's EMA, so early averages are not stuck
    near the random initial weights. 0 turns it off; 0.9999 is usual for long runs, and with a few
    thousand updates a smaller one such as 0.999 (the warm-up alone averages about the last 10% of
    updates). When on, validation (and so `best.pt`) scores the EMA weights, checkpoints hold them
    beside the trained ones (resumed exactly), and `tmt translate`, `evaluate` and `export` use
    them; `average_last` still averages the trained weights, and the final test then scores the
    EMA too (`test.ema` in `summary.json`). Turned on at a resume, the EMA starts there."""
    init_from: str | None = None
    """Start a new run from another run's weights (fine-tuning, domain adaptation): a run directory
    (its `best.pt`, else its newest step checkpoint) or a checkpoint file in a run's `checkpoints/`.
    The weights are those `tmt translate` uses (the EMA's, when the parent has one); the tokenizers
    are copied from the parent, whose `model.*` and `tokenizer.*` settings this config must repeat
    (except the dropout rates, the BPE-dropout keys and `max_len`, which only training reads); the
    optimizer, step count, schedule and data order start afresh. `summary.json` records the parent
    (`init_from`). Ignored when the run resumes from its own checkpoint. Relative to the
    config file, or to the current directory when set with `--set`; unset (null): a fresh model."""


BLEU_TOKENIZERS: tuple[str, ...] = typing.get_args(typing.get_type_hints(TrainConfig)["bleu_tokenize"])


@dataclass(frozen=True)
class DecodeConfig:
    """Decoding for validation, `tmt translate` and `tmt evaluate`."""

    max_len_a: float = 1.5
    """Generated length is capped at `max_len_a * source_length + max_len_b` tokens."""
    max_len_b: int = 10
    """See `max_len_a`."""
    batch_tokens: int = 4096
    """Token budget per decoding batch: sentences × longest source (× beam size), sorted by length."""
    beam_size: int = 1
    """Beams per sentence for `tmt translate` and `tmt evaluate`; 1 is greedy decoding.
    Validation during training always decodes greedily."""
    length_penalty: float = 0.6
    """GNMT length-penalty α for beam search: hypotheses are ranked by
    log-prob / ((5 + length) / 6)^α; 0 ranks by raw log-prob (favours short outputs)."""
    cuda_graphs: bool = True
    """Greedy and beam search on a CUDA GPU run fixed-shape decoder steps replayed as a CUDA
    graph (the same output; a step is then one launch instead of hundreds). `false`: eager steps."""
    attention_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto"
    """Attention kernel of decoding (validation BLEU, the final test, `tmt translate` and `tmt
    evaluate`): `auto` on CUDA tries flash, then memory-efficient, then math, never cuDNN's (it
    plans each new shape, and each decoding step is one: 3-7x slower on an H100); elsewhere
    PyTorch chooses. Otherwise as `train.attention_backend`."""
    quantize: Literal["none", "int8"] = "none"
    """`int8`: `tmt translate` and `tmt evaluate` on a CPU decode with int8 weights (per output
    row) and int8 activations (per call) in every linear layer, the vocabulary projection too:
    greedy decoding 1.4x faster than fp32's in docs/benchmarks.md's bench (whose fp32 greedy step,
    with a projection of 2^20+ weights, already takes most tokens from int8 logits where that
    provably gives fp32's choice), translations close to fp32's but not identical.
    Validation during training, the final test and GPUs decode as `none` does."""


@dataclass(frozen=True)
class Config:
    """A whole training run."""

    name: str = "run"
    """Run name; the run directory defaults to `runs/<name>`."""
    seed: int = 1
    """Seeds data splits, batching order, initialisation and dropout."""
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: object, line: int, first_line: int):
        super().__init__(f"duplicate key {key!r} (first at line {first_line}); the second would silently "
                         "replace the first")
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, refusing a key given twice in one mapping (PyYAML keeps the last:
    a repeated `train:` section would drop every setting of the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: its keys may be overridden, which is what merging is for
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # a list or mapping as a key: not hashable, and no config key anyway
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config file, apply `a.b=value` overrides, and validate it.

    A relative local `data.path` (and each `data.corpora` path, and `train.init_from`) is resolved
    against the config file's directory, or, when an override sets that key (or its section),
    against the current directory, as any command-line path is.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError([f"{path}: is a directory, not a config file"])
    if not path.is_file():
        raise ConfigError([f"{path}: config file not found"])
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except _DuplicateKey as err:
        raise ConfigError([f"{path}:{err.line}: {err}"]) from None
    except OSError as err:
        raise ConfigError([f"{path}: cannot read it ({err.strerror or err})"]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError([f"{where}: YAML syntax error: {problem}"]) from None
    except UnicodeDecodeError as err:
        raise ConfigError([f"{path}: not valid UTF-8 ({err.reason})"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections, not {type(raw).__name__}"])
    try:
        cfg = config_from_dict(apply_overrides(raw, overrides))
    except RecursionError:  # `a: &a [*a]`: a value that contains itself
        raise ConfigError([f"{path}: a YAML alias refers to the value that contains it"]) from None
    overridden = {item.partition("=")[0].strip() for item in overrides}  # keys as `apply_overrides` reads them

    def base(key: str) -> Path:  # where a relative path read from `key` (or from its section) is
        return Path.cwd() if overridden & {key, key.partition(".")[0]} else path.parent

    cfg = resolve_paths(cfg, path_base=base("data.path"), corpora_base=base("data.corpora"))
    if cfg.train.init_from and not user_path(cfg.train.init_from).is_absolute():
        init_from = str((base("train.init_from") / user_path(cfg.train.init_from)).resolve())
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=init_from))
    return cfg


def user_path(text: str) -> Path:
    """`text` as a path, `~` expanded where it can be (`~nobody` stays as written: no such file)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:  # an unknown user, or no home directory
        return Path(text)


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Return a copy of `raw` with each `a.b.c=value` set; values are parsed as YAML."""
    raw = _deep_copy(raw)
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=3e-4")
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return raw


def config_from_dict(raw: dict) -> Config:
    """Build and validate a `Config`; raise one `ConfigError` listing every problem."""
    problems: list[str] = []
    defaulted: list[str] = []
    cfg = _build(Config, raw, "", problems, defaulted)
    problems.extend(_check_values(cfg, defaulted))
    if problems:
        raise ConfigError(problems)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict of the config (tuples as lists), ready for YAML or a checkpoint."""

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return {
        f.name: ({k: plain(v) for k, v in dataclasses.asdict(getattr(cfg, f.name)).items()}
                 if dataclasses.is_dataclass(getattr(cfg, f.name)) else getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
    }


def with_defaults(saved: dict) -> dict:
    """A config dict saved by an older tmt (a checkpoint's, a run's `config.yaml`) with each key
    added since at its default, which is what that run ran with: compared with today's
    `config_to_dict`, only the settings that really changed differ."""
    defaults = config_to_dict(Config())
    filled = {**defaults, **saved}
    for section, values in defaults.items():
        if isinstance(values, dict) and isinstance(filled[section], dict):
            filled[section] = {**values, **filled[section]}
    return filled


def comparable_depths(config: dict) -> dict:
    """A config dict (`config_to_dict`'s form) as two runs' settings are compared (resume,
    `train.init_from`): the model's `encoder_layers` and `decoder_layers` as the depths they give,
    and `n_layers` left out, so that `n_layers: 4` and `encoder_layers: 4, decoder_layers: 4`
    compare equal and a differing depth is named by the side it changes."""
    model = config.get("model")
    if not isinstance(model, dict) or "n_layers" not in model:
        return config
    model = dict(model)
    n_layers = model.pop("n_layers")
    for key in ("encoder_layers", "decoder_layers"):
        model[key] = n_layers if model.get(key) is None else model[key]
    return {**config, "model": model}


def read_saved_config(path: Path) -> dict | None:
    """A run's saved `config.yaml` as a plain dict, unchecked; None when it is missing, unreadable
    or not a mapping (whoever asks then relies on the checkpoint's copy)."""
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (the run directory's `config.yaml`)."""
    write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True))


def resolve_paths(cfg: Config, path_base: Path, corpora_base: Path) -> Config:
    """Make a relative local `data.path` absolute, relative to `path_base`, and each `data.corpora`
    path, relative to `corpora_base`. With `format: hub` a path is a hub name unless it names a
    folder there (a local dataset in the hub layout)."""
    corpora = tuple(dataclasses.replace(entry, path=_resolved(entry.path, entry.format or cfg.data.format,
                                                              corpora_base))
                    for entry in cfg.data.corpora)
    path = _resolved(cfg.data.path, cfg.data.format, path_base)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path, corpora=corpora))


def _resolved(path: str, data_format: str, base_dir: Path) -> str:
    """A local `path` made absolute against `base_dir`; a hub name (or no path) as it is."""
    if not path:
        return path
    data_path = user_path(path)
    if data_format == "hub" and not (base_dir / data_path).is_dir():
        return path
    if not data_path.is_absolute():
        data_path = (base_dir / data_path).resolve()
    return str(data_path)


def _build(cls: type, raw: Any, prefix: str, problems: list[str], defaulted: list[str]) -> Any:
    """Instantiate dataclass `cls` from `raw`, appending problems instead of raising, and to
    `defaulted` the keys (or sections) whose value was unusable and so kept its default."""
    label = prefix.rstrip(".") or "config"
    if raw is None and prefix:  # `train:` with every key commented out: all defaults
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{label}: expected a mapping, got {_show(raw)}")
        defaulted.append(prefix.rstrip(".") or "")  # "" (the whole config) covers every key
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(names)})"
            problems.append(f"{prefix}{key}: unknown key{hint}")
    values = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], f"{prefix}{name}.", problems, defaulted)
        elif _entry_type(hint) is not None:  # a list of entries, each a mapping of its own keys
            entries = () if raw[name] is None else raw[name]  # `corpora:` with every entry commented out
            if not isinstance(entries, (list, tuple)):
                problems.append(f"{prefix}{name}: expected a list of mappings, got {_show(entries)}")
                defaulted.append(f"{prefix}{name}")
                continue
            values[name] = tuple(_build(_entry_type(hint), entry if entry is not None else {},
                                        f"{prefix}{name}[{i}].", problems, defaulted)
                                 for i, entry in enumerate(entries))
        elif raw[name] is None and defaults[name] == "":  # `path:` or `--set data.path=null`: unset, as the default
            values[name] = ""
        else:
            value, problem = _coerce(raw[name], hint)
            if problem:
                problems.append(f"{prefix}{name}: {problem}")
                defaulted.append(f"{prefix}{name}")
            else:
                values[name] = value
    return cls(**values)


def _entry_type(hint: Any) -> type | None:
    """The dataclass of a `tuple[Entry, ...]` field (a list of mappings in YAML), else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis \
            and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _coerce(value: Any, hint: Any) -> tuple[Any, str | None]:
    """Check `value` against a type hint; return (converted value, problem or None)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if value in args:
            return value, None
        advice = ""
        if "cuda" in args and isinstance(value, str) and re.fullmatch(r"cuda:\d+", value):  # a device
            advice = f" (to train on GPU {value[5:]}, set cuda and start with CUDA_VISIBLE_DEVICES={value[5:]})"
        return None, f"{_show(value)} is not one of {', '.join(map(str, args))}{advice}"
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None, None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0])
        for alternative in inner:  # e.g. int | Literal["auto"]: the first that takes the value
            converted, problem = _coerce(value, alternative)
            if problem is None:
                return converted, None
        return None, f"expected {' or '.join(map(_describe, inner))}, got {_show(value)}"
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return None, f"expected a list of {len(args)} numbers, got {_show(value)}"
        items = []
        for item, item_hint in zip(value, args):
            converted, problem = _coerce(item, item_hint)
            if problem:
                return None, problem
            items.append(converted)
        return tuple(items), None
    if hint is bool:
        return (value, None) if isinstance(value, bool) else (None, f"expected true or false, got {_show(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if isinstance(value, str):  # YAML 1.1 reads `1e5` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value), None  # allows 1e5 for step counts
        return None, f"expected an integer, got {_show(value)}"
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            return None, f"expected a number, got {_show(value)}"
        # NaN passes every range check below (each comparison is False); .inf is no sensible
        # setting either (max_len_a: .inf would cap every translation at one token).
        if not math.isfinite(number):
            return None, f"expected a finite number, got {_show(value)}"
        return number, None
    if hint is str:
        if isinstance(value, str):
            return value, None
        # YAML reads no, yes, on, off as booleans and 1.0 as a number: a language code `no` is False.
        quote = " (quote it, e.g. 'no', for YAML to read a string)" if isinstance(value, (bool, int, float)) else ""
        return None, f"expected a string, got {_show(value)}{quote}"
    raise TypeError(f"unsupported config type {hint}")  # a programming error, not a user one


def _check_values(cfg: Config, defaulted: list[str] = ()) -> list[str]:
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
    for key, value in [("data.valid_size", d.valid_size), ("data.test_size", d.test_size)]:
        if value < 1:
            check(f"{key}: must be at least 1, got {value}")
    if d.max_words < 1:
        check(f"data.max_words: must be at least 1, got {d.max_words}")
    if d.max_length_ratio < 1:
        check(f"data.max_length_ratio: must be at least 1, got {d.max_length_ratio}")
    if d.num_proc is not None and d.num_proc < 1:
        check(f"data.num_proc: must be at least 1 (or unset for automatic), got {d.num_proc}")
    n_special = 4
    if tok.vocab_size <= n_special:
        check(f"tokenizer.vocab_size: {tok.vocab_size} leaves no room beyond the {n_special} special tokens")
    if tok.min_frequency < 1:
        check(f"tokenizer.min_frequency: must be at least 1, got {tok.min_frequency}")
    if not 0 <= tok.bpe_dropout < 1:
        check(f"tokenizer.bpe_dropout: must be in [0, 1) (0 = off), got {tok.bpe_dropout}")
    if tok.bpe_dropout_variants < 1:
        check(f"tokenizer.bpe_dropout_variants: must be at least 1, got {tok.bpe_dropout_variants}")
    if tok.bpe_dropout_start_epoch < 0:
        check(f"tokenizer.bpe_dropout_start_epoch: must be at least 0, got {tok.bpe_dropout_start_epoch}")
    if tok.max_train_pairs is not None and tok.max_train_pairs < 1:
        check(f"tokenizer.max_train_pairs: must be at least 1 (or unset for all pairs), got {tok.max_train_pairs}")
    sizes = [("model.d_model", m.d_model), ("model.n_heads", m.n_heads), ("model.d_ff", m.d_ff),
             ("model.max_len", m.max_len)]
    if m.encoder_layers is None or m.decoder_layers is None:  # else n_layers sets nothing
        sizes.append(("model.n_layers", m.n_layers))
    for key, value in sizes:
        if value < 1:
            check(f"{key}: must be at least 1, got {value}")
    for key, value in (("model.encoder_layers", m.encoder_layers), ("model.decoder_layers", m.decoder_layers)):
        if value is not None and value < 1:
            check(f"{key}: must be at least 1 (or unset for model.n_layers), got {value}")
    if m.n_heads >= 1 and m.d_model % m.n_heads:
        check(f"model.n_heads: {m.n_heads} does not divide model.d_model={m.d_model}", "model.d_model")
    if m.max_len < 2:
        check(f"model.max_len: must be at least 2 (a token and end-of-sentence), got {m.max_len}")
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
        if value < 1:
            check(f"{key}: must be at least 1, got {value}")
    if t.batch_tokens != "auto" and t.batch_tokens < m.max_len:
        check(f"train.batch_tokens: {t.batch_tokens} cannot hold one sequence of model.max_len={m.max_len} tokens",
              "model.max_len")
    if t.lr <= 0:
        check(f"train.lr: must be positive, got {t.lr}")
    if t.min_lr < 0:
        check(f"train.min_lr: must be at least 0, got {t.min_lr}")
    elif t.lr > 0 and t.min_lr > t.lr:
        check(f"train.min_lr: {t.min_lr} is above the peak train.lr={t.lr}; the decay goes down to it", "train.lr")
    if t.warmup_steps < 0:
        check(f"train.warmup_steps: must be at least 0, got {t.warmup_steps}")
    if not 0 <= t.label_smoothing < 1:
        check(f"train.label_smoothing: must be in [0, 1), got {t.label_smoothing}")
    if t.weight_decay < 0:
        check(f"train.weight_decay: must be at least 0, got {t.weight_decay}")
    if not all(0 <= b < 1 for b in t.betas):
        check(f"train.betas: each must be in [0, 1), got {list(t.betas)}")
    if t.clip_grad_norm < 0:
        check(f"train.clip_grad_norm: must be at least 0 (0 disables), got {t.clip_grad_norm}")
    decoder_layers = m.n_decoder_layers
    if decoder_layers >= 1 and not -decoder_layers <= t.attention_layer < decoder_layers:
        check(f"train.attention_layer: {t.attention_layer} is not a decoder layer (0..{decoder_layers - 1}, "
              "or negative to count from the last)", "model.n_layers", "model.decoder_layers")
    if t.average_last < 0:
        check(f"train.average_last: must be at least 0 (0 = use best.pt), got {t.average_last}")
    elif t.average_last > t.keep_last:
        check(f"train.average_last: {t.average_last} is more than the train.keep_last={t.keep_last} "
              "step checkpoints a run keeps", "train.keep_last")
    if not 0 <= t.ema_decay < 1:
        check(f"train.ema_decay: must be in [0, 1) (0 = no EMA; 0.999 or 0.9999 are usual), got {t.ema_decay}")
    if t.init_from and "\0" in t.init_from:
        check(f"train.init_from: {t.init_from!r} must be the path of a run directory or a checkpoint")
    if t.patience < 0:
        check(f"train.patience: must be at least 0 (0 = no early stopping), got {t.patience}")
    if t.eval_max_sentences < 0:
        check(f"train.eval_max_sentences: must be at least 0 (0 = all), got {t.eval_max_sentences}")
    if t.n_examples < 0:
        check(f"train.n_examples: must be at least 0, got {t.n_examples}")
    for key, value in (("decode.max_len_a", dec.max_len_a), ("decode.max_len_b", dec.max_len_b)):
        if value < 0:
            check(f"{key}: must be at least 0, got {value}")
    if dec.max_len_a == 0 and dec.max_len_b == 0:
        check("decode.max_len_b: 0 with decode.max_len_a 0 leaves no room for a translation (a·S + b must be ≥ 1)",
              "decode.max_len_a")
    if dec.batch_tokens < m.max_len:
        check(f"decode.batch_tokens: {dec.batch_tokens} cannot hold one source of model.max_len={m.max_len} tokens",
              "model.max_len")
    if dec.beam_size < 1:
        check(f"decode.beam_size: must be at least 1 (1 = greedy), got {dec.beam_size}")
    if dec.length_penalty < 0:
        check(f"decode.length_penalty: must be at least 0, got {dec.length_penalty}")
    return p


def _describe(hint: Any) -> str:
    """What a value of type `hint` is, for a message: "an integer", "auto"."""
    if typing.get_origin(hint) is Literal:
        return ", ".join(map(str, typing.get_args(hint)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _deep_copy(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _deep_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deep_copy(v) for v in raw]
    return raw


def reference_markdown() -> str:
    """A Markdown table per config section: key, default and the field's docstring.

    Read from this module's source, so the README's configuration reference cannot drift
    from the dataclasses (a test compares them).
    """
    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {}
            body = node.body
            for item, following in zip(body, body[1:] + [None]):
                if isinstance(item, ast.AnnAssign) and isinstance(following, ast.Expr) \
                        and isinstance(following.value, ast.Constant):
                    docs[node.name][item.target.id] = " ".join(following.value.value.split())
    root = Config()
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(Config):
        value = getattr(root, f.name)
        if not dataclasses.is_dataclass(value):
            lines.append(f"| `{f.name}` | `{value!r}` | {docs['Config'].get(f.name, '')} |")
            continue
        for sub in dataclasses.fields(value):
            default = config_to_dict(root)[f.name][sub.name]
            meaning = docs[type(value).__name__].get(sub.name, "").replace("|", "\\|")
            lines.append(f"| `{f.name}.{sub.name}` | `{default!r}` | {meaning} |")
    return "\n".join(lines) + "\n"
