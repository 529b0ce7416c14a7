"""Every session a task opens on its cluster (training, warmed beforehand,
small ones of its own), and their bounded closes. Each uses only the ps
tasks it names, so that a ps done without holds none up."""

import tensorflow as tf

from trainer.cluster import devices
from trainer.roles import timing
from trainer.roles.background import ThreadCall


def open_session(target: str, graph: tf.Graph, config, task,
                 ps_tasks: list[int] | None = None) -> tf.compat.v1.Session:
    """A session on `graph` through `target`, using `ps_tasks` (None: all)."""
    return tf.compat.v1.Session(
        target, graph=graph,
        config=devices.session_config(config, task, ps_tasks))


def close_within(session, secs: float = timing.QUICK_CLOSE_SECS) -> bool:
    """Closes `session` on a thread, errors dropped: whether it ended within
    `secs` (a close to a peer cut off or gone blocks while TCP/gRPC retry)."""
    return ThreadCall(session.close, "session-close").done(secs)


class Own:
    """A session on a small graph of our own (the chief's beat, a claim,
    ps 0's reader): its runs never wait behind the training session's big
    first run (a session places one graph at a time). Runs wait at most
    `timeout_ms`; a failed one opens it anew (for a ps started again)."""

    def __init__(self, target: str, graph: tf.Graph, config, task,
                 ps_tasks: list[int] | None, timeout_ms: int):
        self._args = (target, graph, config, task, ps_tasks)
        self._session = open_session(*self._args)
        self._options = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms)

    def run(self, fetches, feeds=None):
        """session.run(fetches, feeds); raises tf.errors.OpError."""
        try:
            return self._session.run(fetches, feeds, options=self._options)
        except tf.errors.OpError:
            close_within(self._session)   # its peer may be gone
            self._session = open_session(*self._args)
            raise

    def close(self) -> None:
        close_within(self._session)
