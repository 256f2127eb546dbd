"""Decoding on a CPU: a copy of the model whose matrix products run on the faster CPU kernels, and
whose incremental decoder step is a flat sequence of tensor operations.

`decoding_model(model)` is what `evaluation.translate_ids` decodes with on a CPU. It computes what
the model computes (up to the order of float sums; tests/test_cpu_decoding.py checks logits and
translations; greedy decoding's tokens come through `ArgmaxScreen`, the fp32 argmax proved from int8
logits), with `quantize="int8"` an int8 approximation (weights per output channel, activations
per call). docs/benchmarks.md measures what each part saves.
"""

from __future__ import annotations

import copy
import platform
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.cpu_fast_path import Packing
from transformer_mt.errors import UsageError
from transformer_mt.kv_cache import KVCache
from transformer_mt.model import CrossAttention, Transformer

QUANTIZE_CHOICES = ("none", "int8")
# oneDNN's products cost ~20 µs more per call than MKL's: at 32 rows, a 256 x 256 weight's product was
# faster on MKL with AVX2 (greedy at batch 32: 0.97x the time) and the same with AVX-512; larger ones
# gain from oneDNN (docs/benchmarks.md). Weights of at most this many elements stay on MKL.
ONEDNN_ABOVE_ELEMENTS = 256 * 256
# Greedy decoding finds its tokens through `ArgmaxScreen` when the vocabulary projection has at least
# this many weights: 8,000 × 256 took 0.90x the time at batch 32; 1,000 × 128 (the demo model) 1.04x
# on its own sentences and 1.22x on another corpus's, whose uncertain steps it rescored (docs/benchmarks.md).
SCREEN_MIN_ELEMENTS = 2 ** 20


