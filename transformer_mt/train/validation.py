"""Evaluation inside a training run: validation (loss, greedy BLEU/chrF, examples, attention pictures)
and the final test of the best or averaged weights (and of the EMA's, when the run keeps both)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from transformer_mt.config.schema import Config, config_to_dict
from transformer_mt.core.distributed import Distributed, interleave
from transformer_mt.core.files import lines_to_text, write_text_atomic
from transformer_mt.core.run_layout import RunDir, best_or_latest
from transformer_mt.core.runtime import AttentionKernels, Precision
from transformer_mt.data import corpus as data_module
from transformer_mt.data.batching import sorted_batches
from transformer_mt.data.token_cache import TokenizedSplit
from transformer_mt.data.tokenization import BOS_ID, EOS, EOS_ID, TokenizerPair
from transformer_mt.evaluate.diagnostics import diagnose
from transformer_mt.evaluate.metrics import METRICS, pair_line, pair_scores, score
from transformer_mt.evaluate.test_set import evaluate_test_set
from transformer_mt.decode.plotting import attention_figure, cross_attention_labels, cross_attention_map
from transformer_mt.decode.torch_engine import translate_ids
from transformer_mt.model.transformer import Transformer
from transformer_mt.runs.checkpoint import (CheckpointDir, average_checkpoints, load_checkpoint, save_atomic,
                                            translation_weights)
from transformer_mt.train.optional_outputs import OptionalWriter
from transformer_mt.train.loss import StepLoss

logger = logging.getLogger(__name__)

BOOTSTRAP_SAMPLES = 1000  # the final test's resamples for its 95 % intervals (sacreBLEU's default)


class Evaluator:
    """Validates `model` (the trained one, or the EMA of its weights: `ema`) during training and tests
    it at the end; writes what it measures to TensorBoard, `validation/` and `evaluation/` (rank 0)."""

    def __init__(self, cfg: Config, run_dir: Path, *, model: Transformer, tokenizers: TokenizerPair,
                 valid_data: TokenizedSplit, checkpoints: CheckpointDir, device: torch.device, precision: Precision,
                 attention: AttentionKernels, dist: Distributed, pad_to_multiple: int, progress: bool,
                 ema: bool = False):
        self.cfg, self.run_dir, self.paths, self.model, self.ema = cfg, run_dir, RunDir(run_dir), model, ema
        self.tokenizers, self.valid_data, self.checkpoints = tokenizers, valid_data, checkpoints
        self.device, self.precision, self.dist, self.progress = device, precision, dist, progress
        self.attention = attention  # training's kernels: the validation loss has training shapes
        self.pad_to_multiple = pad_to_multiple
        self.comet = None  # train.valid_comet's model, on rank 0, which scores for all ranks
        if cfg.train.valid_comet and dist.is_main:
            from transformer_mt.evaluate.comet import Comet

            self.comet = Comet.load(cfg.train.valid_comet, key="train.valid_comet")
        n, limit = len(valid_data), cfg.train.eval_max_sentences  # the sentences translated: a seeded subset
        self.valid_subset = list(range(n)) if limit == 0 or limit >= n else sorted(
            torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed))[:limit].tolist())

    # --- validation ----------------------------------------------------------------------
    @torch.no_grad()
    def validation_loss(self) -> float:
        """Mean per-token negative log-likelihood (no smoothing) over the whole validation split."""
        self.model.eval()
        total, tokens = torch.zeros((), device=self.device), 0
        batches = sorted_batches(self.valid_data.lengths(self.pad_to_multiple), self.cfg.train.batch_tokens)
        for indices in batches[self.dist.rank::self.dist.world_size]:  # each rank its share
            batch = self.valid_data.batch(indices, self.pad_to_multiple).to(self.device)
            with self.precision.autocast(), self.attention.enabled():
                total += StepLoss(self.model)(batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids, 0.0)  # real targets
            tokens += batch.n_tgt_tokens
        loss_sum, tokens = self.dist.sum_(torch.stack([total, total.new_tensor(tokens)])).tolist()
        return loss_sum / tokens

    def validate(self, writer: SummaryWriter, step: int) -> dict:
        """Loss, perplexity, greedy BLEU/chrF on the fixed subset, examples and attention -> `last_valid`."""
        started = time.perf_counter()
        loss = self.validation_loss()
        sources = [self.valid_data.src_ids[i] for i in self.valid_subset]
        mine = sources[self.dist.rank::self.dist.world_size]  # each rank translates its share
        mine_ids = translate_ids(self.model, mine, self.cfg.decode, bos_id=BOS_ID, eos_id=EOS_ID, device=self.device,
                                 precision=self.precision, beam_size=1, progress=self.progress) if mine else []
        hyp_ids = interleave(self.dist.gather(mine_ids))  # every rank scores all: they agree on the best step
        hypotheses = self.tokenizers.decode_tgt(hyp_ids)
        references = [self.valid_data.tgt_text[i] for i in self.valid_subset]
        scores = score(hypotheses, references, tokenize=self.cfg.train.bleu_tokenize)
        if self.dist.is_main:
            if self.cfg.train.attention_figures:
                self._log_attention(writer, step, sources[0], hyp_ids[0])
            self.paths.validation.mkdir(exist_ok=True)
            write_text_atomic(self.paths.validation_hypotheses(step), lines_to_text(hypotheses))
        ppl = math.exp(min(loss, 100.0))
        values = {"loss": loss, "perplexity": ppl, **{name: scores[name].value for name in METRICS}}
        sources_text = [self.valid_data.src_text[i] for i in self.valid_subset]
        if self.cfg.train.valid_comet:
            values["comet"] = self._comet(sources_text, hypotheses, references)
        for name, value in values.items():
            writer.add_scalar(f"valid/{name}", value, step)
        examples = []  # the first `train.n_examples`, in the log and as TensorBoard text
        for i in range(min(self.cfg.train.n_examples, len(hypotheses))):
            src = self.valid_data.src_text[self.valid_subset[i]]
            examples.append(f"source: {src}\nreference: {references[i]}\nhypothesis: {hypotheses[i]}")
            logger.info("example %d\n  source:     %s\n  reference:  %s\n  hypothesis: %s",
                        i + 1, src, references[i], hypotheses[i])
        diagnostics = diagnose(sources_text, hypotheses, references)
        for name, rate in diagnostics.rates().items():  # the share of the sentences each check flags
            writer.add_scalar(f"valid_diag/{name}", rate, step)
        for label, _, chrf in diagnostics.buckets:
            writer.add_scalar(f"valid_diag/chrf_source_words_{label}", chrf, step)
        if flagged := diagnostics.examples(sources_text, hypotheses):
            writer.add_text("valid_diag/examples", flagged, step)
        if examples:
            writer.add_text("valid/examples", "\n\n".join(f"    {e}".replace("\n", "\n    ") for e in examples), step)
        pairs = pair_scores(sources_text, hypotheses, references, self.cfg.data.src_lang, self.cfg.train.bleu_tokenize)
        for pair, pair_values in pairs.items():  # a multilingual model's language pairs (target-language tags)
            for name in ("bleu", "chrf"):
                writer.add_scalar(f"valid_pairs/{pair}/{name}", pair_values[name], step)
        comet = f", COMET {values['comet']:.4f}" if "comet" in values else ""
        logger.info("validation at step %d%s: loss %.3f, ppl %.2f, BLEU %.2f, chrF %.2f, chrF++ %.2f, TER %.2f%s "
                    "(%d sentences, %.1fs) [%s]", step, " (EMA weights)" if self.ema else "", loss, ppl, scores.bleu,
                    scores.chrf, scores["chrf++"].value, scores["ter"].value, comet, len(hypotheses),
                    time.perf_counter() - started, scores.bleu_signature)
        if pairs:
            logger.info("validation at step %d per language pair: %s", step, pair_line(pairs))
        return {"step": step, "loss": round(loss, 4), "perplexity": round(ppl, 2),
                **{name: round(scores[name].value, 2) for name in METRICS},
                **({"comet": round(values["comet"], 4)} if "comet" in values else {}),
                **({"pairs": pairs} if pairs else {}),
                **({"weights": "ema"} if self.ema else {})}

    def _comet(self, sources: list[str], hypotheses: list[str], references: list[str]) -> float:
        """train.valid_comet's corpus score, computed on rank 0 (on the training GPU, then offloaded)
        and given to every rank, which all judge the validation alike."""
        value = float("-inf")
        if self.comet is not None:
            value = self.comet.score(sources, hypotheses, references, device=self.device).score
            self.comet.offload()
        return float(self.dist.max_(torch.tensor(value, dtype=torch.float64, device=self.device)).item())

    def _log_attention(self, writer: SummaryWriter, step: int, src_ids: list[int], hyp_ids: list[int]) -> None:
        """Cross-attention images of the first validation sentence's translation: the last decoder
        layer and `train.attention_layer`, mean over heads, pieces on the axes."""
        n_layers = self.cfg.model.n_decoder_layers
        src_pieces, tgt_pieces = cross_attention_labels(
            self.tokenizers.src_pieces(src_ids), self.tokenizers.tgt_pieces(hyp_ids), EOS, self.cfg.model.max_len)
        for layer in sorted({n_layers - 1, self.cfg.train.attention_layer % n_layers}):
            weights = cross_attention_map(self.model, src_ids, hyp_ids, bos_id=BOS_ID, eos_id=EOS_ID,
                                          device=self.device, layer=layer)
            title = f"step {step}, decoder layer {layer + 1} of {n_layers}, mean over heads"
            writer.add_figure(f"valid/attention_layer_{layer + 1}",
                              attention_figure(weights, src_pieces, tgt_pieces, title), step)

    def log_hparams(self, writer: OptionalWriter, step: int, best_bleu: float, last_bleu: float) -> None:
        """The config beside the best and final validation BLEU, for TensorBoard's HParams tab: one
        HParams record in the run's own events (no run of its own), whose metrics are its `valid/` scalars."""
        hparam_values = {}
        for section, values in config_to_dict(self.cfg).items():
            for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
                name = f"{section}.{key}" if key else section
                hparam_values[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
        writer.add_scalar("valid/best_bleu", best_bleu, step)
        # TensorBoard shows each metric's last scalar: valid/bleu's is the final validation's, `last_bleu`.
        for summary in hparams(hparam_values, {"valid/best_bleu": best_bleu, "valid/bleu": last_bleu}):
            writer.add_summary(summary, step)

    # --- the final test ------------------------------------------------------------------
    def test_weights(self) -> tuple[Path, list[int]]:
        """The checkpoint the final test uses, and the step checkpoints it averages: the average of
        the newest `train.average_last` (written by `final_test`), else `best.pt`, else the newest."""
        checkpoints, average_last = self.checkpoints, self.cfg.train.average_last
        if average_last:
            steps = checkpoints.steps()[-average_last:]
            return checkpoints.directory / f"average_steps_{steps[0]:08d}-{steps[-1]:08d}.pt", steps
        return best_or_latest(checkpoints.directory), []

    def ema_test_weights(self) -> Path | None:
        """The checkpoint whose EMA the final test also scores beside an average of the trained
        weights, to compare them: `best.pt`, else the newest; None without an EMA and an average."""
        both = self.cfg.train.ema_decay and self.cfg.train.average_last
        return best_or_latest(self.checkpoints.directory) if both else None

    def earlier_test_report(self, step: int) -> dict | None:
        """The final test an earlier start wrote for this very step, `test_weights` file, decoding,
        BLEU tokenizer and EMA test, if there is one."""
        try:
            report = json.loads(self.paths.test_scores.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        cfg = self.cfg
        same = {"step": step, "checkpoint": self.test_weights()[0].name,
                "beam_size": cfg.decode.beam_size, "length_penalty": cfg.decode.length_penalty}
        if (not isinstance(report, dict) or any(report.get(k) != v for k, v in same.items())
                or ("ema" in report) != (self.ema_test_weights() is not None)):
            return None
        same_scores = f"|tok:{cfg.train.bleu_tokenize}|" in str(report.get("bleu_signature")) and "ter" in report
        return report if same_scores else None

    def final_test(self, step: int) -> dict:
        """Test the best (or averaged) weights, and the EMA's as the report's `ema` (`ema_test_weights`;
        None when that checkpoint has none); write `evaluation/`; return the report for `summary.json`."""
        cfg = self.cfg
        path, steps = self.test_weights()
        if steps:
            if len(steps) < cfg.train.average_last:  # a run stopped early, or cut short by max_steps
                logger.warning("train.average_last=%d, but the run has only %d step checkpoint(s): averaging those",
                               cfg.train.average_last, len(steps))
            save_atomic(average_checkpoints([self.checkpoints.step_path(s) for s in steps]), path)
        report = self._test(path, steps, step)
        if (ema_path := self.ema_test_weights()) is not None:
            report["ema"] = self._test(ema_path, [], step, only_ema=True)
        write_text_atomic(self.paths.test_scores, json.dumps(report, indent=2) + "\n")
        return report

    def _test(self, path: Path, steps: list[int], step: int, only_ema: bool = False) -> dict | None:
        """Score the test split with the weights of `path` (averaged from `steps`) that `tmt translate`
        would use (the EMA's when it has one); with `only_ema`, None if it has none."""
        cfg = self.cfg
        checkpoint = load_checkpoint(path, map_location=self.device)
        weights, which = translation_weights(checkpoint)
        if only_ema and which != "ema":
            logger.warning("%s holds no EMA of the weights (train.ema_decay was 0 then): no EMA test", path.name)
            return None
        self.model.load_state_dict(weights)
        weights_steps = steps or [checkpoint.get("train_state", {}).get("step")]
        test = data_module.load_corpus(cfg.data, cfg.seed, self.run_dir).test
        beam = cfg.decode.beam_size

        def translate(sources: list[str]) -> list[str]:  # the loaded (averaged, EMA) weights, in torch
            hyp_ids = translate_ids(self.model, self.tokenizers.encode_src(sources), cfg.decode, bos_id=BOS_ID,
                                    eos_id=EOS_ID, device=self.device, precision=self.precision, beam_size=beam,
                                    progress=self.progress)
            return self.tokenizers.decode_tgt(hyp_ids)

        output = self.paths.hypotheses("test", path.stem, beam)
        result = evaluate_test_set(translate, test["src"], [test["tgt"]], output, tokenize=cfg.train.bleu_tokenize,
                                   n_bootstrap=BOOTSTRAP_SAMPLES, src_lang=cfg.data.src_lang)
        scores = result.scores
        # step: the run's when tested; checkpoint_steps: those of the weights; weights: "ema" or "model"
        report = {"checkpoint": path.name, "checkpoint_steps": weights_steps, "weights": which,
                  "hypotheses": result.output.name, "step": step, "sentences": len(result.hypotheses),
                  "beam_size": beam, "length_penalty": cfg.decode.length_penalty, **scores.report(),
                  "seconds": round(result.seconds, 1)}
        logger.info("test (%s%s, beam %d, %d sentences): %s [%s]", path.name,
                    ", EMA weights" if which == "ema" else "", beam, len(result.hypotheses),
                    ", ".join(scores[name].shown(name) for name in METRICS), scores.bleu_signature)
        if result.pairs:
            report["pairs"] = result.pairs
            logger.info("test per language pair: %s", pair_line(result.pairs))
        return report
