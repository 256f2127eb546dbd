"""The configuration's schema: one frozen dataclass per section, each field with its default and
docstring (the documentation's configuration reference is generated from them), and each section's `validate()`."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from transformer_mt.core.errors import Problems


@dataclass(frozen=True)
class CorpusEntry:
    """One corpus of `data.corpora`: where it is, and how often an epoch draws its pairs."""

    path: str = ""
    """Hub dataset name or local directory, as `data.path`."""
    weight: float = 1.0
    """Pairs of this corpus per epoch, per pair (see `data.corpora`); must be positive."""
    format: Literal["hub", "text", "tsv", "jsonl", "tmx"] | None = None
    """As `data.format`; unset: `data.format`."""
    hub_config: str | None = None
    """As `data.hub_config`; unset: `data.hub_config`."""
    revision: str | None = None
    """As `data.revision`; unset: `data.revision`."""
    target_lang: str | None = None
    """A multilingual model's target language for this corpus (Johnson et al. 2017): `ita` puts the
    token `>>ita<<` before each of its sources, and the tags become tokens of the trained tokenizer;
    validation and test then come from every corpus, scored per language pair too. Set on every
    corpus or none; translating then takes `--target-lang` (`decode.target_lang`)."""

    def validate(self, p: Problems, key: str) -> None:
        """Check this entry, `key` being `data.corpora[i]`."""
        if not self.path:
            p.add(f"{key}.path: missing; each corpus needs a path (a hub dataset or a local directory)")
        elif "\0" in self.path:
            p.add(f"{key}.path: {self.path!r} must name a hub dataset or a local directory")
        if self.weight <= 0:
            p.add(f"{key}.weight: must be positive, got {self.weight}")
        if self.target_lang is not None and (problem := language_code_problem(self.target_lang)):
            p.add(f"{key}.target_lang: {problem}")


FILTER_OPTIONS = {  # each filter of `data.filters` -> its options (besides `name` and `splits`)
    "dedup": ("normalize", "source_only", "held_out"), "length": ("unit", "min_length", "max_length"),
    "length_ratio": ("unit", "max_ratio"), "copies": ("max_similarity",), "language": ("languages", "min_confidence"),
    "characters": ("min_letters", "min_script", "scripts"), "numbers": (), "html": ("urls",)}


@dataclass(frozen=True)
class FilterEntry:
    """One filter of `data.filters`: its name, the splits it cleans and its options (unset: the filter's default)."""

    name: str = ""
    """`dedup`, `length`, `length_ratio`, `copies`, `language`, `characters`, `numbers` or `html`."""
    splits: tuple[Literal["train", "valid", "test"], ...] = ("train",)
    """The splits it removes pairs from; validation and test only when named here."""
    normalize: bool | None = None
    """`dedup`: also pairs equal once lowercased, without punctuation and with single spaces (default true;
    false: exact copies only)."""
    source_only: bool | None = None
    """`dedup`: pairs whose source repeats an earlier one, whatever their targets (default false)."""
    held_out: bool | None = None
    """`dedup`: also training pairs that repeat a validation or test pair, compared the same way, so that
    no test sentence is trained on (default false)."""
    unit: Literal["words", "characters"] | None = None
    """`length`, `length_ratio`: count words (as `max_words` counts them) or characters (default words)."""
    min_length: int | None = None
    """`length`: pairs with a shorter side are removed (default 1)."""
    max_length: int | None = None
    """`length`: pairs with a longer side are removed (default 100 words, 1000 characters)."""
    max_ratio: float | None = None
    """`length_ratio`: pairs whose longer side is more than this many times the shorter are removed (default 3)."""
    max_similarity: float | None = None
    """`copies`: pairs whose target is this similar to the source or more (the character Indel similarity of
    the lowercased sides, 2 x their longest common subsequence / their lengths, 1: equal) are removed
    (default 0.9)."""
    languages: tuple[str, str] | None = None
    """`language`: the ISO 639-1 codes the two sides must be identified as (default: `src_lang`, `tgt_lang`)."""
    min_confidence: float | None = None
    """`language`: a side is removed when it is identified as another language with this probability or
    more (default 0.5; 0: whenever its most probable language is another). Short sentences are often
    identified wrongly but with a low probability."""
    min_letters: float | None = None
    """`characters`: pairs with a side whose letters are a smaller share of its non-space characters are
    removed (default 0.5); a side with a control character or U+FFFD (a decoding error) always is."""
    min_script: float | None = None
    """`characters`: pairs with a side whose letters are less than this share in the side's script are
    removed (default 0.9)."""
    scripts: tuple[str, str] | None = None
    """`characters`: the Unicode scripts of the two sides, e.g. `[Latin, Cyrillic]` (default: from
    `src_lang` and `tgt_lang`, for the languages the data guide lists)."""
    urls: bool | None = None
    """`html`: also pairs with a side that is a URL or e-mail address alone (default true); markup
    (tags, entities) always."""

    def validate(self, p: Problems, key: str) -> None:
        """Check this entry, `key` being `data.filters[i]`."""
        if self.name not in FILTER_OPTIONS:
            close = difflib.get_close_matches(self.name, FILTER_OPTIONS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"the filters are {', '.join(FILTER_OPTIONS)}"
            p.add(f"{key}.name: {self.name!r} is not a filter ({hint})" if self.name else
                  f"{key}.name: missing; the filters are {', '.join(FILTER_OPTIONS)}")
            return
        own = FILTER_OPTIONS[self.name]
        for option in FILTER_OPTIONS_ALL:
            if getattr(self, option) is not None and option not in own:
                close = difflib.get_close_matches(option, own, n=1)
                hint = f"did you mean '{close[0]}'?" if close else (
                    f"its options are {', '.join(own)}" if own else "it has no options but splits")
                p.add(f"{key}.{option}: not an option of the {self.name} filter ({hint})")
        if not self.splits:
            p.add(f"{key}.splits: empty; name the splits to clean, e.g. [train]")
        for option in ("min_length", "max_length"):
            p.at_least(f"{key}.{option}", getattr(self, option), 0)
        if self.min_length is not None and self.max_length is not None and self.min_length > self.max_length:
            p.add(f"{key}.min_length: {self.min_length} is more than max_length {self.max_length}")
        p.at_least(f"{key}.max_ratio", self.max_ratio, 1)
        for option in ("max_similarity", "min_confidence", "min_letters", "min_script"):
            if (value := getattr(self, option)) is not None and not 0 <= value <= 1:
                p.add(f"{key}.{option}: must be in [0, 1], got {value}")


FILTER_OPTIONS_ALL = tuple(dict.fromkeys(option for options in FILTER_OPTIONS.values() for option in options))


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel corpus comes from and how it is filtered."""

    format: Literal["hub", "text", "tsv", "jsonl", "tmx", "none"] = "text"
    """`hub`: a HuggingFace Hub dataset with a `translation` column or a text column per language;
    `text`: aligned files `{split}.{lang}[.gz]`; `tsv`: `{split}.tsv` (source, a tab, target);
    `jsonl`: `{split}.jsonl`; `tmx`: `{split}.tmx` (Translation Memory eXchange, as OPUS ships
    it: each `<tu>`'s `<tuv>`s matched to `src_lang` and `tgt_lang` by `xml:lang`, case-insensitively
    and by primary subtag, `en-US` being `en`); every local file may be gzipped (`.gz`) and is
    streamed; `none`: no corpus (a run written by `tmt import`, whose model was trained elsewhere;
    `path` stays empty)."""
    path: str = ""
    """Hub dataset name (e.g. `Helsinki-NLP/opus_books`), a local directory, or a `.tmx` /
    `.tmx.gz` file (read as TMX with any `format` but `hub`: the training split, validation and
    test carved from it); a relative path is resolved against the config file's directory, or, given
    with `--set`, against the current directory."""
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
    """Several corpora trained on together, instead of `path`: a list of `{path: ..., weight: 2.0}`
    entries, each drawing round(weight × its pairs) pairs per epoch (seeded). Validation and test
    come from the first corpus, or with `target_lang` tags from every corpus (see the data guide)."""
    filters: tuple[FilterEntry, ...] = ()
    """Filters that clean the corpus when it is read, in order, each a name (its defaults) or
    `{name: length, max_length: 80, splits: [train, valid]}`: `dedup`, `length`, `length_ratio`,
    `copies`, `language`, `characters`, `numbers`, `html` (options: the data guide's "Cleaning a web
    corpus"). The training split only, unless a filter's `splits` names others; the pairs each removes
    are counted in the data report and written to `corpus_cache/removed/`."""
    max_filtered_share: float = 0.5
    """Training stops before it starts when `filters` remove more than this share of the training
    pairs (a filter's options are likely wrong); 1 allows any share but all."""

    @property
    def tags(self) -> tuple[str, ...]:
        """The target-language tags of `corpora` (`>>ita<<`), each once, in order."""
        return tuple(dict.fromkeys(language_tag(entry.target_lang) for entry in self.corpora if entry.target_lang))

    def validate(self, p: Problems, cfg: Config) -> None:
        if self.format == "none":
            if self.path or self.corpora:
                p.add("data.format: none names no corpus; set data.format to text, tsv, jsonl, tmx or hub for "
                      f"data.{'path' if self.path else 'corpora'}", "data.path", "data.corpora")
        elif self.corpora:
            if self.path:
                p.add("data.corpora: given together with data.path; list every corpus under data.corpora (the first "
                      "gives validation and test), or use data.path alone (on the command line: --set data.path=null)",
                      "data.path")
            for i, entry in enumerate(self.corpora):
                entry.validate(p, f"data.corpora[{i}]")
            untagged = [i for i, entry in enumerate(self.corpora) if entry.target_lang is None]
            if self.tags and untagged:
                p.add(f"data.corpora[{untagged[0]}].target_lang: missing; with target-language tags every corpus "
                      "names its target_lang (its sources carry the tag)")
        elif not self.path or "\0" in self.path:
            p.add(f"data.path: {self.path!r} must name a hub dataset or a local directory (or list corpora in "
                  "data.corpora)", "data.corpora")
        for key, lang in (("data.src_lang", self.src_lang), ("data.tgt_lang", self.tgt_lang)):
            if not lang or any(c in lang for c in "/\\\0") or lang.strip() != lang:  # part of each file name
                p.add(f"{key}: {lang!r} must be a language code such as 'en' (it names the data files)")
        if self.src_lang == self.tgt_lang:
            p.add(f"data.tgt_lang: must differ from data.src_lang ({self.src_lang!r})", "data.src_lang")
        for key in ("valid_size", "test_size", "max_words", "max_length_ratio"):
            p.at_least(f"data.{key}", getattr(self, key), 1)
        p.at_least("data.num_proc", self.num_proc, 1, " (or unset for automatic)")
        for i, entry in enumerate(self.filters):
            entry.validate(p, f"data.filters[{i}]")
        if not 0 < self.max_filtered_share <= 1:
            p.add(f"data.max_filtered_share: must be in (0, 1], got {self.max_filtered_share}")


AUTO_MAX_TRAIN_PAIRS = 1_000_000  # `tokenizer.max_train_pairs` unset: the BPE's sample (measured in the data guide)


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
    """Train the BPE on at most this many training pairs, a seeded random sample; unset: at most
    1,000,000 (a sample of that size segments held-out text as the whole corpus does, at a
    fraction of the time: see the data guide); a number above the training split's size: all of
    it. Counting words is most of the tokenizer's training time."""
    bpe_dropout: float = 0.0
    """BPE-dropout probability on the training pairs (Provilkov et al. 2020; 0.1 is the paper's, 0:
    off), from `bpe_dropout_variants` segmentations cached ahead; validation, test and translation
    use plain BPE."""
    bpe_dropout_variants: int = 8
    """Segmentations of the training split cached for `bpe_dropout`, cycled by epoch; each costs
    one more encoding of the training split and its token ids on disk."""
    bpe_dropout_start_epoch: int = 0
    """The first epoch (counted from 0) trained on `bpe_dropout` segmentations; the epochs before it
    train on plain BPE."""

    @property
    def train_pairs(self) -> int:
        """The most training pairs the BPE learns from: `max_train_pairs`, or when unset `AUTO_MAX_TRAIN_PAIRS`."""
        return self.max_train_pairs if self.max_train_pairs is not None else AUTO_MAX_TRAIN_PAIRS

    def validate(self, p: Problems, cfg: Config) -> None:
        n_special = 4  # PAD, UNK, BOS, EOS
        if self.vocab_size <= n_special:
            p.add(f"tokenizer.vocab_size: {self.vocab_size} leaves no room beyond the {n_special} special tokens")
        p.at_least("tokenizer.min_frequency", self.min_frequency, 1)
        p.fraction("tokenizer.bpe_dropout", self.bpe_dropout, " (0 = off)")
        p.at_least("tokenizer.bpe_dropout_variants", self.bpe_dropout_variants, 1)
        p.at_least("tokenizer.bpe_dropout_start_epoch", self.bpe_dropout_start_epoch, 0)
        p.at_least("tokenizer.max_train_pairs", self.max_train_pairs, 1, " (or unset for automatic)")


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
    about the same BLEU (Kasai et al. 2021)."""
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
    """Dropout on the FFN's hidden activations (after `activation`); unset: `dropout`. fairseq's recipes use 0."""
    activation: Literal["relu", "gelu", "swish"] = "relu"
    """The FFN's activation: `relu` (Vaswani et al. 2017), `gelu` (exact, erf-based) or `swish`
    (SiLU, x·sigmoid(x); OPUS-MT's Marian models use it)."""
    norm: Literal["pre", "post"] = "pre"
    """`pre`: LayerNorm before each sublayer (stable without long warmup); `post`: the
    original paper's LayerNorm after the residual sum."""
    max_len: int = 256
    """Longest sequence in tokens: longer training pairs are dropped, longer inputs to
    translate are truncated."""
    share_embeddings: bool = True
    """Share source and target embeddings: one vocabulary for both sides (`tokenizer.joint`, or an
    imported model's two SentencePiece models over one vocabulary)."""
    tie_output: bool = True
    """Tie the output projection to the target embedding (Press & Wolf 2017)."""
    output_bias: bool = False
    """A trained bias on the output logits, one per target token (Marian's `final_logits_bias`)."""
    scale_embedding: bool = True
    """Multiply token embeddings by sqrt(`d_model`) before adding positions (§3.4); `false`: as they are."""

    # Unset depths stay None in saved configs: `n_layers` alone sets both.
    @property
    def n_encoder_layers(self) -> int:
        """The encoder's depth: `encoder_layers`, else `n_layers`."""
        return self.n_layers if self.encoder_layers is None else self.encoder_layers

    @property
    def n_decoder_layers(self) -> int:
        """The decoder's depth: `decoder_layers`, else `n_layers`."""
        return self.n_layers if self.decoder_layers is None else self.decoder_layers

    def validate(self, p: Problems, cfg: Config) -> None:
        sizes = ["d_model", "n_heads", "d_ff"]
        if self.encoder_layers is None or self.decoder_layers is None:  # else n_layers sets nothing
            sizes.append("n_layers")
        for key in sizes:
            p.at_least(f"model.{key}", getattr(self, key), 1)
        for key in ("encoder_layers", "decoder_layers"):
            p.at_least(f"model.{key}", getattr(self, key), 1, " (or unset for model.n_layers)")
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            p.add(f"model.n_heads: {self.n_heads} does not divide model.d_model={self.d_model}", "model.d_model")
        p.at_least("model.max_len", self.max_len, 2, " (a token and end-of-sentence)")
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            p.fraction(f"model.{key}", getattr(self, key))
        # A run that trains its tokenizers trains one vocabulary per side unless joint; inherited ones
        # (train.init_from, an import) may be two over one vocabulary, as the parent's weights were.
        trains_tokenizers = not cfg.train.init_from and cfg.data.format != "none"
        if self.share_embeddings and not cfg.tokenizer.joint and trains_tokenizers:
            p.add("model.share_embeddings: true needs tokenizer.joint: true (one vocabulary for both sides)",
                  "tokenizer.joint")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, validation and checkpointing."""

    max_steps: int = 100_000
    """Optimizer updates to run."""
    batch_tokens: int | Literal["auto"] = "auto"
    """Token budget per batch: batch size × padded length (the longer side); with packed batches
    (`batching`), a pack's target tokens. `auto`: sized for a CUDA GPU's memory and the model,
    4,096 on a CPU or MPS."""
    accum_steps: int = 1
    """Batches accumulated into one optimizer update (gradient accumulation). The loss is
    normalised by the target tokens of all of them, so the update equals one batch of
    accum_steps × batch_tokens; a step still means one update."""
    pad_to_multiple: int = 8
    """Batch lengths are padded up to a multiple of this on CUDA (tensor cores) and with `compile`
    (fewer shapes), never past `model.max_len`; 1 disables."""
    batching: Literal["auto", "padded", "packed"] = "auto"
    """How training sentences fill a batch. `padded`: similar lengths together, one sentence a
    row, padded to the longest. `packed`: sentences laid end to end into a fixed pack of
    `batch_tokens` target tokens (the source side sized by the split's source/target ratio),
    attention within each sentence (FlashAttention's variable-length kernel on CUDA when attention
    dropout is 0); every update has the same shapes, one captured graph. `auto`: packed on CUDA
    when that kernel applies, else padded."""
    compile: bool = False
    """Run training steps through `torch.compile`; with `cuda_graphs` each batch shape compiles
    once, before its capture."""
    cuda_graphs: bool = True
    """On one CUDA GPU, capture each batch shape's whole update (forward, backward, clipping, AdamW)
    as a CUDA graph and replay it. Not with torchrun or fp16; `false` runs every step eagerly."""
    lr: float = 7e-4
    """Peak learning rate, reached at the end of warmup."""
    warmup_steps: int = 4000
    """Steps of linear warmup to `lr`, then the decay `lr_schedule` names (`linear` and `cosine`:
    fewer than `max_steps`, or they would never decay)."""
    lr_schedule: Literal["inverse_sqrt", "linear", "cosine"] = "inverse_sqrt"
    """Decay after warmup: `inverse_sqrt` ∝ 1/sqrt(step) (Vaswani et al. 2017), never below
    `min_lr`; `linear` or `cosine` from `lr` down to `min_lr` at `max_steps`."""
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
    `bf16` also runs on a CPU, faster where it has AVX512-BF16."""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """`auto` picks cuda, then mps, then cpu."""
    attention_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto"
    """Attention kernel of training steps: `auto` on CUDA tries memory-efficient, flash, then math,
    never cuDNN's; elsewhere PyTorch chooses. A named kernel is tried first, math after it."""
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
    """Stop early when the validation score `best_metric` names has not improved for this many
    validations in a row; 0 trains to `max_steps`."""
    best_metric: Literal["bleu", "chrf", "chrf++", "comet", "loss"] = "bleu"
    """What a validation is judged on: which step `best.pt` holds (and so the final test and
    `translate`), and what `patience` waits for: greedy BLEU, chrF, chrF++ or COMET (`valid_comet`)
    on the validation subset (higher is better), or the validation loss (lower is better)."""
    valid_comet: str | None = None
    """A COMET model that also scores each validation's translations (`valid/comet`): a Hub name
    such as Unbabel/wmt22-comet-da or a downloaded model folder. Needs the `comet` extra; meant for
    a GPU, where it runs on the training GPU and goes back to the CPU between validations."""
    test_at_end: bool = True
    """After the last step, translate the test split with `decode.beam_size` beams using `best.pt`
    (or the average below) and write BLEU/chrF with their sacreBLEU signatures to
    `evaluation/test_scores.json`."""
    average_last: int = 0
    """For the final test, average the newest this-many step checkpoints instead of using `best.pt`
    (0: `best.pt`); see also `tmt average`."""
    attention_figures: bool = True
    """Draw the cross-attention over the first validation sentence at each validation (TensorBoard's
    `valid/attention_layer_*` images); drawing takes a CPU about a tenth of a second per image: turn it
    off for tiny models validated every few steps."""
    attention_layer: int = 0
    """Decoder layer (0 = first, -1 = last) whose cross-attention over one validation sentence
    is drawn in TensorBoard at each validation (`attention_figures`), next to the last layer's."""
    max_nonfinite_steps: int = 25
    """A batch whose loss or gradient is NaN/inf is skipped (no update, not counted as a step);
    this many in a row stop the run. With fp16, gradient-scaler overflows count too."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights with this decay (warmed up as min(decay, (1
    + n) / (10 + n))); validation, `best.pt`, `translate` and `export` then use it. 0: off; 0.9999
    is usual for long runs."""
    init_from: str | None = None
    """Start a new run from another run's weights (fine-tuning): a run directory (its `best.pt`,
    else its newest checkpoint) or a checkpoint file; its tokenizers come along, and `model.*` and
    `tokenizer.*` default to its settings (keys given must equal them, but for dropout and
    `model.max_len`). Unset: a fresh model."""
    freeze: tuple[str, ...] = ()
    """Parts of the model not trained (no gradient, no optimizer state): `embeddings` (the source
    and target tables, and an output projection tied to them), `encoder`, `decoder` (each with its
    final LayerNorm), `output` (the projection and its bias; tied, the target table too), or
    layers such as `encoder.layers.3` or `decoder.layers.0-2` (counted from 0, ranges inclusive).
    Kept on resume. Empty: everything trains."""

    def validate(self, p: Problems, cfg: Config) -> None:
        for key in ("max_steps", "eval_every_steps", "save_every_steps", "log_every_steps", "keep_last",
                    "max_nonfinite_steps", "accum_steps", "pad_to_multiple"):
            p.at_least(f"train.{key}", getattr(self, key), 1)
        max_len = cfg.model.max_len
        if self.batch_tokens != "auto" and self.batch_tokens < max_len:
            p.add(f"train.batch_tokens: {self.batch_tokens} cannot hold one sequence of model.max_len={max_len} "
                  "tokens", "model.max_len")
        if self.lr <= 0:
            p.add(f"train.lr: must be positive, got {self.lr}")
        if p.at_least("train.min_lr", self.min_lr, 0) and self.lr > 0 and self.min_lr > self.lr:
            p.add(f"train.min_lr: {self.min_lr} is above the peak train.lr={self.lr}; the decay goes down to it",
                  "train.lr")
        if p.at_least("train.warmup_steps", self.warmup_steps, 0) and self.lr_schedule in ("linear", "cosine") \
                and self.max_steps >= 1 and self.warmup_steps >= self.max_steps:
            p.add(f"train.warmup_steps: {self.warmup_steps} is not below train.max_steps={self.max_steps}, so "
                  f"train.lr_schedule={self.lr_schedule} would never decay (from the end of warmup to train.min_lr "
                  "at max_steps); lower it", "train.max_steps", "train.lr_schedule")
        p.fraction("train.label_smoothing", self.label_smoothing)
        p.at_least("train.weight_decay", self.weight_decay, 0)
        if not all(0 <= b < 1 for b in self.betas):
            p.add(f"train.betas: each must be in [0, 1), got {list(self.betas)}")
        p.at_least("train.clip_grad_norm", self.clip_grad_norm, 0, " (0 disables)")
        if self.best_metric == "comet" and not self.valid_comet:
            p.add("train.best_metric: comet needs a COMET model in train.valid_comet", "train.valid_comet")
        layers = cfg.model.n_decoder_layers
        if layers >= 1 and not -layers <= self.attention_layer < layers:
            p.add(f"train.attention_layer: {self.attention_layer} is not a decoder layer (0..{layers - 1}, "
                  "or negative to count from the last)", "model.n_layers", "model.decoder_layers")
        if p.at_least("train.average_last", self.average_last, 0, " (0 = use best.pt)") \
                and self.average_last > self.keep_last:
            p.add(f"train.average_last: {self.average_last} is more than the train.keep_last={self.keep_last} "
                  "step checkpoints a run keeps", "train.keep_last")
        p.fraction("train.ema_decay", self.ema_decay, " (0 = no EMA; 0.999 or 0.9999 are usual)")
        if self.init_from and "\0" in self.init_from:
            p.add(f"train.init_from: {self.init_from!r} must be the path of a run directory or a checkpoint")
        for problem in freeze_problems(self.freeze, cfg.model):
            p.add(f"train.freeze: {problem}")
        p.at_least("train.patience", self.patience, 0, " (0 = no early stopping)")
        p.at_least("train.eval_max_sentences", self.eval_max_sentences, 0, " (0 = all)")
        p.at_least("train.n_examples", self.n_examples, 0)


FREEZE_PARTS = {"embeddings": ("src_embed.", "tgt_embed."), "encoder": ("encoder_layers.", "encoder_norm."),
                "decoder": ("decoder_layers.", "decoder_norm."), "output": ("output_proj.",)}
_FREEZE_LAYERS = re.compile(r"(encoder|decoder)\.layers\.(\d+)(?:-(\d+))?")


def freeze_problems(names: tuple[str, ...], model: ModelConfig) -> list[str]:
    """What is wrong with each of `train.freeze`'s names (`frozen_prefixes` reads them)."""
    problems = []
    for name in names:
        if name in FREEZE_PARTS:
            continue
        if not (match := _FREEZE_LAYERS.fullmatch(name)):
            examples = [*FREEZE_PARTS, "encoder.layers.0", "decoder.layers.0"]
            close = difflib.get_close_matches(name, examples, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"the parts are {', '.join(FREEZE_PARTS)}, or layers " \
                                                               "such as encoder.layers.0-2"
            problems.append(f"{name!r} is not a part of the model ({hint})")
            continue
        stack, first, last = match[1], int(match[2]), int(match[3] or match[2])
        depth = model.n_encoder_layers if stack == "encoder" else model.n_decoder_layers
        if last < first:
            problems.append(f"{name!r}: a range goes from the lower layer to the higher, e.g. {stack}.layers."
                            f"{last}-{first}")
        elif last >= depth:
            problems.append(f"{name!r}: the {stack} has layers 0-{depth - 1}")
    return problems


def frozen_prefixes(names: tuple[str, ...]) -> tuple[str, ...]:
    """The parameter-name prefixes (as in the model's state dict) of `train.freeze`'s valid names."""
    prefixes = []
    for name in names:
        if name in FREEZE_PARTS:
            prefixes += FREEZE_PARTS[name]
        elif match := _FREEZE_LAYERS.fullmatch(name):
            prefixes += [f"{match[1]}_layers.{i}." for i in range(int(match[2]), int(match[3] or match[2]) + 1)]
    return tuple(prefixes)


BLEU_TOKENIZERS: tuple[str, ...] = typing.get_args(typing.get_type_hints(TrainConfig)["bleu_tokenize"])


@dataclass(frozen=True)
class DecodeConfig:
    """Decoding for validation, `tmt translate` and `tmt evaluate`."""

    max_len_a: float = 1.5
    """Generated length is capped at `max_len_a * source_length + max_len_b` tokens (EOS and a target
    prefix, `tmt translate --prefix`, included)."""
    max_len_b: int = 10
    """See `max_len_a`."""
    batch_tokens: int = 4096
    """Token budget per decoding batch: sentences × longest source (× beam size), sorted by length."""
    beam_size: int = 1
    """Beams per sentence for `tmt translate` and `tmt evaluate`; 1 is greedy decoding.
    Validation during training always decodes greedily."""
    length_penalty: float = 1.0
    """Length-penalty α for beam search: hypotheses are ranked by log-prob / length^α, the length
    counting the EOS (as CTranslate2 and transformers rank them); 0 ranks by raw log-prob (favours
    short outputs)."""
    cuda_graphs: bool = True
    """Greedy and beam search on a CUDA GPU run fixed-shape decoder steps replayed as a CUDA
    graph (the same output; a step is then one launch instead of hundreds). `false`: eager steps."""
    attention_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto"
    """Attention kernel of decoding: `auto` on CUDA tries flash, memory-efficient, then math, never
    cuDNN's; elsewhere PyTorch chooses. Otherwise as `train.attention_backend`."""
    quantize: Literal["none", "int8"] = "none"
    """`int8`: `tmt translate` and `tmt evaluate` on a CPU decode with CTranslate2's int8 weights:
    faster, close to fp32. Validation and the final test decode as `none`."""
    engine: Literal["auto", "torch", "ctranslate2"] = "auto"
    """Inference engine for translate/evaluate: auto = CTranslate2 on a CPU when installed, else torch."""
    target_lang: str | None = None
    """The target language of a multilingual model (one whose vocabulary has target-language tags
    such as `>>ita<<`, OPUS-MT's or `data.corpora`'s `target_lang`): `ita` puts the token `>>ita<<`
    before each source of translate, evaluate, score and serve. Needed when the model knows two
    tags or more; a source line that begins with a tag of the model keeps its own. Unset: none."""

    def validate(self, p: Problems, cfg: Config) -> None:
        p.at_least("decode.max_len_a", self.max_len_a, 0)
        p.at_least("decode.max_len_b", self.max_len_b, 0)
        if self.max_len_a == 0 and self.max_len_b == 0:
            p.add("decode.max_len_b: 0 with decode.max_len_a 0 leaves no room for a translation (a·S + b must be ≥ 1)",
                  "decode.max_len_a")
        max_len, vocab_size = cfg.model.max_len, cfg.tokenizer.vocab_size
        if self.batch_tokens < max_len:
            p.add(f"decode.batch_tokens: {self.batch_tokens} cannot hold one source of model.max_len={max_len} tokens",
                  "model.max_len")
        if p.at_least("decode.beam_size", self.beam_size, 1, " (1 = greedy)") and self.beam_size > vocab_size - 3:
            p.add(f"decode.beam_size: {self.beam_size} is more than the {vocab_size - 3} hypotheses beam search can "
                  f"keep with tokenizer.vocab_size={vocab_size} (all tokens but PAD, BOS and EOS)",
                  "tokenizer.vocab_size")
        p.at_least("decode.length_penalty", self.length_penalty, 0)
        if self.target_lang is not None and (problem := language_code_problem(self.target_lang)):
            p.add(f"decode.target_lang: {problem}")


def language_tag(lang: str) -> str:
    """The source token that asks a multilingual model for target language `lang`: `>>lang<<` (OPUS-MT's)."""
    return f">>{lang}<<"


def language_code_problem(lang: str) -> str | None:
    """What is wrong with `lang` as the language code of a target-language tag (`ita`, not `>>ita<<`), or None."""
    if lang.startswith(">>") or lang.endswith("<<"):
        return f"give the language code alone, e.g. {lang.strip('<>')!r} for the tag {lang!r}"
    if not lang or any(c.isspace() or c in "<>" for c in lang):
        return f"{lang!r} must be a language code such as 'ita' (it names the tag >>ita<<)"
    return None


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

    def validate(self, p: Problems) -> None:
        """Add every range and cross-field problem of this config to `p`, section by section."""
        if not 0 <= self.seed < 2**32:
            p.add(f"seed: must be in [0, 2**32), got {self.seed}")
        if (not self.name or "/" in self.name or "\0" in self.name or self.name in (".", "..")
                or len(self.name.encode("utf-8")) > 255):
            p.add(f"name: {self.name!r} must be a directory name: not empty, without '/', at most 255 bytes")
        for section in (self.data, self.tokenizer, self.model, self.train, self.decode):
            section.validate(p, self)


def plain_copy(value: Any) -> Any:
    """A copy of nested dicts, lists and tuples (tuples as lists); other values as they are."""
    if isinstance(value, dict):
        return {k: plain_copy(v) for k, v in value.items()}
    return [plain_copy(v) for v in value] if isinstance(value, (list, tuple)) else value


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict of the config (tuples as lists), ready for YAML or a checkpoint."""
    return plain_copy(dataclasses.asdict(cfg))


def with_defaults(saved: dict) -> dict:
    """A saved config dict (a checkpoint's, a run's `config.yaml`) with each key it lacks at its default."""
    defaults = config_to_dict(Config())
    filled = {**defaults, **saved}
    for section, values in defaults.items():
        if isinstance(values, dict) and isinstance(filled[section], dict):
            filled[section] = {**values, **filled[section]}
    return filled


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of each setting that differs, in key order; keys a
    saved config lacks count at their defaults, and depths as the layers they give (`n_layers: 4` =
    `encoder_layers: 4, decoder_layers: 4`)."""
    saved, current = _comparable_depths(with_defaults(saved)), _comparable_depths(with_defaults(current))
    changes = []
    for section in sorted(set(saved) | set(current)):
        before, after = saved.get(section), current.get(section)
        if isinstance(before, dict) and isinstance(after, dict):
            changes += [(f"{section}.{key}", before.get(key), after.get(key))
                        for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
        elif before != after:
            changes.append((section, before, after))
    return changes


def _comparable_depths(config: dict) -> dict:
    model = config.get("model")
    if not isinstance(model, dict) or "n_layers" not in model:
        return config
    model = dict(model)
    n_layers = model.pop("n_layers")
    for key in ("encoder_layers", "decoder_layers"):
        model[key] = n_layers if model.get(key) is None else model[key]
    return {**config, "model": model}
