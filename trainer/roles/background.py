"""The threads beside a blocking training run: one skeleton for all.

The step loop runs inside the graph, so while a session.run blocks no
Python code of the training thread runs. What must happen meanwhile
(the chief's membership watch, its round deadlines, every worker's
watchdog) runs on a daemon thread: a BackgroundThread, used as a context
manager around the training runs. Such a thread watches and posts
events to its task's state machine (trainer/roles/states.py); it never
changes the task's role. A single call that must not block its caller
runs on a ThreadCall.
"""

import abc
import threading
from typing import Callable




class BackgroundThread(abc.ABC):
    """A daemon thread, named `name` (in stack dumps), that calls
    `run_once` every `period` seconds (0: back to back) until it is
    stopped or `run_once` returns False. A context manager: enter starts
    it, exit stops it and joins it for at most `join_secs`.

    A subclass whose rhythm is not a fixed period (it blocks in a read
    of its own) overrides `loop`, waiting with `wait` so that a stop cuts
    its sleep short.
    """

    def __init__(self, name: str, period: float, join_secs: float):
        self.period, self._join_secs = period, join_secs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.loop, daemon=True,
                                        name=name)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Tells the thread to stop, and waits for it (at most join_secs)."""
        self._stop.set()
        self._thread.join(timeout=self._join_secs)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, secs: float) -> bool:
        """Sleeps `secs` or until stopped; True if stopped."""
        return self._stop.wait(secs)

    def loop(self) -> None:
        """The thread's body: run_once every period until stopped."""
        while not self.wait(self.period):
            if self.run_once() is False:
                return

    @abc.abstractmethod
    def run_once(self) -> bool | None:
        """One check; False ends the thread."""


class ThreadCall:
    """call() on a daemon thread of its own, started at once."""

    def __init__(self, call: Callable, name: str):
        self._box = {}
        self._thread = threading.Thread(target=self._run, args=(call,),
                                        daemon=True, name=name)
        self._thread.start()

    def _run(self, call: Callable) -> None:
        try:
            self._box["value"] = call()
        except Exception as e:  # noqa: BLE001 (raised by result)
            self._box["error"] = e

    def done(self, timeout: float | None = None) -> bool:
        """Waits at most `timeout` seconds (None: no limit) for the call to
        end; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None):
        """call()'s value, or its error raised, once it ends within
        `timeout` seconds; TimeoutError if it does not."""
        if not self.done(timeout):
            raise TimeoutError(f"no answer in {timeout} s")
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]
