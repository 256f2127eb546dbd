"""Check `tmt serve`'s web page in headless Chromium: start the server on a run, open the page, type
sentences (one a line), set beam and n-best, click Translate, and read the translations and the n-best
lists back from the page; they must be what `POST /translate` answers. Then a request the server
refuses (a beam above its largest): the page must show the error alone, the earlier result cleared.
A screenshot of the translated page is kept.

    python tools/check_serve_page.py --run runs/demo [--sentence "..." ...] [--out serve-page.png]

Chromium is driven over its DevTools protocol on a pipe (`--remote-debugging-pipe`): no driver,
no websocket library, nothing from the network."""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Browser:
    """Headless Chromium with one page, spoken to in DevTools protocol messages (JSON, each ended by NUL)
    on fds 3 (to it) and 4 (from it)."""

    def __init__(self, executable: str):
        to_browser, self._writer = os.pipe()
        self._reader, from_browser = os.pipe()

        def wire() -> None:  # in the child: the pipes as fds 3 and 4 (moved above 10 first: either may be 3 or 4)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--remote-debugging-pipe", "--window-size=1000,800", "about:blank"],
            preexec_fn=wire, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._next_id = 0
        self._buffer = b""
        target = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=target["targetId"], flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, **params) -> dict:
        """Send one command (to the page's session when `session` is given) and return its result."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._writer, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._reader, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed its pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def page(self, method: str, **params) -> dict:
        return self.call(method, session=self.session, **params)

    def evaluate(self, expression: str):
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0):
        """The value of `expression` once it is truthy."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {expression}")
            time.sleep(0.05)
        return value

    def type_into(self, selector: str, text: str) -> None:
        """Focus the field, select what it holds and type `text` over it."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus(); "
                      f"document.querySelector({json.dumps(selector)}).select()")
        self.page("Input.insertText", text=text)

    def click(self, selector: str) -> None:
        """A left mouse click at the middle of the element."""
        box = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def start_server(run: Path, extra: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    """`tmt serve --run RUN --port 0`, with the URL it says it serves at and its stderr lines so far."""
    process = subprocess.Popen([sys.executable, "-m", "transformer_mt", "serve", "--run", str(run), "--port", "0",
                                *extra], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            started.set() if "serving" in line else None
        started.set()

    threading.Thread(target=read, daemon=True).start()
    if not started.wait(300) or process.poll() is not None:
        raise SystemExit("check_serve_page: tmt serve did not start:\n" + "".join(lines))
    return process, re.search(r"at (http://\S+/);", "".join(lines)).group(1), lines


# What the page shows, once READY (a JavaScript condition on the n-best table `t`) holds.
SHOWN = ("(() => { const t = document.getElementById('nbest-list'); if (!(READY)) return null; "
         "return {translation: document.getElementById('translation').textContent, hidden: t.hidden, "
         "error: document.getElementById('error').textContent, "
         "rows: [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.textContent))}; })()")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="the run to serve")
    parser.add_argument("--sentence", action="append", help="a line to type (again for more lines; default: "
                                                            "'Where is the station?')")
    parser.add_argument("--beam", type=int, default=4, help="beam size to type into the page")
    parser.add_argument("--n-best", type=int, default=3, help="n-best to type into the page")
    parser.add_argument("--out", type=Path, default=Path("serve-page.png"), help="the screenshot")
    args = parser.parse_args()
    sentences = args.sentence or ["Where is the station?"]
    executable = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not executable:
        raise SystemExit("check_serve_page: no chromium found (apt install chromium)")
    server, url, lines = start_server(args.run, [])
    browser = None
    try:
        browser = Browser(executable)
        browser.page("Page.enable")
        browser.page("Page.navigate", url=url)
        model = browser.wait_for("document.readyState === 'complete' && "
                                 "document.getElementById('model').textContent.includes('→') && "
                                 "document.getElementById('model').textContent")
        browser.type_into("#source", "\n".join(sentences))
        browser.type_into("#beam", str(args.beam))
        browser.type_into("#nbest", str(args.n_best))
        browser.click("#go")
        shown = browser.wait_for(SHOWN.replace("READY", "!t.hidden"))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        browser.screenshot(args.out)
        request = urllib.request.Request(url + "translate", method="POST", data=json.dumps(
            {"sentences": sentences, "beam_size": args.beam, "n_best": args.n_best}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            expected = json.load(response)
        rows = [[f"{i + 1}.{k + 1}" if len(sentences) > 1 else str(k + 1), hyp["translation"], f"{hyp['score']:.4f}"]
                for i, hyps in enumerate(expected["n_best"]) for k, hyp in enumerate(hyps)]
        print(f"page header: {model}")
        print(f"typed {len(sentences)} line(s) {sentences!r}, beam {args.beam}, n-best {args.n_best}; clicked Translate")
        print(f"page shows: {shown['translation']!r}")
        for row in shown["rows"]:
            print("  " + "  ".join(row))
        problems = []
        if shown["error"]:
            problems.append(f"the page shows an error: {shown['error']}")
        if shown["translation"] != "\n".join(expected["translations"]):
            problems.append(f"translations {shown['translation']!r} != POST /translate's {expected['translations']!r}")
        if shown["rows"] != rows:
            problems.append(f"n-best rows {shown['rows']} != POST /translate's {rows}")
        # A request the server refuses: its error, and nothing left of the answer above
        browser.type_into("#beam", "100000")
        browser.click("#go")
        failed = browser.wait_for(SHOWN.replace("READY", "document.getElementById('error').textContent"))
        print(f"beam 100000: the page shows the error {failed['error']!r}, translation {failed['translation']!r}, "
              f"{len(failed['rows'])} n-best row(s), table {'hidden' if failed['hidden'] else 'shown'}")
        if failed["translation"] or failed["rows"] or not failed["hidden"]:
            problems.append("after a refused request the page still shows the earlier translation")
        if problems:
            raise SystemExit("check_serve_page: " + "; ".join(problems))
    finally:
        if browser is not None:
            browser.close()
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
    if code != 0:
        raise SystemExit(f"check_serve_page: tmt serve exited {code}:\n" + "".join(lines))
    print(f"check_serve_page: the page translates as POST /translate does; screenshot in {args.out}")


if __name__ == "__main__":
    main()