def onednn_available() -> bool:
    """oneDNN's packed-weight linear (the op `torch.compile` uses on CPUs) is in this torch build,
    on an x86 CPU (where it was measured; elsewhere MKL's or the build's BLAS products stay)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class DecodingLinear(nn.Module):
    """An `nn.Linear`'s x·Wᵀ + b (b may be absent) for decoding on a CPU, by the faster of two
    kernels for the rows at hand (docs/benchmarks.md, "CPU decoding against CTranslate2"):

    - one row (a batch-1 step): MKL with W stored (in, out), `kernel`;
    - more rows: oneDNN with W pre-packed in its own blocked layout (`packed`, made once), 1.1-1.8×
      MKL on the AMD EPYC VM (the vocabulary projection of 32 rows: 1.5 ms against 2.5 ms).

    `forward` follows autocast (its product is then `torch.addmm`, which autocast casts). The
    decoder step's `rows`, `relu` and `plus` run outside autocast only; `relu` and `plus` fuse the
    FFN's ReLU and the residual sum into oneDNN's product. The tensors are plain attributes, not
    buffers (a step reads them dozens of times; the copy is never saved or moved).
    """

    onednn_min_rows = 2

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool):
        super().__init__()
        weight = weight.detach()
        self.kernel = weight.t().contiguous()  # (in, out)
        self.bias = None if bias is None else bias.detach().clone()  # (out,)
        # An opaque oneDNN tensor: no storage (it cannot be saved, moved or deep-copied).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32) if onednn else None

    def _mkl(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.mm(rows, self.kernel) if self.bias is None else torch.addmm(self.bias, rows, self.kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        out = self._mkl(rows) if torch.is_autocast_enabled(x.device.type) else self.rows(rows)
        return out.view(*x.shape[:-1], out.shape[-1])

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (N, in) -> (N, out), outside autocast."""
        if self.packed is not None and rows.shape[0] >= self.onednn_min_rows:
            return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return self._mkl(rows)

    def relu(self, rows: torch.Tensor) -> torch.Tensor:
        """relu(x·Wᵀ + b) of rows (N, in), outside autocast."""
        if self.packed is not None and rows.shape[0] >= self.onednn_min_rows:
            return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "relu", [], "")
        return self._mkl(rows).relu_()

    def plus(self, rows: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + (x·Wᵀ + b) of rows (N, in), residual (N, out), outside autocast."""
        if self.packed is not None and rows.shape[0] >= self.onednn_min_rows:
            return torch.ops.mkldnn._linear_pointwise.binary(rows, residual, self.packed, self.bias, "add")
        return self._mkl(rows).add_(residual)


class Int8Linear(nn.Module):
    """x·Wᵀ + b with W quantised to int8 per output row (symmetric) and x per call
    (`torch.ao.quantization.quantize_dynamic`'s dynamic linear, per channel): about a third of
    the fp32 product's time on a CPU, at ~1% error in each output. Same methods as `DecodingLinear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (out,)
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensor creation as deprecated
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(weight, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0,
                                           torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), fp32."""
        out = self.rows(x.reshape(-1, x.shape[-1]).float())
        return out.view(*x.shape[:-1], out.shape[-1])

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        # reduce_range: 7-bit activations, as quantize_dynamic on x86 (no int16 overflow without VNNI)
        return torch.ops.quantized.linear_dynamic(rows, self.packed, True)

    def relu(self, rows: torch.Tensor) -> torch.Tensor:
        return self.rows(rows).relu_()

    def plus(self, rows: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.rows(rows).add_(residual)


class ArgmaxScreen:
    """Each row's argmax of an fp32 vocabulary projection x·Wᵀ + b, from an int8 approximation of
    it (`Int8Linear`: 1.0 against 2.4 ms for 32 rows × 8,000 words on an AVX2 EPYC VM) wherever a
    bound on the approximation's error proves which token leads, and elsewhere from the fp32 logits
    of the tokens the bound leaves in the running: the tokens are the fp32 projection's (up to the
    order of its float sums).

    For a row x (D,), each logit's int8 approximation is off by at most
        E = t·max_j ‖W_j‖₁ + (max_j s_j / 2)·(‖x‖₁ + D·t) + R,
    as the product quantises the rows at one step t = (max(x, 0) - min(x, 0)) / 127 over all of them
    (7-bit activations; each value off by at most t, rounding and the zero point's rounding
    together; at least 1e-4, where the product raises a smaller step) and row j of W at
    s_j = max|W_j| / 127 (off by at most s_j / 2), and R bounds the float rounding of both sums.
    Where the best approximate logit leads the second by more than 2E, its token is the argmax;
    elsewhere only tokens within 2E of the best can be (a trained model's uncertain steps: a few).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        weight = weight.detach().float()
        self.int8 = Int8Linear(weight, bias)
        self.dim = weight.shape[1]
        self.row_l1 = float(weight.abs().sum(dim=1).max())  # max_j ‖W_j‖₁
        self.half_step = float(weight.abs().amax(dim=1).max()) / 254  # max_j s_j / 2
        # fp32 sums of D products, each side: |error| <= D·2^-24·‖x‖₁·max|W| (doubled for the bias and scaling)
        self.rounding = 4 * self.dim * 2.0 ** -24 * float(weight.abs().max())

    def best(self, x: torch.Tensor, forbidden_ids: tuple[int, ...], exact: DecodingLinear) -> torch.Tensor:
        """x (N, D) fp32 -> (N,) long: each row's first argmax, among the tokens not in `forbidden_ids`,
        of the fp32 logits of `exact`, the projection the screen stands for: of the tokens in the
        running (its `kernel` columns and bias), or of all where they are many or no bound holds
        (NaN, inf: `exact.rows`)."""
        approx = _forbid(self.int8.rows(x), forbidden_ids)  # (N, V)
        ids = best_tokens(approx)  # (N,)
        first = approx.gather(1, ids[:, None])  # (N, 1)
        second = approx.scatter_(1, ids[:, None], torch.finfo(approx.dtype).min).amax(dim=1, keepdim=True)
        floor = first - 2 * self.bound(x)[:, None]  # (N, 1): no token below it can win
        open_rows = (~(second < floor)).nonzero()[:, 0]  # NaN rows too
        if open_rows.numel():
            approx.scatter_(1, ids[:, None], first)
            ids[open_rows] = self._rescored(x[open_rows], approx[open_rows], floor[open_rows], forbidden_ids, exact)
        return ids

    def _rescored(self, x: torch.Tensor, approx: torch.Tensor, floor: torch.Tensor, forbidden_ids: tuple[int, ...],
                  exact: DecodingLinear) -> torch.Tensor:
        """The first fp32 argmax of rows x (K, D), computed for the tokens whose approx (K, V) is at least
        floor (K, 1) alone; of every token where those are more than 16 a row or a floor is not finite."""
        running = approx >= floor  # (K, V); the forbidden are at the lowest float: never
        count = int(running.sum()) if bool(floor.isfinite().all()) else approx.numel()
        if count > 16 * approx.shape[0]:  # many (a loose bound, flat logits): the rows' product costs less
            return best_tokens(_forbid(exact.rows(x), forbidden_ids))
        rows, tokens = running.nonzero(as_tuple=True)
        logits = torch.full_like(approx, torch.finfo(approx.dtype).min)
        columns = exact.kernel.index_select(1, tokens)  # (D, count)
        bias = 0.0 if exact.bias is None else exact.bias[tokens]
        logits[rows, tokens] = torch.linalg.vecdot(x[rows], columns.t()) + bias
        return best_tokens(logits)

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, D) -> (N,): E, the most by which a logit of row x and its int8 approximation differ."""
        step = ((x.max().clamp(min=0) - x.min().clamp(max=0)) / 127).clamp(min=1e-4)  # t: one for all the rows
        l1 = x.abs().sum(dim=1)
        return step * self.row_l1 + self.half_step * (l1 + self.dim * step) + self.rounding * l1


def _forbid(logits: torch.Tensor, forbidden_ids: tuple[int, ...]) -> torch.Tensor:
    """logits (N, V) with the columns `forbidden_ids` at the lowest float, in place."""
    for token in forbidden_ids:
        logits[:, token] = torch.finfo(logits.dtype).min
    return logits


def best_tokens(logits: torch.Tensor, block: int = 64) -> torch.Tensor:
    """logits (N, V) -> (N,) long: each row's argmax, the first index among ties.

    `max(dim).indices` (torch's CPU `argmax` is slower still) does not vectorise on a CPU, `amax`
    does: with many rows on a CPU, take the maxima of blocks of `block` logits, then search only
    each row's first best block (32 × 8,000 logits: 67 µs against 231 µs, docs/benchmarks.md).
    """
    N, V = logits.shape
    head = V - V % block
    if N < 8 or head == 0 or logits.device.type != "cpu":
        return logits.max(dim=-1).indices
    best = (logits if head == V else logits[:, :head]).reshape(N, head // block, block).amax(dim=-1).max(dim=-1)
    start = best.indices.mul_(block)  # (N,) where each row's first best block starts
    lanes = torch.arange(block, device=logits.device)
    ids = logits.gather(1, start[:, None] + lanes).max(dim=-1).indices.add_(start)  # (N,)
    if head < V:  # the last V % block logits; on a tie the earlier index stays
        tail = logits[:, head:].max(dim=-1)
        ids = torch.where(tail.values > best.values, tail.indices + head, ids)
    return ids


@dataclass(frozen=True, slots=True)
class _LayerPlan:
    """What a decoder layer's step reads, gathered once: plain attribute reads instead of
    `nn.Module.__getattr__` lookups through three levels of submodules at every step."""

    norms: tuple[tuple[torch.Tensor, torch.Tensor, float], ...]  # self, cross, FFN: weight, bias, eps
    qkv: nn.Module  # head-major, its query rows pre-scaled by Dh^-0.5
    self_out: nn.Module
    q: nn.Module  # the cross-attention query, pre-scaled by Dh^-0.5
    cross_out: nn.Module
    cross_attn: CrossAttention  # its `project_kv` of the memory, on the first step
    ffn1: nn.Module
    ffn2: nn.Module


class CpuDecodingTransformer(Transformer):
    """A `Transformer` whose cached one-position `decode` (every step of greedy, beam and sampled
    decoding) runs `_step`: the same operations as the modules' path, without the module calls,
    lambdas, eval-mode dropouts, head splits and per-step mask conversions around them, with the
    ReLU and residual sums fused into the products and the cross-attention mask made once per
    batch. Any other call (a prefix, no cache, autocast) is the model's own `decode`."""

    pack_above = 0.06  # the share of padding in a batch above which `encode` skips the padded positions

    def _prepare(self, head_major_qkv: list[nn.Module], scaled_q: list[nn.Module], screen: ArgmaxScreen | None) -> None:
        """Per decoder layer, head_major_qkv: its q/k/v product with the output features in the order
        (head, q/k/v, Dh) instead of (q/k/v, head, Dh): a step's query and new key/value then come
        out as views that attention and the cache read without copies; scaled_q: its cross-attention
        query product. Both give queries already multiplied by attention's scale Dh^-0.5 (exact when
        Dh is a power of 4, as 64), so that `_attention` multiplies nothing more. screen: what
        `decode_best` finds a cached step's tokens with, None for the full projection."""
        self._screen = screen
        self._mask_key: torch.Tensor | None = None  # the src_mask whose additive form is `_mask`
        self._mask: torch.Tensor | None = None
        self._mask_one_row = False  # whether `_mask` is SDPA's form, for a step of one row
        self._scaled_embedding = self.tgt_embed.weight * self.embed_scale  # (V, D): embed() multiplies the same
        self._position_codes = self.positions  # a plain attribute: read at every step
        self._pre = self.cfg.norm == "pre"
        self._final_norm = (self.decoder_norm.weight, self.decoder_norm.bias, self.decoder_norm.eps) if self._pre else None
        self._plan = [_LayerPlan(tuple((b.norm.weight, b.norm.bias, b.norm.eps)
                                       for b in (layer.self_block, layer.cross_block, layer.ffn_block)),
                                 qkv, layer.self_attn.out_proj, q, layer.cross_attn.out_proj, layer.cross_attn,
                                 layer.ffn.linear1, layer.ffn.linear2)
                      for layer, qkv, q in zip(self.decoder_layers, head_major_qkv, scaled_q, strict=True)]

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """The model's `encode` as one flat sequence of tensor operations, with the FFN's ReLU and
        the residual sums fused into the products (the ReLU alone, over a fresh (B·S, d_ff) tensor,
        was 8.6% of the encoder's time), and, where at least `pack_above` of the positions are
        padding, every position-wise layer on the real positions only (`Packing`; attention pads
        its projections back). The memory is the model's at every real position; with packing,
        zero at the padding, which cross-attention masks. Under autocast or in training, the model's own."""
        if self.training or torch.is_autocast_enabled(src_ids.device.type):
            return super().encode(src_ids, src_mask)
        x = self.embed(self.src_embed, src_ids)  # (B, S, D)
        (B, S, D), pre = x.shape, self._pre
        packing = Packing.of(src_mask) if int(src_mask.sum()) <= (1.0 - self.pack_above) * B * S else None
        x = x.view(B * S, D) if packing is None else packing.pack(x)  # (N, D): all positions, or the real ones
        key_mask = src_mask[:, None, None, :]  # as `MultiHeadAttention.attend` gives it
        for layer in self.encoder_layers:
            attention, block = layer.self_attn, layer.attn_block
            h = block.norm(x) if pre else x
            qkv = attention.qkv_proj.rows(h)  # (N, 3D)
            qkv = qkv.view(B, S, 3 * D) if packing is None else packing.pad(qkv)
            out = F.scaled_dot_product_attention(*attention.split_heads(qkv, 3), attn_mask=key_mask)  # (B, H, S, Dh)
            out = out.transpose(1, 2).reshape(B, S, D)
            x = attention.out_proj.plus(out.view(B * S, D) if packing is None else packing.pack(out), x)
            x = x if pre else block.norm(x)
            block = layer.ffn_block
            h = block.norm(x) if pre else x
            x = layer.ffn.linear2.plus(layer.ffn.linear1.relu(h), x)
            x = x if pre else block.norm(x)
        x = self.encoder_norm(x)
        return x.view(B, S, D) if packing is None else packing.pad(x)

    def decode(self, tgt_ids: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               cache: KVCache | None = None, fp32_logits: bool = True) -> torch.Tensor:
        """The model's `decode`; memory and src_mask may also hold one row per group of G
        consecutive target rows (beam search's beams of one sentence: `shares_source_rows`)."""
        if not fp32_logits or not self._steps(tgt_ids, cache):
            groups = tgt_ids.shape[0] // memory.shape[0]
            if groups > 1:
                memory, src_mask = memory.repeat_interleave(groups, 0), src_mask.repeat_interleave(groups, 0)
            return super().decode(tgt_ids, memory, src_mask, cache, fp32_logits)
        return self.output_proj(self._step(tgt_ids[:, 0], memory, src_mask, cache))[:, None, :]

    def decode_best(self, tgt_ids: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                    cache: KVCache | None = None, forbidden_ids: tuple[int, ...] = ()) -> torch.Tensor:
        """The model's `decode_best`; a cached step finds the tokens through `ArgmaxScreen` when the
        copy has one (fp32 weights, a large enough vocabulary projection)."""
        if self._screen is None or not self._steps(tgt_ids, cache):
            return best_tokens(_forbid(self.decode(tgt_ids, memory, src_mask, cache)[:, -1, :], forbidden_ids))
        return self._screen.best(self._step(tgt_ids[:, 0], memory, src_mask, cache), forbidden_ids,
                                 self.output_proj)

    def _steps(self, tgt_ids: torch.Tensor, cache: KVCache | None) -> bool:
        """Whether a `decode` call of these arguments runs `_step`: one cached position, in eval mode, no autocast."""
        return (cache is not None and tgt_ids.shape[1] == 1 and not self.training
                and not torch.is_autocast_enabled(tgt_ids.device.type))

    def shares_source_rows(self, device_type: str) -> bool:
        """Whether cached one-position `decode` calls now run `_step`, which takes one memory row
        per group of target rows: each sentence's cross-attention keys and values are then
        projected and read once for all its beams (with its beams' queries as one product)."""
        return not self.training and not torch.is_autocast_enabled(device_type)

    def _cross_mask(self, src_mask: torch.Tensor, rows: int) -> torch.Tensor | None:
        """src_mask (B, S) bool -> additive: (B·H, 1, S) for `_attention`'s `baddbmm` when the step
        has 2+ rows, (1, 1, 1, S) for SDPA with one; None when nothing is masked. Made once per src_mask
        tensor (and form)."""
        if src_mask is not self._mask_key or (rows == 1) != self._mask_one_row:
            self._mask_key, self._mask_one_row = src_mask, rows == 1
            (B, S), H = src_mask.shape, self.cfg.n_heads
            additive = torch.zeros(src_mask.shape, dtype=torch.float32).masked_fill_(~src_mask, float("-inf"))
            self._mask = (None if bool(src_mask.all()) else additive[:, None, None, :] if rows == 1
                          else additive[:, None, None, :].expand(B, H, 1, S).reshape(B * H, 1, S))
        return self._mask

    def _step(self, ids: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (B,) long, the newest position's token -> the decoder's output (B, D) fp32, which the
        output projection takes to logits; the cache grows by one."""
        position = cache.length
        self.check_length(position + 1)
        B, H, pre = ids.shape[0], self.cfg.n_heads, self._pre
        y = F.embedding(ids, self._scaled_embedding) + self._position_codes[position]  # (B, D)
        mask = self._cross_mask(src_mask, B)
        for p, layer_cache in zip(self._plan, cache.layers):
            # Each sublayer as `Residual.forward` in eval mode: pre-norm y + f(norm(y)), post-norm norm(y + f(y)).
            norm = p.norms[0]
            h = _norm(y, norm) if pre else y
            qkv = p.qkv.rows(h).view(B * H, 3, -1)  # head-major: (B·H, q/k/v, Dh)
            # The new key and value (2, B·H, Dh) in one copy; (2, B·H, length, Dh) written so far.
            kv = layer_cache.append_position(qkv[:, 1:].transpose(0, 1), B)
            y = p.self_out.plus(self._attention(qkv[:, :1], kv[0].transpose(1, 2), kv[1], None, B).view(B, -1), y)
            y = y if pre else _norm(y, norm)
            norm = p.norms[1]
            h = _norm(y, norm) if pre else y
            if layer_cache.cross_k is None:
                # Once per batch, contiguous (SDPA and bmm read the projection's strided views slower);
                # with 2+ rows the keys are stored transposed, (B, H, Dh, S) in memory, for `_attention`'s baddbmm.
                k, v = p.cross_attn.project_kv(memory)
                k = k.transpose(2, 3).contiguous().transpose(2, 3) if B > 1 else k.contiguous()
                layer_cache.cross_k, layer_cache.cross_v = k, v.contiguous()
            # The cross K/V may hold one row per group of G rows (beams): B = G·M, M rows of K/V.
            k, v = layer_cache.cross_k, layer_cache.cross_v
            (M, _, S, Dh), q = k.shape, p.q.rows(h)  # (B, D)
            q = (q.view(M * H, 1, Dh) if M == B  # else each row's H queries to its group's row of K/V
                 else q.view(M, B // M, H, Dh).transpose(1, 2).reshape(M * H, B // M, Dh))
            out = self._attention(q, k.view(M * H, S, Dh).transpose(1, 2), v.view(M * H, S, Dh), mask, B)
            if M != B:
                out = out.view(M, H, B // M, Dh).transpose(1, 2)
            y = p.cross_out.plus(out.reshape(B, -1), y)
            y = y if pre else _norm(y, norm)
            norm = p.norms[2]
            h = _norm(y, norm) if pre else y
            y = p.ffn2.plus(p.ffn1.relu(h), y)  # y + FFN(h)
            y = y if pre else _norm(y, norm)
        return _norm(y, self._final_norm) if pre else y

    @staticmethod
    def _attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   rows: int) -> torch.Tensor:
        """G pre-scaled queries per head of M rows, q (M·H, G, Dh), over keys k_t (M·H, Dh, L) (a transposed
        view) and values v (M·H, L, Dh), with `_cross_mask`'s mask or None -> (M·H, G, Dh); `rows` is
        the step's rows, M·G. With 2+ rows by `bmm` (`baddbmm` adding the mask), softmax and `bmm`
        (1.3-1.9x faster than SDPA's flash kernel at 8-128 rows, docs/benchmarks.md); SDPA with one."""
        if rows == 1:
            return F.scaled_dot_product_attention(q[None], k_t.transpose(1, 2)[None], v[None], attn_mask=mask,
                                                  scale=1.0)[0]
        scores = torch.bmm(q, k_t) if mask is None else torch.baddbmm(mask, q, k_t)  # (M·H, G, L)
        return torch.bmm(torch.softmax(scores, dim=-1), v)


def _norm(x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
    weight, bias, eps = norm
    return torch.layer_norm(x, weight.shape, weight, bias, eps)


def decoding_model(model: Transformer, quantize: str = "none") -> Transformer:
    """The model to decode with: on a CPU a frozen `CpuDecodingTransformer` copy of `model` whose
    every `nn.Linear` (the output projection too) is a `DecodingLinear`, or with `quantize="int8"`
    an `Int8Linear`; elsewhere `model` itself (`quantize` applies to CPUs only). The copy's
    logits are the model's up to the order of float sums (int8: close, not equal); later changes
    to `model` (training) do not reach it, so make one per round of decoding.
    """
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    if model.positions.device.type != "cpu":
        return model
    fast = copy.deepcopy(model).eval().requires_grad_(False)
    fast.__class__ = CpuDecodingTransformer  # same attributes; only `decode` differs
    onednn = onednn_available()

    def product(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        if quantize == "int8":
            return _int8(weight, bias)
        return DecodingLinear(weight, bias, onednn and weight.numel() > ONEDNN_ABOVE_ELEMENTS)

    H = model.cfg.n_heads
    scale = (model.cfg.d_model // H) ** -0.5  # attention's, SDPA's default
    head_major = [product(*_head_major(layer.self_attn.qkv_proj, H, scale)) for layer in fast.decoder_layers]
    scaled_q = [product(*_scaled(layer.cross_attn.q_proj.weight, layer.cross_attn.q_proj.bias, scale))
                for layer in fast.decoder_layers]
    for module in list(fast.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, product(child.weight, child.bias))
    screened = quantize == "none" and model.output_proj.weight.numel() >= SCREEN_MIN_ELEMENTS
    fast._prepare(head_major, scaled_q, _screen(model.output_proj) if screened else None)
    return fast


def _head_major(qkv: nn.Linear, n_heads: int, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (3D, D) q/k/v projection's weight and bias with the query rows multiplied by `scale` and the
    output rows reordered from (q/k/v, head, Dh) to (head, q/k/v, Dh)."""
    weight, bias = _scaled(qkv.weight, qkv.bias, scale, qkv.out_features // 3)
    order = torch.arange(qkv.out_features).view(3, n_heads, -1).transpose(0, 1).flatten()
    return weight[order], None if bias is None else bias[order]


def _scaled(weight: torch.Tensor, bias: torch.Tensor | None, scale: float, rows: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copies of weight (out, in) and bias (out,) with their first `rows` output rows (all: None)
    multiplied by `scale`."""
    weight, bias = weight.detach().clone(), None if bias is None else bias.detach().clone()
    weight[:rows] *= scale
    if bias is not None:
        bias[:rows] *= scale
    return weight, bias


def _screen(output_proj: nn.Linear) -> ArgmaxScreen | None:
    """The output projection's `ArgmaxScreen`, or None in a torch build without the int8 engine."""
    try:
        return ArgmaxScreen(output_proj.weight, output_proj.bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _int8(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    try:
        return Int8Linear(weight, bias)
    except (RuntimeError, AttributeError, NotImplementedError) as err:  # a torch without (this) quantized engine
        raise UsageError(f"decode.quantize: int8 is not available in this torch build on this CPU "
                         f"({torch.backends.quantized.engine} engine: {str(err).splitlines()[0]}); use none") from None
