"""The launcher's output: the tasks' lines, and one status line under them.

Every task's output is relayed by a thread of its own, so the lines reach
a Console, which writes one at a time. On a terminal the status line stays
at the bottom and is rewritten in place: a task's line clears it, is
written, and the status is drawn again below it. Elsewhere (a file, a
pipe, CI) each status is a plain line of its own, `[status] ...`.
"""

import shutil
import sys
import threading

_CLEAR = b"\r\x1b[K"   # to the line's start, erase to its end


class Console:

    def __init__(self, out=None, live: bool | None = None):
        """out: a binary stream (default: stdout's); live: rewrite the
        status in place (default: whether stdout is a terminal)."""
        self._out = out if out is not None else sys.stdout.buffer
        self._live = sys.stdout.isatty() if live is None else live
        self._status = b""
        self._lock = threading.Lock()

    def line(self, data: bytes) -> None:
        """Writes one task line (bytes as the task printed them)."""
        with self._lock:
            if self._status:
                self._out.write(_CLEAR)
            self._out.write(data if data.endswith(b"\n") else data + b"\n")
            self._out.write(self._status)
            self._out.flush()

    def status(self, text: str) -> None:
        """Shows the run's status: in place on a terminal (cut to its
        width, since a wrapped line cannot be rewritten), else a line."""
        with self._lock:
            if self._live:
                width = shutil.get_terminal_size().columns - 1
                self._status = text[:width].encode()
                self._out.write(_CLEAR + self._status)
            else:
                self._out.write(f"[status] {text}\n".encode())
            self._out.flush()

    @property
    def live(self) -> bool:
        return self._live

    def text_stream(self):
        """A text stream whose writes are lines of this console: for our
        own log lines, which would otherwise land on the status line."""
        console = self

        class _Stream:
            def write(self, text: str) -> None:
                if text:
                    console.line(text.encode())

            def flush(self) -> None:
                pass

        return _Stream()

    def close(self) -> None:
        """Leaves the last status on the screen, ending its line."""
        with self._lock:
            if self._status:
                self._out.write(b"\n")
                self._out.flush()
                self._status = b""
