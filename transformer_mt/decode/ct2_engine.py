"""`CT2Engine`: a run decoded by CTranslate2 from a conversion of its checkpoint cached in the run
(made on first use); torch-free once the conversion is there."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from transformer_mt.core.errors import UsageError
from transformer_mt.core.files import write_text_atomic
from transformer_mt.core.run_layout import RunDir
from transformer_mt.data.tokenization import token_room
from transformer_mt.decode.hypotheses import Hypothesis, Sampling, length_caps, length_penalty

if TYPE_CHECKING:
    from transformer_mt.config.schema import DecodeConfig
    from transformer_mt.runs.checkpoint import LoadedRun

logger = logging.getLogger(__name__)

DIGESTS = "digests.json"  # checkpoint name -> its (size, mtime_ns, inode) and content digest
RUN_INFO = "tmt.json"  # in each conversion, written last: the checkpoint's config and provenance


def find_conversion(path: Path) -> dict | None:
    """The info of the conversion cached at `path` (`conversion_dir`): config, model_args, step,
    which ("ema" or "model") and checkpoint (its name); None if there is none."""
    try:
        return json.loads((path / RUN_INFO).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):  # not converted yet (a half-written one has another name)
        return None


def convert(run_dir: Path, run: LoadedRun, path: Path) -> dict:
    """Convert `run`'s checkpoint (loaded with torch) into the run's cache at `path`; its info. The
    folder is written beside and renamed into place; a writer that finishes first wins."""
    from transformer_mt.export.ct2_conversion import ctranslate2_spec, save_model_dir

    info = {"config": run.config, "model_args": run.model_args, "step": run.step, "which": run.which,
            "checkpoint": run.checkpoint.name}
    spec = ctranslate2_spec(run.model, run.tokenizers, run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not (path / RUN_INFO).is_file():  # not tmt's: conversions are complete or absent
        shutil.rmtree(path)
    try:
        save_model_dir(spec, path, {RUN_INFO: json.dumps(info)})
    except OSError:
        if not (path / RUN_INFO).is_file():  # else another process converted it first
            raise
    logger.info("converted %s for CTranslate2 into %s", run.checkpoint, path)
    return info


def conversion_dir(run_dir: Path, checkpoint: Path, fingerprint: str) -> Path:
    """`<run>/ctranslate2/<checkpoint digest>-<tokenizers digest>`: new weights or new tokenizer files
    give a new folder, never a stale conversion. A checkpoint's digest is remembered with its (size,
    mtime_ns, inode): a file that kept all three is not read again (checkpoints are replaced by rename)."""
    stat = checkpoint.stat()
    stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
    folder = RunDir(run_dir).ctranslate2
    digests_file = folder / DIGESTS
    try:
        digests = json.loads(digests_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        digests = {}
    digests = digests if isinstance(digests, dict) else {}
    known = digests.get(checkpoint.name)
    if isinstance(known, dict) and known.get("stamp") == stamp:
        return folder / f"{known['digest']}-{fingerprint[:8]}"
    digest = hashlib.blake2b(digest_size=16)
    with open(checkpoint, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    digests[checkpoint.name] = {"stamp": stamp, "digest": digest.hexdigest()}
    try:
        digests_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(digests_file, json.dumps(digests, indent=1))
    except OSError:  # a read-only run: the digest is computed again next time
        pass
    return folder / f"{digest.hexdigest()}-{fingerprint[:8]}"


class CT2Engine:
    """The `Engine` of a CTranslate2 model folder. CTranslate2 takes token strings: token i of its
    vocabularies is tmt's id i (`ct2_conversion.ctranslate2_vocabulary`)."""

    name = "ctranslate2"

    def __init__(self, model_dir: Path, device: str, max_len: int):
        self.model_dir = model_dir
        self.device = device
        self.max_len = max_len
        self.threads = 0  # CPU threads (0: OMP_NUM_THREADS, else this process's cores, at most 4)
        sides = ["shared"] * 2 if (model_dir / "shared_vocabulary.json").exists() else ["source", "target"]
        self.src_tokens, self.tgt_tokens = [json.loads((model_dir / f"{side}_vocabulary.json").read_text("utf-8"))
                                            for side in sides]
        self.tgt_ids = {token: i for i, token in enumerate(self.tgt_tokens)}
        self._translators: dict[str, object] = {}  # compute type -> ctranslate2.Translator

    def translate(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, progress: bool,
                  prefixes: list[list[int]] | None = None) -> list[list[int]]:
        if prefixes is not None and beam_size > 1:  # ranked as `hypotheses` ranks them
            return [hyps[0].ids for hyps in self.hypotheses(src_ids, decode, beam_size, 1, None, progress, prefixes)]
        return [hyps[0] for hyps in self._search(src_ids, decode, beam_size, 1, None, progress, prefixes)[0]]

    def hypotheses(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, n_best: int,
                   sampling: Sampling | None, progress: bool,
                   prefixes: list[list[int]] | None = None) -> list[list[Hypothesis]]:
        # CTranslate2 leaves a prefix's log-probabilities out of its beams' scores (not out of their
        # lengths): with a prefix, all its K finished hypotheses are ranked here, as tmt ranks them.
        rerank = prefixes is not None and sampling is None
        found, sources, caps = self._search(src_ids, decode, beam_size, beam_size if rerank else n_best, sampling,
                                            progress, prefixes)
        # It scores samples at the sampling temperature: each translation is scored again, as tmt scores it.
        flat = [(i, ids) for i, hyps in enumerate(found) for ids in hyps]
        scored = self._translator(decode).score_batch(
            [sources[i] for i, _ in flat], [[self.tgt_tokens[t] for t in ids] for _, ids in flat],
            max_batch_size=decode.batch_tokens, batch_type="tokens", max_input_length=0)  # sources cut above
        results: list[list[Hypothesis]] = [[] for _ in found]
        for (i, ids), result in zip(flat, scored):
            ended = len(ids) < caps[i]  # else cut at the cap, with no EOS
            log_probs = result.log_probs if ended else result.log_probs[:-1]  # the last is EOS's
            length = len(ids) + ended
            log_prob = sum(log_probs)
            penalty = length_penalty(length, decode.length_penalty)
            results[i].append(Hypothesis(ids, log_prob, log_prob / penalty))
        if rerank:
            results = [sorted(hyps, key=lambda hyp: -hyp.score)[:n_best] for hyps in results]
        return results

    def score(self, src_ids: list[list[int]], tgt_ids: list[list[int]], decode: DecodeConfig,
              progress: bool) -> list[list[float]]:
        keep = token_room(self.max_len)  # as the torch engine cuts sources (CTranslate2 appends the EOS)
        results = self._translator(decode).score_batch(
            [[self.src_tokens[i] for i in ids[:keep]] for ids in src_ids],
            [[self.tgt_tokens[t] for t in ids] for ids in tgt_ids],
            max_batch_size=decode.batch_tokens, batch_type="tokens", max_input_length=0)
        return [list(result.log_probs) for result in results]  # the target's tokens, then EOS

    def cross_attention(self, src_ids: list[int], hyp_ids: list[int], layer: int):
        raise UsageError("--show-attention draws from the torch engine's model; use --engine torch")

    def _search(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, n_best: int,
                sampling: Sampling | None, progress: bool, prefixes: list[list[int]] | None
                ) -> tuple[list[list[list[int]]], list[list[str]], list[int]]:
        """Each source's `n_best` translations as ids (each beginning with its prefix, as CTranslate2's
        `target_prefix` forces it), with the sources as tokens and their length caps. CTranslate2
        caps a whole call at one length (prefix included): sources are grouped by their cap."""
        keep = token_room(self.max_len)  # room for the EOS CTranslate2 appends
        sources = [[self.src_tokens[i] for i in ids[:keep]] for ids in src_ids]
        caps = length_caps([len(s) + 1 for s in sources], decode.max_len_a, decode.max_len_b, self.max_len)
        targets = None if prefixes is None else [[self.tgt_tokens[t] for t in ids] for ids in prefixes]
        groups: dict[int, list[int]] = {}
        for i, cap in enumerate(caps):
            groups.setdefault(cap, []).append(i)
        rows = n_best if sampling is not None else beam_size  # decoded rows per sentence
        budget = max(1, decode.batch_tokens // rows)  # source tokens of a batch, padding counted
        options = dict(beam_size=beam_size, num_hypotheses=n_best, length_penalty=decode.length_penalty,
                       min_decoding_length=0, max_input_length=self.max_len, batch_type="tokens")
        translator = self._translator(decode, None if sampling is None else sampling.seed)
        workers = translator.num_translators
        if sampling is not None:
            options.update(beam_size=1, sampling_topk=sampling.top_k, sampling_topp=sampling.top_p,
                           sampling_temperature=sampling.temperature)
        found: list[list[list[int]]] = [[] for _ in sources]
        batches = sorted(groups.items())
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            batches = tqdm(batches, desc="translate", unit="length", file=sys.stderr, leave=False)
        for cap, members in batches:
            prefix = None if targets is None else [targets[i] for i in members]
            # CTranslate2 sorts a call's sources longest first and cuts batches of at most
            # max_batch_size tokens with padding, which its workers decode in parallel: no batch
            # above the budget, and a call within it still cut into one batch per worker.
            longest = max(1, max(len(sources[i]) for i in members))
            shares = -(-len(members) // workers) * longest
            results = translator.translate_batch([sources[i] for i in members], prefix, max_decoding_length=cap,
                                                 max_batch_size=min(budget, shares), **options)
            for i, result in zip(members, results):
                found[i] = [[self.tgt_ids[token] for token in tokens] for tokens in result.hypotheses]
        return found, sources, caps

    def _translator(self, decode: DecodeConfig, seed: int | None = None):
        """The CTranslate2 translator for `decode.quantize` (int8 weights on a CPU only), loaded once;
        with a `seed`, a new one drawing from it (each thread seeds its generator as it starts)."""
        import ctranslate2

        compute_type = "int8" if decode.quantize == "int8" and self.device == "cpu" else "default"
        if seed is not None or compute_type not in self._translators:
            if seed is not None:
                ctranslate2.set_random_seed(seed)
            # int8 weights on a CPU: one worker per thread, each decoding its own batches on one core
            # (CTranslate2's int8 products gain little from more threads; batches side by side do).
            # fp32: one worker on every thread (its products stream the weights from memory, whose
            # bandwidth parallel batches would share). A seeded sampler keeps one worker, so that its
            # draws do not depend on which worker took which batch. CTranslate2's default of 4 threads
            # on fewer cores has OpenMP threads spin against each other; OMP_NUM_THREADS, which sets
            # torch's threads, sets these too.
            threads = self.threads or _omp_threads() or min(4, len(os.sched_getaffinity(0))
                                                            if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
            workers = threads if compute_type == "int8" and seed is None else 1
            torch = sys.modules.get("torch")  # loading sets the calling thread's OpenMP threads, torch's too
            torch_threads = torch.get_num_threads() if torch is not None else 0
            translator = ctranslate2.Translator(str(self.model_dir), device=self.device, compute_type=compute_type,
                                                inter_threads=workers, intra_threads=threads // workers)
            if torch is not None:
                torch.set_num_threads(torch_threads)
            if seed is not None:
                return translator
            self._translators[compute_type] = translator
        return self._translators[compute_type]


def _omp_threads() -> int:
    """OMP_NUM_THREADS when it is a positive whole number, else 0."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() else 0
