"""`tmt serve` as a real subprocess on a free loopback port, serving the tiny trained run: concurrent
clients get `tmt translate`'s translations in shared batches, bad requests a 4xx, SIGTERM a clean stop;
what a client sends (a huge body, a deep one, half a body) never stalls or crashes it."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.helpers import PYTHONPATH, SOURCES, TARGETS, run_cli

TIMEOUT = 60  # seconds any one request or stop may take: far more than the tiny run needs


class Server:
    """`tmt serve --run runs/tiny --port 0 ARGS` started in `cwd`, at `url` once it says where."""

    def __init__(self, cwd: Path, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "transformer_mt", "serve", "--run", "runs/tiny", "--port", "0", *args], cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": PYTHONPATH})
        self.lines: list[str] = []
        started = threading.Event()

        def read() -> None:  # all of stderr, so that the pipe never fills
            for line in self.process.stderr:
                self.lines.append(line)
                if "serving" in line:
                    started.set()
            started.set()

        threading.Thread(target=read, daemon=True).start()
        assert started.wait(TIMEOUT) and self.process.poll() is None, "".join(self.lines)
        self.url = re.search(r"at (http://\S+/);", "".join(self.lines)).group(1)

    def post(self, body: bytes | dict, path: str = "translate") -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.request(urllib.request.Request(self.url + path, data=data, method="POST"))

    def get(self, path: str) -> tuple[int, dict | str]:
        return self.request(urllib.request.Request(self.url + path))

    @staticmethod
    def request(request: urllib.request.Request) -> tuple[int, dict | str]:
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
                status, body, kind = response.status, response.read().decode(), response.headers["content-type"]
        except urllib.error.HTTPError as err:
            status, body, kind = err.code, err.read().decode(), err.headers["content-type"]
        return status, json.loads(body) if kind == "application/json" else body

    def stop(self) -> tuple[int, str]:
        """SIGTERM; the exit code and stderr."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(TIMEOUT)
        self.process.stdout.close()
        return code, "".join(self.lines)

    def raw(self, head: str, *body: bytes, hang_up: bool = False) -> tuple[int, dict | None]:
        """Send `head` (request line and headers) and `body` on a raw socket, as a client that may send less
        than it announced or go away (`hang_up`: close without reading); else the status and JSON answer."""
        address = urlsplit(self.url)
        with socket.create_connection((address.hostname, address.port), timeout=TIMEOUT) as connection:
            connection.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
            for part in body:
                connection.sendall(part)
            if hang_up:
                return 0, None
            response = connection.makefile("rb")
            status = int(response.readline().split()[1])
            headers = {}
            while (line := response.readline().strip()):
                name, _, value = line.decode().partition(":")
                headers[name.lower()] = value.strip()
            return status, json.loads(response.read(int(headers["content-length"])))

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(TIMEOUT)


@pytest.fixture
def server(request, workdir):
    """A server started with the arguments the test is parametrized with, killed if the test left it running."""
    started = Server(workdir, *request.param)
    yield started
    started.kill()


