"""Every session a task opens on its cluster, and their bounded closes.

    open_session(target, graph, config, task, ps_tasks=None) -> Session
    Own(target, graph, config, task, ps_tasks, timeout_ms)    .run .close
    close_within(session, secs) -> whether it closed in time

A worker process holds several sessions on one server: its training
session (trainer/roles/lifecycle.py, one per connect), sessions warmed
beforehand on graphs it may switch to (standby.py: the spare chief's,
those without a ps), and small ones of its own (`Own`) for reads and
writes that must not wait behind the training session: the chief's
beat, a claim (takeover.py), ps 0's reader (without_ps.py). Each uses
only the ps tasks it names, so that a ps done without holds none up.
"""

from typing import Callable

import tensorflow as tf

from trainer.cluster import devices
from trainer.roles import timing
from trainer.roles.background import ThreadCall


def open_session(target: str, graph: tf.Graph, config, task,
                 ps_tasks: list[int] | None = None) -> tf.compat.v1.Session:
    """A session on `graph` through this task's server (`target`), using
    the ps tasks in `ps_tasks` (None: every one)."""
    return tf.compat.v1.Session(
        target, graph=graph,
        config=devices.session_config(config, task, ps_tasks))


def close_within(session, secs: float = timing.QUICK_CLOSE_SECS) -> bool:
    """Closes a session on a thread of its own, waiting at most `secs`:
    with a peer cut off or gone, a close can block as long as TCP or gRPC
    retries it. Whether it ended in time (its error, if any, is dropped:
    the peer may be gone already)."""
    return ThreadCall(session.close, "session-close").done(secs)


class Own:
    """A session on a small graph of our own, apart from the training
    session: a session builds one new graph at a time (TensorFlow's
    MasterSession holds its mutex while it prunes and places one), so a
    short read or write there can wait seconds behind a big first run on
    a starved host. Each run waits at most `timeout_ms`; after a failed
    run the session is opened again, since a ps it uses may have been
    started again, which an old session cannot use."""

    def __init__(self, target: str, graph: tf.Graph, config, task,
                 ps_tasks: list[int] | None, timeout_ms: int):
        self._open: Callable = lambda: open_session(target, graph, config,
                                                    task, ps_tasks)
        self._session = self._open()
        self._options = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms)

    def run(self, fetches, feeds=None):
        """session.run(fetches, feeds); raises tf.errors.OpError."""
        try:
            return self._session.run(fetches, feeds, options=self._options)
        except tf.errors.OpError:
            close_within(self._session)   # its peer may be gone
            self._session = self._open()
            raise

    def close(self) -> None:
        close_within(self._session)
