"""The Transformer of `model.py` at inference, in numpy: encoder, incremental decoder with a
key/value cache, greedy and beam search for one sentence at a time.

It exists so that `tmt translate "a sentence"` on a CPU need not import torch (over a second,
docs/benchmarks.md): the demo model decodes a sentence in milliseconds. fp32 throughout. The
search rules are `decoding.py`'s (length cap, forbidden PAD/BOS, EOS handling, GNMT length
penalty, the first index among tied tokens, the earlier hypothesis among tied scores), and
tests/test_numpy_translation.py holds its translations equal to `Translator.translate`'s. A model
option it does not implement is named by `unsupported_reason`, and the caller uses torch.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from transformer_mt.config import Config, DecodeConfig, ModelConfig

# The config fields this module implements; another field at a value other than its default
# changes the model or its decoding in a way not written here.
_MODEL_FIELDS = {"d_model", "n_heads", "n_layers", "encoder_layers", "decoder_layers", "d_ff", "dropout",
                 "attention_dropout", "activation_dropout", "norm", "max_len", "share_embeddings", "tie_output"}
_DECODE_FIELDS = {"max_len_a", "max_len_b", "batch_tokens", "beam_size", "length_penalty", "cuda_graphs",
                  "attention_backend", "quantize"}
_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which model.py keeps
_MASKED = np.finfo(np.float32).min  # decoding._forbid_special's fill for PAD and BOS


def unsupported_reason(cfg: Config) -> str | None:
    """Why this module cannot decode as torch would for the run `cfg` on a CPU, or None."""
    for section, known in ((cfg.model, _MODEL_FIELDS), (cfg.decode, _DECODE_FIELDS)):
        for field in dataclasses.fields(section):
            if field.name not in known and getattr(section, field.name) != field.default:
                return f"{type(section).__name__}.{field.name} = {getattr(section, field.name)!r}"
    if cfg.model.norm not in ("pre", "post"):
        return f"model.norm: {cfg.model.norm}"
    if cfg.decode.quantize != "none":
        return f"decode.quantize: {cfg.decode.quantize}"
    if cfg.decode.attention_backend not in ("auto", "math"):  # torch warns that a CPU cannot choose it
        return f"decode.attention_backend: {cfg.decode.attention_backend}"
    if cfg.train.precision == "bf16":  # torch decodes such a run under bf16 autocast on a CPU
        return "train.precision: bf16"
    return None


def expected_weight_names(cfg: ModelConfig) -> set[str]:
    """The state-dict keys of `model.Transformer` of `cfg` (tied weights under each of their names)."""
    def linear(name: str) -> list[str]:
        return [f"{name}.weight", f"{name}.bias"]
    names = ["src_embed.weight", "tgt_embed.weight", "output_proj.weight"]
    for i in range(cfg.n_encoder_layers):
        prefix = f"encoder_layers.{i}"
        for part in ("self_attn.qkv_proj", "self_attn.out_proj", "ffn.linear1", "ffn.linear2",
                     "attn_block.norm", "ffn_block.norm"):
            names += linear(f"{prefix}.{part}")
    for i in range(cfg.n_decoder_layers):
        prefix = f"decoder_layers.{i}"
        for part in ("self_attn.qkv_proj", "self_attn.out_proj", "cross_attn.q_proj", "cross_attn.kv_proj",
                     "cross_attn.out_proj", "ffn.linear1", "ffn.linear2", "self_block.norm", "cross_block.norm",
                     "ffn_block.norm"):
            names += linear(f"{prefix}.{part}")
    if cfg.norm == "pre":
        names += linear("encoder_norm") + linear("decoder_norm")
    return set(names)


def sinusoidal_positions(length: int, d_model: int) -> np.ndarray:
    """`model.sinusoidal_positions` in numpy: (length, D) float32."""
    position = np.arange(length, dtype=np.float32)[:, None]  # (L, 1)
    inv_freq = np.exp(np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-math.log(10000.0) / d_model))
    table = np.zeros((length, d_model), dtype=np.float32)
    table[:, 0::2] = np.sin(position * inv_freq)
    table[:, 1::2] = np.cos(position * inv_freq[: d_model // 2])
    return table


def max_target_length(src_length: int, decode: DecodeConfig, model_max_len: int) -> int:
    """`decoding.max_target_lengths` of one source of `src_length` tokens (EOS included), in its fp32."""
    limit = math.floor(np.float32(decode.max_len_a) * np.float32(src_length) + np.float32(decode.max_len_b))
    return min(max(limit, 1), model_max_len)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """nn.LayerNorm over the last axis."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    variance = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(variance + np.float32(_LAYER_NORM_EPS)) * weight + bias


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class NumpyTransformer:
    """`model.Transformer`'s `encode` and cached one-position `decode` for one source sentence,
    on its state-dict weights as float32 arrays (`checkpoint_reader`)."""

    def __init__(self, weights: dict[str, np.ndarray], cfg: ModelConfig, *, pad_id: int, bos_id: int):
        missing, extra = expected_weight_names(cfg) - set(weights), set(weights) - expected_weight_names(cfg)
        if missing or extra:
            raise ValueError(f"weights do not fit the config: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
        self.cfg = cfg
        self.forbidden = [pad_id, bos_id]  # never generated (decoding._forbid_special)
        self.pre_norm = cfg.norm == "pre"
        self.heads = cfg.n_heads
        self.weights = {name: (array.T.copy() if array.ndim == 2 and "embed" not in name else array)
                        for name, array in weights.items() if name != "output_proj.weight"}  # (in, out) kernels
        self.output_kernel = weights["output_proj.weight"].T.copy()  # (D, V)
        self.embed_scale = np.float32(math.sqrt(cfg.d_model))
        self.positions = sinusoidal_positions(cfg.max_len, cfg.d_model)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.weights[f"{name}.weight"] + self.weights[f"{name}.bias"]

    def residual(self, x: np.ndarray, norm: str, sublayer) -> np.ndarray:
        """`model.Residual` at inference (no dropout), pre- or post-norm."""
        weight, bias = self.weights[f"{norm}.weight"], self.weights[f"{norm}.bias"]
        if self.pre_norm:
            return x + sublayer(layer_norm(x, weight, bias))
        return layer_norm(x + sublayer(x), weight, bias)

    def ffn(self, x: np.ndarray, prefix: str) -> np.ndarray:
        return self.linear(np.maximum(self.linear(x, f"{prefix}.ffn.linear1"), 0), f"{prefix}.ffn.linear2")

    def split_heads(self, x: np.ndarray, parts: int) -> np.ndarray:
        """x (..., L, parts·D) -> (parts, ..., H, L, Dh)."""
        *lead, L, PD = x.shape
        heads = x.reshape(*lead, L, parts, self.heads, PD // (parts * self.heads))  # (..., L, parts, H, Dh)
        return np.moveaxis(heads, (-3, -4), (0, -2))  # (parts, ..., H, L, Dh)

    def merge_heads(self, x: np.ndarray) -> np.ndarray:
        """x (..., H, L, Dh) -> (..., L, D)."""
        *lead, H, L, Dh = x.shape
        return np.swapaxes(x, -3, -2).reshape(*lead, L, H * Dh)

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Scaled dot-product attention: q (..., H, Tq, Dh) over k, v (..., H, Tk, Dh) -> (..., H, Tq, Dh)."""
        scores = (q @ np.swapaxes(k, -1, -2)) * np.float32(1.0 / math.sqrt(q.shape[-1]))
        return softmax(scores) @ v

    def embed(self, name: str, ids: np.ndarray, offset: int) -> np.ndarray:
        """ids (..., L) -> (..., L, D): scaled embeddings plus the positions offset.."""
        L = ids.shape[-1]
        return self.weights[f"{name}.weight"][ids] * self.embed_scale + self.positions[offset:offset + L]

    def encode(self, src_ids: list[int]) -> np.ndarray:
        """One source (ids with EOS, no padding) -> memory (S, D)."""
        x = self.embed("src_embed", np.asarray(src_ids), 0)
        for i in range(self.cfg.n_encoder_layers):
            prefix = f"encoder_layers.{i}"

            def self_attention(h: np.ndarray) -> np.ndarray:
                q, k, v = self.split_heads(self.linear(h, f"{prefix}.self_attn.qkv_proj"), 3)  # (H, S, Dh) each
                return self.linear(self.merge_heads(self.attend(q, k, v)), f"{prefix}.self_attn.out_proj")
            x = self.residual(x, f"{prefix}.attn_block.norm", self_attention)
            x = self.residual(x, f"{prefix}.ffn_block.norm", lambda h: self.ffn(h, prefix))
        return layer_norm(x, self.weights["encoder_norm.weight"], self.weights["encoder_norm.bias"]) \
            if self.pre_norm else x

    def start(self, memory: np.ndarray, rows: int, capacity: int) -> DecoderState:
        """A decoder state for `rows` hypotheses of the source `memory` (S, D), up to `capacity` positions."""
        cross = [self.split_heads(self.linear(memory, f"decoder_layers.{i}.cross_attn.kv_proj"), 2)
                 for i in range(self.cfg.n_decoder_layers)]  # (2, H, S, Dh) each: shared by every row
        D, H = self.cfg.d_model, self.heads
        cache = np.zeros((self.cfg.n_decoder_layers, 2, rows, H, capacity, D // H), dtype=np.float32)
        return DecoderState(cross, cache, 0)

    def step(self, state: DecoderState, tokens: np.ndarray) -> np.ndarray:
        """Feed each row's next token (N,) at position `state.length` -> logits (N, V) fp32."""
        t = state.length
        y = self.embed("tgt_embed", tokens[:, None], t)  # (N, 1, D)
        for i in range(self.cfg.n_decoder_layers):
            prefix = f"decoder_layers.{i}"
            layer_cache = state.cache[i]  # (2, N, H, capacity, Dh)

            def self_attention(h: np.ndarray) -> np.ndarray:
                q, k, v = self.split_heads(self.linear(h, f"{prefix}.self_attn.qkv_proj"), 3)  # (N, H, 1, Dh) each
                layer_cache[0, :, :, t:t + 1] = k
                layer_cache[1, :, :, t:t + 1] = v
                out = self.attend(q, layer_cache[0, :, :, :t + 1], layer_cache[1, :, :, :t + 1])
                return self.linear(self.merge_heads(out), f"{prefix}.self_attn.out_proj")

            def cross_attention(h: np.ndarray) -> np.ndarray:
                (q,) = self.split_heads(self.linear(h, f"{prefix}.cross_attn.q_proj"), 1)  # (N, H, 1, Dh)
                k, v = state.cross[i]  # (H, S, Dh) each
                return self.linear(self.merge_heads(self.attend(q, k, v)), f"{prefix}.cross_attn.out_proj")
            y = self.residual(y, f"{prefix}.self_block.norm", self_attention)
            y = self.residual(y, f"{prefix}.cross_block.norm", cross_attention)
            y = self.residual(y, f"{prefix}.ffn_block.norm", lambda h: self.ffn(h, prefix))
        state.length += 1
        if self.pre_norm:
            y = layer_norm(y, self.weights["decoder_norm.weight"], self.weights["decoder_norm.bias"])
        logits = y[:, 0] @ self.output_kernel  # (N, V)
        logits[:, self.forbidden] = _MASKED  # never PAD or a second BOS
        return logits


@dataclasses.dataclass
class DecoderState:
    """One sentence's decoding: cross-attention K/V, and the self-attention cache of its rows."""

    cross: list[np.ndarray]  # per layer (2, H, S, Dh)
    cache: np.ndarray  # (layers, 2, N, H, capacity, Dh)
    length: int  # positions fed so far

    def reorder(self, rows: np.ndarray) -> None:
        """Keep rows `rows` (N,) in that order (beam search's surviving beams)."""
        self.cache[:, :, :, :, : self.length] = self.cache[:, :, rows, :, : self.length]


def greedy_search(model: NumpyTransformer, src_ids: list[int], decode: DecodeConfig, *, bos_id: int,
                  eos_id: int) -> list[int]:
    """`decoding.greedy_decode` of one source (ids with EOS): the generated ids, without BOS and EOS."""
    limit = max_target_length(len(src_ids), decode, model.cfg.max_len)
    state = model.start(model.encode(src_ids), 1, limit)
    generated, token = [], bos_id
    for _ in range(limit):
        token = int(model.step(state, np.array([token]))[0].argmax())  # the first index among ties
        if token == eos_id:
            break
        generated.append(token)
    return generated


def beam_search(model: NumpyTransformer, src_ids: list[int], decode: DecodeConfig, beam_size: int, *,
                bos_id: int, eos_id: int) -> list[int]:
    """`decoding.beam_search` (`advance_beams`) of one source with K = `beam_size` beams: the best
    finished hypothesis's ids, without BOS and EOS.

    Each step ranks the 2K best continuations by summed log-prob (from each beam's 2K best
    tokens); those of the top K that end (EOS, or any at the length cap) are scored log-prob /
    ((5 + length) / 6)^α and the best kept (an earlier one wins a tie); the K best that do not end
    go on. The search stops at the cap, once K have ended, or once the best ended one beats
    every live beam's best reachable score.
    """
    K, alpha = beam_size, decode.length_penalty
    limit = max_target_length(len(src_ids), decode, model.cfg.max_len)
    penalties = [((5.0 + n) / 6.0) ** alpha for n in range(limit + 1)]  # in Python floats, as decoding's fp64
    state = model.start(model.encode(src_ids), K, limit)
    tokens = np.full((K, limit + 1), -1, dtype=np.int64)  # BOS, then each live beam's tokens
    tokens[:, 0] = bos_id
    scores = np.full(K, -np.inf, dtype=np.float32)  # one live beam at first, so the K do not all pick alike
    scores[0] = 0.0
    best_score, best_ids, ended = -math.inf, [], 0
    for step in range(limit):
        log_probs = log_softmax(model.step(state, tokens[:, step]))  # (K, V)
        W = min(2 * K, log_probs.shape[1])
        row_tokens = np.stack([best_indices(row, W) for row in log_probs])  # (K, W) each beam's W best tokens
        candidates = (scores[:, None] + np.take_along_axis(log_probs, row_tokens, axis=1)).reshape(-1)  # (K·W,)
        chosen = descending_order(candidates)[: 2 * K]  # (2K,) best first
        cand_scores, cand_beam, cand_token = candidates[chosen], chosen // W, row_tokens.reshape(-1)[chosen]
        at_cap = step + 1 >= limit
        for score, beam, token in zip(cand_scores[:K], cand_beam[:K], cand_token[:K]):
            if (token == eos_id or at_cap) and score > -np.inf:
                ended += 1
                final = float(score) / penalties[step + 1]
                if final > best_score:  # strictly: an earlier hypothesis keeps a tie
                    best_score, best_ids = final, [*tokens[beam, 1:step + 1].tolist(), int(token)]
        live_scores = np.where(cand_token == eos_id, np.float32(-np.inf), cand_scores)
        pick = descending_order(live_scores)[:K]  # (K,)
        beaten = float(live_scores[pick[0]]) / penalties[limit] <= best_score
        if at_cap or ended >= K or (ended and beaten):  # n_best 1: one ended that no live beam can beat
            break
        rows = cand_beam[pick]
        tokens = tokens[rows]
        tokens[:, step + 1] = cand_token[pick]
        scores = live_scores[pick]
        state.reorder(rows)
    return best_ids[: best_ids.index(eos_id)] if eos_id in best_ids else best_ids


def best_indices(values: np.ndarray, k: int) -> np.ndarray:
    """`descending_order(values)[:k]` of a 1-D array without sorting all of it: the values at least the
    k-th largest (ties at it included), sorted."""
    if k >= values.shape[0]:
        return descending_order(values)[:k]
    threshold = values[np.argpartition(values, -k)[-k]]  # the k-th largest value
    at_least = np.flatnonzero(values >= threshold)  # ascending indices, k or more of them
    return at_least[descending_order(values[at_least])[:k]]


def descending_order(values: np.ndarray) -> np.ndarray:
    """The indices that sort the last axis best first, the lower index first among equal values."""
    return np.argsort(-values, axis=-1, kind="stable")
