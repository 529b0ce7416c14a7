"""Threads beside a blocking training run: the base of the watch threads
(they post events, roles/states.py, never change the role) and ThreadCall."""

import abc
import threading
from typing import Callable


class BackgroundThread(abc.ABC):
    """A daemon thread `name` calling run_once() every `period` s (0: back to
    back) until stopped or it returns False; exit joins it for `join_secs`."""

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
        self._stop.set()
        self._thread.join(timeout=self._join_secs)

    def wait(self, secs: float) -> bool:
        """Sleeps `secs` or until stopped; True if stopped."""
        return self._stop.wait(secs)

    def loop(self) -> None:
        while not self.wait(self.period):
            if self.run_once() is False:
                return

    @abc.abstractmethod
    def run_once(self) -> bool | None:
        """One check; False ends the thread."""


class ThreadCall:
    """call() on a daemon thread of its own, started at once."""

    def __init__(self, call: Callable, name: str):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(call,),
                                        daemon=True, name=name)
        self._thread.start()

    def _run(self, call: Callable) -> None:
        try:
            self._value = call()
        except Exception as e:  # noqa: BLE001 (raised by result)
            self._error = e

    def done(self, timeout: float | None = None) -> bool:
        """Waits up to `timeout` s (None: no limit); whether the call ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None):
        """call()'s value or error (raised); TimeoutError after `timeout` s."""
        if not self.done(timeout):
            raise TimeoutError(f"no answer in {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value
