"""`tmt serve`: a run's translations over HTTP (FastAPI on uvicorn): `POST /translate`, `GET /health`
and a web page at `/`; concurrent requests share batches (`serve.batcher`), SIGTERM stops it cleanly.
The event loop only reads bodies (within a limit) and answers: checking a request (JSON, tokens) runs
on a thread, translating on the batcher's worker, so that no request can stall the others."""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects.
import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import signal
import socket
import sys
from dataclasses import dataclass
from importlib import resources

from transformer_mt.cli.common import load_translator, shown
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import TmtError, UsageError

logger = logging.getLogger(__name__)

PAGE = "serve_page.html"  # the web page at /, beside this module


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_sentences: int
    max_beam: int
    max_tokens: int  # source tokens per sentence (model.max_len - 1: room for its EOS)
    default_beam: int
    max_sentence_characters: int  # more cannot fit in max_tokens tokens: refused before tokenizing
    max_body_bytes: int


# A character of a sentence in a JSON body takes at most 6 bytes (`\u00e8`, as json.dumps escapes it);
# 1 KiB more holds the rest of the request.
JSON_CHARACTER_BYTES, JSON_OVERHEAD_BYTES = 6, 1024


def sentence_character_bound(tokenizers, max_tokens: int) -> int:
    """The most characters `max_tokens` source tokens can spell: every character of a sentence, spaces
    included (Metaspace), belongs to one token, of at most the longest token's length (NFC aside)."""
    return max_tokens * max(len(piece) for piece in tokenizers.src.get_vocab(with_added_tokens=True))


class RequestError(Exception):
    """A request the server refuses: its HTTP status and one line saying why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def run_serve(args: argparse.Namespace) -> None:
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise TmtError(f"tmt serve needs the {' and '.join(missing)} package{'s' * (len(missing) > 1)}: "
                       "pip install 'transformer-mt[serve]'")
    import uvicorn

    from transformer_mt.serve.batcher import Batcher

    setup_logging(logging.WARNING)
    listener = _listen(args.host, args.port)  # before loading: a port in use fails at once
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
        # By default, a body as large as the largest request the other limits take, and no larger.
        max_body = args.max_body_bytes or (args.max_sentences * max_characters * JSON_CHARACTER_BYTES
                                           + JSON_OVERHEAD_BYTES)
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
    config = uvicorn.Config(build_app(translator, batcher, limits), log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=None)
    server = _stoppable_server(config, started, on_stop=batcher.drain)
    server.run(sockets=[listener])
    if server.force_exit:  # a second Ctrl-C: stop without answering what is queued
        raise KeyboardInterrupt
    batcher.close()
    stats = batcher.stats()
    why = f" on {signal.Signals(server.stopped_by).name}" if server.stopped_by else ""
    print(f"tmt: stopped{why}: {stats.requests} request(s), {stats.sentences} sentence(s) translated in "
          f"{stats.batches} batch(es)", file=sys.stderr)


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port`, or one line saying why there cannot be one."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise UsageError(f"--host {host}: not an address of this machine ({err})") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse the port at once
        listener.bind(address)
        listener.listen(1024)
    except OSError as err:
        listener.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err})") from None
    return listener


def _stoppable_server(config, started: str, on_stop):
    """A uvicorn server of `config` that says `started` on stderr once it serves and stops as `Server`
    says, calling `on_stop()` as it starts to."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which on SIGINT or SIGTERM stops taking connections, answers the requests
        it has, and returns (uvicorn raises the signal again afterwards: tmt would then exit 130 or 143)."""

        stopped_by: int | None = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            print(started, file=sys.stderr, flush=True)  # its signal handlers are in place by now

        async def shutdown(self, sockets=None) -> None:
            on_stop()  # before waiting for the requests in flight: they must not wait for more
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            def stop(signal_number: int, frame) -> None:
                self.stopped_by = self.stopped_by or signal_number
                self.handle_exit(signal_number, frame)

            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


def build_app(translator, batcher, limits: Limits):
    """The FastAPI application around `batcher`'s translator; every error is `{"error": one line}`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    class TranslateRequest(BaseModel):
        """The body of `POST /translate`."""

        model_config = ConfigDict(extra="forbid")
        sentences: list[StrictStr] = Field(min_length=1)
        beam_size: StrictInt | None = Field(None, ge=1)
        n_best: StrictInt = Field(1, ge=1)
        scores: StrictBool = False

    page = resources.files("transformer_mt.cli").joinpath(PAGE).read_text(encoding="utf-8")
    app = FastAPI(title="tmt", docs_url=None, redoc_url=None, openapi_url=None)  # no pages from a CDN

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:  # 404, 405, ...
        return JSONResponse({"error": str(err.detail)}, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(err)}, status_code=err.status)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict:
        data = translator.cfg.data
        return {"status": "ok", "run": str(translator.run_dir), "checkpoint": translator.checkpoint.name,
                "step": translator.step, "source_language": data.src_lang, "target_language": data.tgt_lang,
                "engine": translator.engine.name, "device": translator.device, "beam_size": limits.default_beam,
                "max_beam": limits.max_beam, "max_sentences": limits.max_sentences,
                "max_sentence_characters": limits.max_sentence_characters, "max_body_bytes": limits.max_body_bytes,
                **vars(batcher.stats())}

    def checked(body: bytes):
        """The request in `body`, its decoding options and source tokens (on a thread: JSON and tokenizing)."""
        try:
            parsed = json.loads(body)
        except RecursionError:
            raise RequestError(400, "the request body is not JSON (nested too deeply)") from None
        except ValueError as err:  # UnicodeDecodeError and an integer too long to read too
            raise RequestError(400, f"the request body is not JSON ({err})") from None
        try:
            asked = TranslateRequest.model_validate(parsed)
        except ValidationError as err:
            raise RequestError(422, _validation_message(err)) from None
        return asked, *_check(asked, translator, limits)

    @app.post("/translate")
    async def translate(request: Request):
        try:
            body = await _read_body(request, limits.max_body_bytes)
        except ClientDisconnect:  # nobody to answer
            logger.info("a client went away before sending its whole request")
            return JSONResponse({"error": "the client disconnected"}, status_code=400)
        asked, options, tokens = await asyncio.to_thread(checked, body)
        try:
            results = await asyncio.wrap_future(batcher.submit(asked.sentences, tokens, options))
        except Exception as err:
            raise RequestError(500, f"translation failed: {err}") from None
        answer: dict = {"translations": [translations[0].text for translations in results]}
        if asked.scores:
            answer["scores"] = [translations[0].score for translations in results]
        if asked.n_best > 1:
            answer["n_best"] = [[{"translation": t.text, "score": t.score} for t in translations]
                                for translations in results]
        return answer

    return app


