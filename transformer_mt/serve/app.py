"""The HTTP app of `tmt serve` (FastAPI on uvicorn): `POST /translate`, `GET /health` and a web page at
`/`, answered from a `Batcher`; the listening socket, and the server that SIGINT or SIGTERM stops cleanly.
The event loop only reads bodies (within a limit) and answers: checking a request (JSON, tokens) runs
on a thread, translating on the batcher's worker, so that no request can stall the others. fastapi and
uvicorn (the serve extra) are imported only where they are used."""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects.
import asyncio
import contextlib
import json
import logging
import signal
import socket
from collections.abc import Callable
from importlib import resources

from transformer_mt.core.errors import UsageError
from transformer_mt.serve.limits import Limits, RequestError, check_request, read_body

logger = logging.getLogger(__name__)

PAGE = "serve_page.html"  # the web page at /, beside this module


def build_app(translator, batcher, limits: Limits, glossary=None):
    """The FastAPI application around `batcher`'s translator, forcing the terms of `glossary`
    (`data.glossary.Glossary`, None: none); every error is `{"error": one line}`."""
    from typing import Annotated, Union

    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse
    from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag,
                          ValidationError)
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    class Sentence(BaseModel):
        """A sentence whose translation begins with `prefix` ("": none) and contains each of `constraints`."""

        model_config = ConfigDict(extra="forbid")
        source: StrictStr
        prefix: StrictStr = ""
        constraints: list[StrictStr] = Field(default_factory=list)

    # A string, or an object (a Sentence): only the branch of the item's kind reports problems.
    Item = Annotated[Union[Annotated[StrictStr, Tag("text")], Annotated[Sentence, Tag("object")]],
                     Discriminator(lambda item: "object" if isinstance(item, (dict, Sentence)) else "text")]

    class TranslateRequest(BaseModel):
        """The body of `POST /translate`."""

        model_config = ConfigDict(extra="forbid")
        sentences: list[Item] = Field(min_length=1)
        beam_size: StrictInt | None = Field(None, ge=1)
        n_best: StrictInt = Field(1, ge=1)
        scores: StrictBool = False
        target_lang: StrictStr | None = None
        alignments: StrictBool = False

    page = resources.files("transformer_mt.serve").joinpath(PAGE).read_text(encoding="utf-8")
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
                "engine": translator.engine.name, "device": translator.device,
                "target_lang": translator.cfg.decode.target_lang,
                "target_tags": list(translator.tokenizers.language_tags), "beam_size": limits.default_beam,
                "max_beam": limits.max_beam, "max_sentences": limits.max_sentences,
                "max_sentence_characters": limits.max_sentence_characters,
                "max_prefix_characters": limits.max_prefix_characters, "max_body_bytes": limits.max_body_bytes,
                "glossary": None if glossary is None else str(glossary.path),
                **vars(batcher.stats())}

    def checked(body: bytes):
        """The request in `body`, its decoding options, sentences, prefixes, constraints and source
        tokens (on a thread: JSON and tokenizing)."""
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
        return asked, *check_request(asked, translator, limits, glossary)

    @app.post("/translate")
    async def translate(request: Request):
        try:
            body = await read_body(request, limits.max_body_bytes)
        except ClientDisconnect:  # nobody to answer
            logger.info("a client went away before sending its whole request")
            return JSONResponse({"error": "the client disconnected"}, status_code=400)
        asked, options, sentences, prefixes, constraints, tokens = await asyncio.to_thread(checked, body)
        try:
            results = await asyncio.wrap_future(batcher.submit(sentences, tokens, options, prefixes, constraints))
        except Exception as err:
            raise RequestError(500, f"translation failed: {err}") from None
        answer: dict = {"translations": [translations[0].text for translations in results]}
        if asked.scores:
            answer["scores"] = [translations[0].score for translations in results]
        if asked.alignments:
            answer["alignments"] = [translations[0].alignment for translations in results]
        if asked.n_best > 1:
            answer["n_best"] = [[{"translation": t.text, "score": t.score,
                                  **({"alignment": t.alignment} if asked.alignments else {})} for t in translations]
                                for translations in results]
        return answer

    return app


def _validation_message(err) -> str:
    """pydantic's first complaint about a request body as one line: where, then what."""
    problems = sorted(err.errors(), key=lambda problem: problem["type"] != "extra_forbidden")  # a misspelt key first
    first = problems[0]
    loc = first["loc"]
    if loc[:1] == ("sentences",) and len(loc) > 2:  # sentences[i].<text or object>...: the union's tag goes
        loc = loc[:2] + loc[3:]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    if first["type"] == "extra_forbidden" and len(loc) > 2:
        message = f"{where}: not a field of a sentence (source, prefix, constraints)"
    elif first["type"] == "extra_forbidden":
        message = (f"{where}: not a field of a translation request (sentences, beam_size, n_best, scores, "
                   "target_lang, alignments)")
    elif first["type"] == "too_short":  # the only list with a least length: sentences
        message = f"{where}: an empty list; give one sentence or more"
    elif not where:
        message = 'the body must be a JSON object such as {"sentences": ["Good morning."]}'
    else:
        message = f"{where}: {first['msg'][0].lower()}{first['msg'][1:]}"
    more = len(problems) - 1
    return message + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def listen(host: str, port: int) -> socket.socket:
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


def serve_until_stopped(app, listener: socket.socket, on_start: Callable[[], None],
                        on_stop: Callable[[], None]) -> int | None:
    """Serve `app` on `listener` until SIGINT or SIGTERM: then take no more connections, answer the
    requests already received and return the signal's number. `on_start()` is called once it serves,
    `on_stop()` as it starts to stop; a second signal stops it at once (KeyboardInterrupt)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which on SIGINT or SIGTERM stops as `serve_until_stopped` says and returns
        (uvicorn would raise the signal again afterwards: tmt would then exit 130 or 143)."""

        stopped_by: int | None = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            on_start()  # its signal handlers are in place by now

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

    server = Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=None))
    server.run(sockets=[listener])
    if server.force_exit:  # a second Ctrl-C: stop without answering what is queued
        raise KeyboardInterrupt
    return server.stopped_by
