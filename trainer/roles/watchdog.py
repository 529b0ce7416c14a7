"""A worker's watchdog over the global step while a run blocks ("Lost
worker" in docs/how-it-works.md). A read of ps 0 that fails or outlasts
timing.READ_DEADLINE_SECS is no progress: cut off from ps 0, a run may
never fail (TCP retries; a RunOptions timeout did not end such reads)."""

import contextlib
import threading
import time
from typing import Callable

from absl import logging

from trainer.roles import timing
from trainer.roles.background import BackgroundThread, ThreadCall


class BoundedRead:
    """Calls read() on a helper thread for at most timing.READ_DEADLINE_SECS
    (else TimeoutError); while an earlier call still blocks, none starts."""

    def __init__(self, read: Callable):
        self._read, self._call = read, None

    def __call__(self):
        if self._call is None or self._call.done(0):
            self._call = ThreadCall(self._read, "watchdog-read")
        return self._call.result(timing.READ_DEADLINE_SECS)


class Watchdog(BackgroundThread):
    """Warns of, then acts on, a global step standing still. read_progress:
    () -> (step, admitted flags per worker); describe_missing: flags -> who
    the step waits for. Once, from the thread: on_timeout(step or None, who
    or `unreachable`) after timeout_secs (timeout_flag) standing still;
    on_return(secs) when ps 0 answers after >= return_after_secs without."""

    def __init__(self, read_progress: Callable[[], tuple[int, list]],
                 describe_missing: Callable[[list], str], timeout_secs: float,
                 on_timeout: Callable[[int | None, str], None],
                 unreachable: str = "ps 0, which does not answer",
                 timeout_flag: str = "--worker_timeout_secs",
                 on_return: Callable[[float], None] | None = None,
                 return_after_secs: float = 0.0):
        every = timing.WATCHDOG_CHECK_SECS
        super().__init__("watchdog", every, every * 3)
        self._read = BoundedRead(read_progress)
        self._describe, self._unreachable = describe_missing, unreachable
        self._timeout, self._flag = timeout_secs, timeout_flag
        self._on_return, self._return_after = on_return, return_after_secs
        self._on_timeout, self._busy = on_timeout, threading.Event()
        self._idle(time.monotonic())

    @contextlib.contextmanager
    def busy(self):
        """Context: the step should move while inside (a training run)."""
        self._busy.set()
        try:
            yield
        finally:
            self._busy.clear()

    def _idle(self, now: float) -> None:
        self._last_step = self._next_warning = self._failing_since = None
        self._since = now

    def run_once(self) -> bool | None:
        """One check; False once on_timeout or on_return was called."""
        now = time.monotonic()
        if not self._busy.is_set():
            self._idle(now)
            return None
        try:
            step, admitted = self._read()
        except Exception:  # noqa: BLE001 (any failure: no progress)
            self._failing_since = self._failing_since or now
            if now - self._since >= self._timeout:
                self._on_timeout(self._last_step, self._unreachable)
                return False
            return None
        if self._failing_since is not None and self._on_return is not None \
                and now - self._failing_since >= self._return_after:
            self._on_return(now - self._failing_since)
            return False
        self._failing_since = None
        if step != self._last_step:
            self._last_step, self._since = step, now
            self._next_warning = now + timing.WARN_EVERY_SECS
            return None
        stalled = now - self._since
        if stalled >= self._timeout:
            self._on_timeout(step, self._describe(admitted))
            return False
        if self._next_warning is not None and now >= self._next_warning:
            logging.warning("global step %d has not moved for %.0f s; "
                            "waiting for %s (giving up after %.0f s, %s)",
                            step, stalled, self._describe(admitted),
                            self._timeout, self._flag)
            self._next_warning = now + timing.WARN_EVERY_SECS
        return None
