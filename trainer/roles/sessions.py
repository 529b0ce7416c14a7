"""Every session a task opens on its cluster, and their bounded closes: its
training session, sessions warmed beforehand (standby.py) and small ones of
its own (`Own`), each using only the ps tasks it names, so that a ps done
without holds none up."""

import functools

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
    """Closes a session on a thread, waiting at most `secs` (with a peer
    cut off or gone, a close can block as long as TCP or gRPC retries it).
    Whether it ended in time; its error, if any, is dropped."""
    return ThreadCall(session.close, "session-close").done(secs)


class Own:
    """A session on a small graph of our own (the chief's beat, a claim,
    ps 0's reader): a session places one new graph at a time (its
    MasterSession holds a mutex meanwhile), so a short run on the training
    session can wait seconds behind a big first run on a starved host.
    Each run waits at most `timeout_ms`; after a failed run the session is
    opened again, since an old session cannot use a ps started again."""

    def __init__(self, target: str, graph: tf.Graph, config, task,
                 ps_tasks: list[int] | None, timeout_ms: int):
        self._open = functools.partial(open_session, target, graph, config,
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
