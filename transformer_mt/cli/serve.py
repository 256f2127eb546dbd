"""`tmt serve`: a run's translations over HTTP (`serve.app`), its options checked, the run loaded
before the server listens, and what it served said when SIGTERM or Ctrl-C stops it."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import signal
import sys

from transformer_mt.cli.arguments import (add_command, add_glossary_arguments, add_model_arguments,
                                          check_glossary_terms, non_negative_float, port_number, positive_int,
                                          read_glossary_option)
from transformer_mt.cli.common import load_translator, shown
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import TmtError, UsageError

SERVE_EXAMPLES = """examples:
  tmt serve --run runs/demo              # a web page at http://127.0.0.1:8000/
  curl -s localhost:8000/translate -d '{"sentences": ["Where is the station?"]}'
  curl -s localhost:8000/translate \\
      -d '{"sentences": ["Good morning."], "beam_size": 5, "n_best": 3}'
  # a sentence whose translation begins with a prefix
  curl -s localhost:8000/translate \\
      -d '{"sentences": [{"source": "My sister is at home.", "prefix": "Mia"}]}'
  # a translation that contains a term (beam 2 or more, the torch engine)
  curl -s localhost:8000/translate -d '{"beam_size": 4, "sentences":
      [{"source": "She takes the train.", "constraints": ["treno"]}]}'
  # every request's sentences with a glossary's terms
  tmt serve --run runs/demo --beam 4 --glossary terms.tsv
  tmt serve --run runs/demo --host 0.0.0.0 --port 8080 --max-wait-ms 20 \\
      --batch-tokens 8192

Requests that arrive together are translated in one batch; SIGTERM or Ctrl-C answers the requests
already received, then stops (exit 0). The guide "Serving" describes the API.
"""


def add_parser(commands) -> None:
    """`tmt serve`: its options, help and examples."""
    serve = add_command(commands, "serve", "serve a run's translations over HTTP, with a web page to try them",
                         SERVE_EXAMPLES)
    add_model_arguments(serve, progress=False)
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every network)")
    serve.add_argument("--port", type=port_number, default=8000, help="the TCP port (default 8000; 0: any free port, "
                                                                "which the line tmt prints names)")
    serve.add_argument("--max-wait-ms", type=non_negative_float, default=0.0, metavar="MS",
                       help="how long an idle server lets a request wait for others to share its batch (default 0: "
                            "none); a busy server batches what queued meanwhile in any case")
    serve.add_argument("--batch-tokens", type=positive_int, metavar="N",
                       help="source tokens that send a batch at once when reached (default: the run's "
                            "decode.batch_tokens); a larger request goes alone")
    serve.add_argument("--max-sentences", type=positive_int, default=64, metavar="N",
                       help="the most sentences one request may hold (default 64)")
    serve.add_argument("--max-beam", type=positive_int, default=16, metavar="K",
                       help="the largest beam_size a request may ask for (default 16)")
    serve.add_argument("--max-body-bytes", type=positive_int, metavar="N",
                       help="the largest request body, refused (413) before it is read (default: what "
                            "--max-sentences sentences of the longest the model translates, each with the "
                            "longest prefix and constraints, take as JSON)")
    add_glossary_arguments(serve, "every translation")


def run_serve(args: argparse.Namespace) -> None:
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise TmtError(f"tmt serve needs the {' and '.join(missing)} package{'s' * (len(missing) > 1)}: "
                       "pip install 'transformer-mt[serve]'")
    from transformer_mt.data.tokenization import token_room
    from transformer_mt.serve.app import build_app, listen, serve_until_stopped
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.limits import Limits, character_bound, largest_request_bytes

    setup_logging(logging.WARNING)
    glossary = read_glossary_option(args)
    listener = listen(args.host, args.port)  # before loading: a port in use fails at once
    try:
        translator = load_translator(args, constrained=glossary is not None)
        check_glossary_terms(glossary, translator)
        default_beam = args.beam or translator.cfg.decode.beam_size
        if default_beam > args.max_beam:
            where = "--beam" if args.beam else "the run's decode.beam_size"
            raise UsageError(f"--max-beam {args.max_beam} is below {where}={default_beam}, the beam of requests that "
                             "give none; raise --max-beam or lower --beam")
        # One translation before serving: the engine loads (or captures its graphs) now, not on the first
        # request, and settings it cannot decode with (--quantize on torch) are refused here, in one line.
        translator.translate([""], beam_size=default_beam)
        max_tokens = token_room(translator.max_len)
        max_characters = character_bound(translator.tokenizers.src, max_tokens)
        max_prefix_characters = character_bound(translator.tokenizers.tgt, max_tokens)  # a prefix: fewer tokens
        max_terms = args.max_beam - 1 if translator.engine.name == "torch" else 0  # a beam of K holds K - 1 terms
        max_body = args.max_body_bytes or largest_request_bytes(args.max_sentences, max_characters,
                                                                max_prefix_characters, max_terms)
        limits = Limits(args.max_sentences, args.max_beam, max_tokens, default_beam, max_characters, max_body,
                        max_prefix_characters)
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
    stopped_by = serve_until_stopped(build_app(translator, batcher, limits, glossary), listener,
                                     on_start=lambda: print(started, file=sys.stderr, flush=True),
                                     on_stop=batcher.drain)
    batcher.close()
    stats = batcher.stats()
    why = f" on {signal.Signals(stopped_by).name}" if stopped_by else ""
    print(f"tmt: stopped{why}: {stats.requests} request(s), {stats.sentences} sentence(s) translated in "
          f"{stats.batches} batch(es)", file=sys.stderr)
