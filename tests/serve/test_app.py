"""The HTTP app's parts, where they live (`serve/`): the limits a request is checked against, the
listening socket, the page it ships; `tmt serve` end to end is tests/serve/test_serve.py."""

from __future__ import annotations

import asyncio
import fnmatch
import os
import subprocess
import sys
from importlib import resources
from types import SimpleNamespace

import pytest

from tests.helpers import PYTHONPATH, REPO
from transformer_mt.core.errors import UsageError


def package_data() -> list[str]:
    """pyproject.toml's patterns of the files beside the modules that ship with them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-data"]["transformer_mt"]


def test_a_sentence_over_the_character_bound_is_refused_without_tokenizing_it():
    from transformer_mt.serve.limits import Limits, RequestError, check_request

    def no_tokenizing(lines):
        raise AssertionError("tokenized")

    translator = SimpleNamespace(tokenizers=SimpleNamespace(encode_src=no_tokenizing))
    limits = Limits(max_sentences=4, max_beam=4, max_tokens=63, default_beam=1, max_sentence_characters=630,
                    max_body_bytes=20_000, max_prefix_characters=630)
    asked = SimpleNamespace(sentences=["Good morning.", "  " + "x" * 631 + "  "], beam_size=None, n_best=1,
                            scores=False)
    with pytest.raises(RequestError) as refused:
        check_request(asked, translator, limits)
    assert refused.value.status == 413 and str(refused.value).startswith("sentences[1]: 631 characters; ")


def test_a_body_is_refused_by_its_announced_length_or_as_it_arrives():
    from transformer_mt.serve.limits import RequestError, read_body

    class Request:  # what read_body reads of starlette's
        def __init__(self, parts: list[bytes], announced: str | None):
            self.headers = {} if announced is None else {"content-length": announced}
            self.parts, self.read = parts, []

        async def stream(self):
            for part in self.parts:
                self.read.append(part)
                yield part

    assert asyncio.run(read_body(Request([b"ab", b"cd"], "4"), 4)) == b"abcd"
    announced = Request([b"x" * 10], "10")
    with pytest.raises(RequestError, match=r"^the request body is 10 bytes; this server takes at most 4 "):
        asyncio.run(read_body(announced, 4))
    assert announced.read == []  # refused before any of it was read
    chunked = Request([b"abc", b"def", b"ghi"], None)
    with pytest.raises(RequestError, match=r"^the request body is more than 4 bytes") as refused:
        asyncio.run(read_body(chunked, 4))
    assert refused.value.status == 413 and chunked.read == [b"abc", b"def"]  # the rest never read


def test_the_default_body_limit_holds_the_longest_request_as_json():
    from transformer_mt.serve.limits import largest_request_bytes

    # each character of a sentence and its prefix escaped (\u00e8: 6 bytes) in {"source": .., "prefix": ..},
    # plus the rest of the request
    assert largest_request_bytes(max_sentences=3, max_sentence_characters=10, max_prefix_characters=7) == (
        3 * ((10 + 7) * 6 + len('{"source": "", "prefix": ""}, ')) + 1024)


def test_listening_where_it_cannot_is_one_usage_error():
    from transformer_mt.serve.app import listen

    with pytest.raises(UsageError, match=r"^--host no\.such\.host\.invalid: not an address of this machine"):
        listen("no.such.host.invalid", 0)
    with listen("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=rf"^--host 127\.0\.0\.1 --port {port}: cannot listen there"):
            listen("127.0.0.1", port)


def test_the_page_is_the_servers_and_ships_in_the_package():
    page = resources.files("transformer_mt.serve").joinpath("serve_page.html")
    assert page.is_file() and 'id="source"' in page.read_text(encoding="utf-8")
    patterns = package_data()
    assert any(fnmatch.fnmatch("serve/serve_page.html", pattern) for pattern in patterns), patterns


def test_the_server_imports_without_fastapi_or_uvicorn():
    """They are the serve extra's: tmt, and the modules that name them, import without them."""
    code = ("import sys; sys.modules.update(fastapi=None, uvicorn=None, pydantic=None, starlette=None)\n"
            "import transformer_mt.serve.app, transformer_mt.serve.limits, transformer_mt.cli.main")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert result.returncode == 0, result.stderr


def test_no_file_of_the_package_is_left_out_of_it():
    """Every file beside the modules that is no Python ships with them (pyproject's package-data)."""
    patterns = package_data()
    package = REPO / "transformer_mt"
    data = [path.relative_to(package).as_posix() for path in package.rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts]
    assert data and not [name for name in data if not any(fnmatch.fnmatch(name, p) for p in patterns)]
