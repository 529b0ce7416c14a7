"""A ps or a worker for tests/test_connections.py: one variable on the
ps, and a worker that pushes to it until told to start a new session.

    python -m tests.grpc_peer ps|worker PS_ADDRESS WORKER_ADDRESS TIMEOUT

TIMEOUT: --worker_timeout_secs for give_up_silent_connections, or 0 to
leave gRPC's options as TensorFlow has them. The worker prints "pushing"
once its pushes go through, then reads a line from stdin, opens a new
session and prints how its push went (_new_session).
"""

import os
import sys
import threading
import time

import tensorflow as tf

from trainer.cluster import devices
from trainer.common.config import TrainConfig


def main(role: str, ps: str, worker: str, timeout: float) -> None:
    if timeout:
        devices.give_up_silent_connections(
            TrainConfig(logdir="unused", worker_timeout_secs=timeout))
    cluster = tf.train.ClusterSpec({"ps": [ps], "worker": [worker]})
    server = tf.distribute.Server(cluster, job_name=role, task_index=0)
    if role == "ps":
        server.join()
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(devices.ps_device(0)):
            v = tf.compat.v1.get_variable("v", [100_000], tf.float32,
                                          tf.zeros_initializer(),
                                          use_resource=True)
        with tf.device(devices.worker_device(0)):
            # The ps fetches this from the worker for every push, so the
            # ps's own connection to the worker carries calls too.
            gradient = tf.random.uniform([100_000])
        push = v.assign_add(gradient)
        init = tf.compat.v1.global_variables_initializer()
    session = tf.compat.v1.Session(server.target, graph=graph)
    session.run(init)
    session.run(push)
    print("pushing", flush=True)
    threading.Thread(target=_push_forever, args=(session, push),
                     daemon=True).start()
    sys.stdin.readline()
    threading.Thread(target=session.close, daemon=True).start()
    print(_new_session(server.target, graph, push), flush=True)
    os._exit(0)  # the old session may still hang on the cut connection


def _new_session(target, graph, push) -> str:
    """Pushes from a new session; once more after a reset (a connection
    its far end closed during the cut is found dead at its first use, at
    once, as a trainer's reconnect would find it). Returns the line to
    print: "new session: ok, R reset(s), S s" or "new session: failed:
    <error>"."""
    started, resets = time.monotonic(), 0
    while True:
        try:
            tf.compat.v1.Session(target, graph=graph).run(push)
            return (f"new session: ok, {resets} reset(s), "
                    f"{time.monotonic() - started:.1f} s")
        except tf.errors.OpError as e:
            message = " ".join(e.message.split())
            if resets or "Connection reset by peer" not in message:
                return "new session: failed: " + message[:300]
            resets += 1


def _push_forever(session, push) -> None:
    try:
        while True:
            session.run(push)
    except tf.errors.OpError:
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