def translate_file(tmt_here, workdir: Path, lines: list[str], *args: str) -> list[str]:
    """`tmt translate --run runs/tiny ARGS` of `lines` (in this process): one output line each."""
    (workdir / "serve-input.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    result = tmt_here("translate", "--run", "runs/tiny", "--input", "serve-input.txt", *args, cwd=workdir)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.parametrize("server", [("--max-wait-ms", "100")], indirect=True)
def test_concurrent_clients_get_translates_translations_in_shared_batches(server, workdir, tmt_here):
    greedy = dict(zip(SOURCES, translate_file(tmt_here, workdir, SOURCES)))
    nbest = [json.loads(line) for line in translate_file(tmt_here, workdir, SOURCES, "--beam", "3", "--n-best", "2",
                                                                   "--format", "jsonl")]
    nbest = {entry["source"]: list(zip(entry["hypotheses"], entry["scores"])) for entry in nbest}
    # Each sentence with its reference's first word as a prefix, as `tmt translate --input-format jsonl` reads it
    items = [{"source": source, "prefix": target.split()[0]} for source, target in zip(SOURCES, TARGETS)]
    prefixed = dict(zip(SOURCES, translate_file(tmt_here, workdir, [json.dumps(item) for item in items],
                                                "--input-format", "jsonl")))
    # 200 requests of 1 to 3 sentences, every fourth asking for a 2-best list with beam 3, every fifth
    # other one with prefixes (it may share a batch with sentences without)
    requests = [[SOURCES[(i + k) % len(SOURCES)] for k in range(1 + i % 3)] for i in range(200)]

    def ask(i: int) -> tuple[int, dict]:
        options = {"beam_size": 3, "n_best": 2} if i % 4 == 3 else {}
        sentences = [items[SOURCES.index(s)] for s in requests[i]] if i % 5 == 1 and i % 4 != 3 else requests[i]
        return server.post({"sentences": sentences, **options})

    with ThreadPoolExecutor(max_workers=8) as clients:
        answers = list(clients.map(ask, range(200), timeout=10 * TIMEOUT))
    for i, (status, answer) in enumerate(answers):
        assert status == 200, answer
        if i % 4 == 3:
            assert [[(h["translation"], pytest.approx(h["score"], abs=1e-4)) for h in hyps]
                    for hyps in answer["n_best"]] == [nbest[s] for s in requests[i]]
            assert answer["translations"] == [nbest[s][0][0] for s in requests[i]]
        elif i % 5 == 1:
            assert answer["translations"] == [prefixed[s] for s in requests[i]]
            assert all(t.startswith(items[SOURCES.index(s)]["prefix"]) for t, s in zip(answer["translations"],
                                                                                     requests[i]))
        else:
            assert answer["translations"] == [greedy[s] for s in requests[i]] and "n_best" not in answer
    status, health = server.get("health")
    assert status == 200 and health["status"] == "ok" and health["engine"] == "ctranslate2"
    assert health["requests"] == 200 and health["sentences"] == sum(map(len, requests)) and health["queued"] == 0
    assert 1 < health["largest_batch_requests"] <= 8 and health["batches"] < 200
    # word alignments, as `tmt translate --alignments` gives them
    aligned = [json.loads(line) for line in translate_file(tmt_here, workdir, SOURCES[:3], "--beam", "3", "--n-best",
                                                           "2", "--format", "jsonl", "--alignments")]
    status, answer = server.post({"sentences": SOURCES[:3], "beam_size": 3, "n_best": 2, "alignments": True})
    assert status == 200 and answer["alignments"] == [entry["alignments"][0] for entry in aligned]
    assert [[h["alignment"] for h in hyps] for hyps in answer["n_best"]] == [entry["alignments"] for entry in aligned]
    code, stderr = server.stop()
    assert code == 0, stderr


@pytest.mark.parametrize("server", [("--max-sentences", "3", "--max-beam", "4")], indirect=True)
def test_bad_requests_get_a_4xx_with_one_line_and_the_server_keeps_answering(server):
    too_long = " ".join(["station"] * 40 + ["a"] * 40)  # within the characters 63 tokens may spell, not the tokens
    cases = [
        (b"Good morning.", 400, "the request body is not JSON"),
        (b"\xff{", 400, "the request body is not JSON"),
        (b'{"sentences": ["a"], "beam_size": ' + b"9" * 5000 + b"}", 400, "the request body is not JSON"),
        (b"[1, 2]", 422, 'the body must be a JSON object such as {"sentences"'),
        ({}, 422, "sentences: field required"),
        ({"sentences": "Good morning."}, 422, "sentences: input should be a valid list"),
        ({"sentences": []}, 422, "sentences: an empty list; give one sentence or more"),
        ({"sentences": ["Good morning.", 7]}, 422, "sentences[1]: input should be a valid string"),
        ({"sentences": ["a"], "beam_size": "2"}, 422, "beam_size: input should be a valid integer"),
        ({"sentences": ["a"], "beam_size": 0}, 422, "beam_size: input should be greater than or equal to 1"),
        ({"sentences": ["a"], "scores": "yes"}, 422, "scores: input should be a valid boolean"),
        ({"sentences": ["a"], "beam": 2}, 422, "beam: not a field of a translation request"),
        ({"sentence": "a"}, 422, "sentence: not a field of a translation request (sentences, beam_size, n_best, "
                                 "scores, target_lang, alignments) (and 1 more problem)"),
        ({"sentences": ["a"], "target_lang": "ita"}, 422, "target language 'ita': this model has no target-language "
                                                          "tags (>>xxx<<); it translates into it: leave out target_lang"),
        ({"sentences": ["a", "b", "c", "d"]}, 413, "sentences: 4 sentences; this server takes at most 3"),
        ({"sentences": ["a", too_long]}, 413, "sentences[1]: 80 tokens; this model translates at most 63"),
        ({"sentences": ["a"], "beam_size": 5}, 422, "beam_size: 5 is above this server's largest, 4"),
        ({"sentences": ["a"], "beam_size": 2, "n_best": 3}, 422, "n_best: 3 is more than beam search keeps"),
        (b'{"sentences": ["\\ud800"]}', 422, "sentences[0]: not text (a lone surrogate \\ud800)"),
        ({"sentences": ["a", {"source": "b", "prefix": 3}]}, 422, "sentences[1].prefix: input should be a valid string"),
        ({"sentences": [{"source": "b", "prefix": None}]}, 422, "sentences[0].prefix: input should be a valid string"),
        ({"sentences": [{"source": "b", "prefx": "c"}]}, 422, "sentences[0].prefx: not a field of a sentence (source, "
                                                              "prefix, constraints)"),
        ({"sentences": [{"prefix": "c"}]}, 422, "sentences[0].source: field required"),
        ({"sentences": [{"source": "Good morning.", "prefix": "la " * 30}]}, 413,
         "sentences[0].prefix: the prefix is 30 tokens; this sentence's translation is capped at 17 tokens with its "
         "EOS (decode.max_len_a=1.5 × 5 source tokens with EOS + decode.max_len_b=10, at most model.max_len=64)"),
    ]
    for body, status, message in cases:
        got, answer = server.post(body)
        assert (got, list(answer)) == (status, ["error"]), (body, answer)
        assert answer["error"].startswith(message) and "\n" not in answer["error"], (body, answer)
    assert server.get("translate") == (405, {"error": "Method Not Allowed"})
    assert server.get("nowhere") == (404, {"error": "Not Found"})
    status, answer = server.post({"sentences": ["Good morning.", ""], "scores": True})
    assert status == 200 and answer["translations"][1] == "" and len(answer["scores"]) == 2
    status, page = server.get("")
    assert status == 200 and 'id="source"' in page and "http" not in page.split("<script>")[0].replace(
        'name="viewport"', "")  # self-contained: no stylesheet or script from elsewhere
    code, stderr = server.stop()
    assert code == 0, stderr


@pytest.mark.parametrize("server", [("--max-wait-ms", "600000", "--engine", "torch")], indirect=True)
def test_sigterm_answers_the_requests_in_flight_then_exits_0(server, workdir, tmt_here):
    assert server.get("health")[1]["engine"] == "torch"  # the engine translate's --engine names, as there
    expected = dict(zip(SOURCES, translate_file(tmt_here, workdir, SOURCES, "--engine", "torch")))
    with ThreadPoolExecutor(max_workers=4) as clients:
        pending = [clients.submit(server.post, {"sentences": [source]}) for source in SOURCES[:4]]
        # they wait ten minutes for others to join: in flight until the stop
        while server.get("health")[1]["queued"] < 4:
            assert not any(future.done() for future in pending)
            time.sleep(0.05)
        code, stderr = server.stop()
        answers = [future.result(TIMEOUT) for future in pending]
    assert answers == [(200, {"translations": [expected[source]]}) for source in SOURCES[:4]]
    assert code == 0, stderr
    assert "stopped on SIGTERM: 4 request(s), 4 sentence(s) translated in 1 batch(es)" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("server", [("--max-wait-ms", "600000", "--batch-tokens", "1")], indirect=True)
def test_a_batch_leaves_once_it_holds_batch_tokens(server):
    # Over a budget of one token a request goes alone at once, however long the wait
    with ThreadPoolExecutor(max_workers=4) as clients:
        answers = list(clients.map(lambda source: server.post({"sentences": [source]}), SOURCES[:4],
                                   timeout=TIMEOUT))
    assert [status for status, _ in answers] == [200] * 4
    health = server.get("health")[1]
    assert (health["requests"], health["batches"], health["largest_batch_requests"]) == (4, 4, 1)
    server.stop()


def test_a_host_or_port_it_cannot_listen_on_is_one_line(workdir, monkeypatch, capsys):
    code, _, err = run_cli(["serve", "--run", "runs/tiny", "--host", "no.such.host.invalid"], monkeypatch, capsys,
                           workdir)
    assert code == 2 and err.startswith("tmt: error: --host no.such.host.invalid: not an address of this machine")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, _, err = run_cli(["serve", "--run", "runs/tiny", "--port", port], monkeypatch, capsys, workdir)
    assert code == 2 and err == f"tmt: error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)\n"
    code, _, err = run_cli(["serve", "--run", "runs/tiny", "--port", "0", "--beam", "5", "--max-beam", "4"],
                           monkeypatch, capsys, workdir)
    assert code == 2 and "--max-beam 4 is below --beam=5" in err and err.count("\n") == 1
    code, _, err = run_cli(["serve", "--run", "runs/tiny", "--port", "0", "--engine", "torch", "--quantize", "int8"],
                           monkeypatch, capsys, workdir)  # refused before serving, not at each request
    assert code == 2 and err.startswith("tmt: error: decode.quantize: int8 decodes on the ctranslate2 engine")


def test_without_fastapi_it_names_the_extra(workdir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if it were not installed
    code, _, err = run_cli(["serve", "--run", "runs/tiny"], monkeypatch, capsys, workdir)
    assert (code, err) == (1, "tmt: error: tmt serve needs the fastapi package: pip install 'transformer-mt[serve]'\n")


def translate_head(length: int | None = None, chunked: bool = False) -> str:
    """The request line and headers of a `POST /translate` announcing `length` bytes, or chunked."""
    return ("POST /translate HTTP/1.1\nHost: tmt\nContent-Type: application/json\n"
            + ("Transfer-Encoding: chunked\n" if chunked else f"Content-Length: {length}\n"))


@pytest.mark.parametrize("server", [("--max-body-bytes", "200000")], indirect=True)
def test_a_body_too_large_too_deep_or_cut_short_is_one_line_and_the_server_stays_up(server):
    # 20 MB announced: refused from the headers, before a byte of the body is sent
    status, answer = server.raw(translate_head(20_000_000))
    assert (status, answer) == (413, {"error": "the request body is 20,000,000 bytes; this server takes at most "
                                               "200,000 (tmt serve --max-body-bytes)"})
    # chunked, with no length announced: refused once what arrived passes the limit, the rest never sent
    chunk = b'["' + b"x" * 99_996 + b'"]'
    status, answer = server.raw(translate_head(chunked=True), *[b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 3)
    assert (status, answer) == (413, {"error": "the request body is more than 200,000 bytes; this server takes at "
                                               "most 200,000 (tmt serve --max-body-bytes)"})
    # within the limit but not JSON for Python's parser (100,000 nested lists): the guide's 400
    status, answer = server.post(b"[" * 100_000)
    assert (status, answer) == (400, {"error": "the request body is not JSON (nested too deeply)"})
    # a sentence that cannot fit in the model whatever its tokens, refused by its characters
    status, answer = server.post({"sentences": ["Good morning.", "station " * 18_750]})
    assert status == 413 and re.fullmatch(r"sentences\[1\]: 149,999 characters; this model translates at most "
                                          r"[\d,]+ \(model.max_len - 1 tokens of at most \d+ characters\)",
                                          answer["error"]), answer
    # half a body, then the client goes away
    server.raw(translate_head(1000), b'{"sentences": ["Good morn', hang_up=True)
    status, answer = server.post({"sentences": ["Good morning."]})
    assert status == 200 and len(answer["translations"]) == 1
    health = server.get("health")[1]
    assert health["max_body_bytes"] == 200_000 and health["requests"] == 1
    code, stderr = server.stop()
    assert code == 0, stderr
    for word in ("Traceback", "Exception in ASGI", "RecursionError", "ClientDisconnect"):
        assert word not in stderr, stderr
    assert len(stderr.strip().splitlines()) <= 3, stderr  # serving, at most one line on the hang-up, stopped


@pytest.mark.parametrize("server", [("--max-sentences", "4")], indirect=True)
def test_the_default_body_limit_takes_every_request_the_other_limits_take(server):
    """The most a request may hold: --max-sentences sentences and their prefixes at the character bound,
    each character escaped as JSON escapes it (\\u00e8, as Python's json.dumps sends it): under the
    default body limit."""
    health = server.get("health")[1]
    longest = {"source": "è" * health["max_sentence_characters"], "prefix": "è" * health["max_prefix_characters"]}
    body = json.dumps({"sentences": [longest] * 4, "beam_size": 1, "n_best": 1, "scores": False}).encode()
    assert len(body) <= health["max_body_bytes"]
    status, answer = server.post(body)
    assert status == 413 and answer["error"].startswith("sentences[0]: ") and " tokens; " in answer["error"], answer
    assert server.post(body[:-2] + b" " * (health["max_body_bytes"] - len(body) + 1) + b"]}")[0] == 413
    server.stop()



def test_a_glossary_and_a_sentences_constraints_put_their_terms_in_its_translation(workdir, tmt_here):
    (workdir / "g.tsv").write_text("station\tstazione\ncoffee\tcaffè\n", encoding="utf-8")
    items = [{"source": "Where is the station?"}, {"source": "Good morning.", "constraints": ["pane"]},
             {"source": "The coffee is hot.", "constraints": ["caldo"]}]
    expected = translate_file(tmt_here, workdir, [json.dumps(item) for item in items], "--input-format", "jsonl",
                              "--glossary", "g.tsv", "--beam", "3")
    server = Server(workdir, "--glossary", "g.tsv", "--beam", "3")  # auto: torch, said once
    try:
        assert sum("translating with the torch engine" in line for line in server.lines) == 1
        status, answer = server.post({"sentences": ["Where is the station?", *items[1:]], "scores": True})
        assert status == 200 and answer["translations"] == expected, answer
        assert all(term in text for term, text in zip(["stazione", "pane", "caffè"], answer["translations"]))
        assert "caldo" in answer["translations"][2]
        assert server.get("health")[1]["glossary"] == "g.tsv"
        cases = [
            ({"sentences": ["Where is the station?"], "beam_size": 1}, 422,
             "sentences[0].constraints: constraints (a glossary's terms) need beam search with a beam of 2 or more"),
            ({"sentences": [{"source": "Good morning.", "constraints": ["кофе"]}]}, 422,
             "sentences[0].constraints: the term 'кофе' has characters the target vocabulary cannot spell"),
            ({"sentences": [{"source": "The coffee is hot.", "constraints": ["caldo", "è"]}]}, 422,
             "sentences[0].constraints: 3 terms; a beam of 3 holds at most 2"),
            ({"sentences": [{"source": "Good morning.", "constraints": [3]}]}, 422,
             "sentences[0].constraints[0]: input should be a valid string"),
            ({"sentences": [{"source": "Good morning.", "constraint": ["pane"]}]}, 422,
             "sentences[0].constraint: not a field of a sentence (source, prefix, constraints)"),
        ]
        for body, status, message in cases:
            got, answer = server.post(body)
            assert got == status and answer["error"].startswith(message), (body, answer)
        code, stderr = server.stop()
        assert code == 0, stderr
    finally:
        server.kill()
