"""Headless Chromium driven over the DevTools protocol, for looking at
TensorBoard as a person would: what a page shows, and a screenshot.

`Browser()` starts `chromium --headless=new --remote-debugging-pipe`:
Chromium reads protocol messages (JSON, each ended by a NUL byte) on its
fd 3 and answers on fd 4, so no port is opened. `page(url)` opens a tab;
`text()` is everything it shows, shadow DOMs included (TensorBoard's
Polymer dashboards render inside them, where `--dump-dom` cannot see),
with each element's `title`; `screenshot(path)` saves a PNG. Every wait
is bounded; `close()` (a context manager's exit) ends Chromium.
"""

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
ANSWER_SECS = 30.0
# Every text node and `title` under a node, through shadow roots too.
_DEEP_TEXT = """(function walk(n) {
  let out = n.getAttribute && n.getAttribute('title') ? ' ' + n.getAttribute('title') + ' ' : '';
  if (n.shadowRoot) out += walk(n.shadowRoot);
  for (const c of n.childNodes) out += c.nodeType === 3 ? c.textContent : walk(c);
  return out;
})(document.documentElement)"""


def _high(fds: tuple[int, int]) -> tuple[int, int]:
    """The pipe's ends moved to fds 10 and up, so that the child's dup2s
    to 3 and 4 cannot overwrite one with the other."""
    moved = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in fds)
    for fd in fds:
        os.close(fd)
    return moved


def find_chromium() -> str:
    for name in CANDIDATES:
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no Chromium found (apt: chromium; .ci/install_chromium.sh)")


class Browser:

    def __init__(self, width: int = 1600, height: int = 3000):
        self.size = (width, height)
        to_chrome, self._write = _high(os.pipe())
        self._read, from_chrome = _high(os.pipe())
        argv = [find_chromium(), "--headless=new", "--no-sandbox",
                "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--hide-scrollbars", "--remote-debugging-pipe",
                f"--user-data-dir={os.environ.get('TMPDIR', '/tmp')}"
                f"/chromium-{os.getpid()}-{time.monotonic_ns()}"]
        self._profile = argv[-1].split("=", 1)[1]

        def pipes_as_3_and_4():
            os.dup2(to_chrome, 3)
            os.dup2(from_chrome, 4)

        self.process = subprocess.Popen(
            # close_fds runs after preexec_fn, sparing only pass_fds.
            argv, pass_fds=(3, 4),
            preexec_fn=pipes_as_3_and_4, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(to_chrome)
        os.close(from_chrome)
        self._next_id, self._buffer, self.session = 0, b"", None

    def call(self, method: str, session: str | None = None, **params):
        """Sends one command and returns its result (raises on an error
        answer, or if none comes within ANSWER_SECS)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + ANSWER_SECS
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next_id:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer.get("result", {})
            assert time.monotonic() < deadline, f"no answer to {method}"
            assert self.process.poll() is None, "Chromium exited"
            chunk = os.read(self._read, 1 << 20)
            assert chunk, "Chromium closed its pipe"
            self._buffer += chunk

    def page(self, url: str) -> None:
        """Opens url in a new tab of self.size; later calls act on it."""
        target = self.call("Target.createTarget", url="about:blank")
        self.session = self.call("Target.attachToTarget", flatten=True,
                                 targetId=target["targetId"])["sessionId"]
        width, height = self.size
        self.call("Emulation.setDeviceMetricsOverride", self.session,
                  width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        self.call("Page.navigate", self.session, url=url)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page."""
        return self.call("Runtime.evaluate", self.session,
                         expression=expression,
                         returnByValue=True)["result"].get("value")

    def text(self) -> str:
        return self.evaluate(_DEEP_TEXT) or ""

    def wait_until(self, expression: str, timeout: float = 60):
        """Waits for a JavaScript expression to be truthy; its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, (
                f"still false after {timeout:.0f} s: {expression}")
            time.sleep(0.5)
        return value

    def wait_for_text(self, wanted: list[str], timeout: float = 60) -> str:
        """The page's text once it holds every string of `wanted`."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.text()
            missing = [w for w in wanted if w not in shown]
            if not missing:
                return shown
            assert time.monotonic() < deadline, (
                f"not on the page after {timeout:.0f} s: {missing}")
            time.sleep(0.5)

    def screenshot(self, path) -> None:
        data = self.call("Page.captureScreenshot", self.session,
                         format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.call("Browser.close")
        except (AssertionError, RuntimeError, OSError):
            pass
        finally:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=10)
            for fd in (self._read, self._write):
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
