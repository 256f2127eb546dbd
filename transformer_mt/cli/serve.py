"""`tmt serve`: a run's translations over HTTP (`serve.app`), its options checked, the run loaded
before the server listens, and what it served said when SIGTERM or Ctrl-C stops it."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import signal
import sys

from transformer_mt.cli.common import load_translator, shown
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import TmtError, UsageError


def run_serve(args: argparse.Namespace) -> None:
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise TmtError(f"tmt serve needs the {' and '.join(missing)} package{'s' * (len(missing) > 1)}: "
                       "pip install 'transformer-mt[serve]'")
    from transformer_mt.serve.app import build_app, listen, serve_until_stopped
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.limits import Limits, largest_request_bytes, sentence_character_bound

    setup_logging(logging.WARNING)
    listener = listen(args.host, args.port)  # before loading: a port in use fails at once
    try:
        translator = load_translator(args)
        default_beam = args.beam or translator.cfg.decode.beam_size
        if default_beam > args.max_beam:
            where = "--beam" if args.beam else "the run's decode.beam_size"
            raise UsageError(f"--max-beam {args.max_beam} is below {where}={default_beam}, the beam of requests that "
                             "give none; raise --max-beam or lower --beam")
        # One translation before serving: the engine loads (or captures its graphs) now, not on the first
        # request, and settings it cannot decode with (--quantize on torch) are refused here, in one line.
        translator.translate([""], beam_size=default_beam)
        max_tokens = translator.max_len - 1
        max_characters = sentence_character_bound(translator.tokenizers, max_tokens)
        max_body = args.max_body_bytes or largest_request_bytes(args.max_sentences, max_characters)
        limits = Limits(args.max_sentences, args.max_beam, max_tokens, default_beam, max_characters, max_body)
        batcher = Batcher(translator, args.batch_tokens or translator.cfg.decode.batch_tokens, args.max_wait_ms / 1000)
    except BaseException:
        listener.close()
        raise
    data = translator.cfg.data
    host, port = listener.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    started = (f"tmt: serving {shown(translator.run_dir)} ({data.src_lang}->{data.tgt_lang}, "
               f"{translator.checkpoint.name}, {translator.engine.name} on {translator.device}) at {url}; "
               "Ctrl-C or SIGTERM stops it")
    stopped_by = serve_until_stopped(build_app(translator, batcher, limits), listener,
                                     on_start=lambda: print(started, file=sys.stderr, flush=True),
                                     on_stop=batcher.drain)
    batcher.close()
    stats = batcher.stats()
    why = f" on {signal.Signals(stopped_by).name}" if stopped_by else ""
    print(f"tmt: stopped{why}: {stats.requests} request(s), {stats.sentences} sentence(s) translated in "
          f"{stats.batches} batch(es)", file=sys.stderr)