async def _read_body(request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to pass `limit` bytes: by its announced
    length before any of it is read, else while it arrives (uvicorn discards what follows)."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise RequestError(413, f"the request body is {int(announced):,} bytes; this server takes at most "
                                f"{limit:,} (tmt serve --max-body-bytes)")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise RequestError(413, f"the request body is more than {limit:,} bytes; this server takes at most "
                                    f"{limit:,} (tmt serve --max-body-bytes)")
        parts.append(part)
    return b"".join(parts)


def _check(asked, translator, limits: Limits):
    """The request's decoding `Options` and source tokens, or a `RequestError` naming what is too much.
    A sentence longer than `limits.max_sentence_characters` is refused before it is tokenized."""
    from transformer_mt.serve.batcher import Options

    if len(asked.sentences) > limits.max_sentences:
        raise RequestError(413, f"sentences: {len(asked.sentences)} sentences; this server takes at most "
                                f"{limits.max_sentences} a request (tmt serve --max-sentences)")
    beam = limits.default_beam if asked.beam_size is None else asked.beam_size
    if beam > limits.max_beam:
        raise RequestError(422, f"beam_size: {beam} is above this server's largest, {limits.max_beam} "
                                "(tmt serve --max-beam)")
    if asked.n_best > beam:
        raise RequestError(422, f"n_best: {asked.n_best} is more than beam search keeps with beam_size {beam}; "
                                f"ask for beam_size {asked.n_best} or more")
    for number, sentence in enumerate(asked.sentences):
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(422, f"sentences[{number}]: not text (a lone surrogate "
                                    f"\\u{ord(sentence[err.start]):04x})") from None
    sentences = [sentence.strip() for sentence in asked.sentences]
    for number, sentence in enumerate(sentences):
        if len(sentence) > limits.max_sentence_characters:
            longest = limits.max_sentence_characters // limits.max_tokens
            raise RequestError(413, f"sentences[{number}]: {len(sentence):,} characters; this model translates at "
                                    f"most {limits.max_sentence_characters:,} (model.max_len - 1 tokens of at most "
                                    f"{longest} characters)")
    lengths = [len(ids) for ids in translator.tokenizers.encode_src(sentences)]
    for number, length in enumerate(lengths):
        if length > limits.max_tokens:
            raise RequestError(413, f"sentences[{number}]: {length} tokens; this model translates at most "
                                    f"{limits.max_tokens} (model.max_len - 1)")
    options = Options(beam, asked.n_best, asked.scores or asked.n_best > 1)
    return options, sum(lengths) + len(lengths)  # each with its EOS


def _validation_message(err) -> str:
    """pydantic's first complaint about a request body as one line: where, then what."""
    problems = sorted(err.errors(), key=lambda problem: problem["type"] != "extra_forbidden")  # a misspelt key first
    first = problems[0]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    if first["type"] == "extra_forbidden":
        message = f"{where}: not a field of a translation request (sentences, beam_size, n_best, scores)"
    elif first["type"] == "too_short":  # the only list with a least length: sentences
        message = f"{where}: an empty list; give one sentence or more"
    elif not where:
        message = 'the body must be a JSON object such as {"sentences": ["Good morning."]}'
    else:
        message = f"{where}: {first['msg'][0].lower()}{first['msg'][1:]}"
    more = len(problems) - 1
    return message + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")
