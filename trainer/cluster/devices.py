"""Where things run: device names, variable placement and thread pools,
and how this process's gRPC connections give up on a silent peer."""

import os

import tensorflow as tf

from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig


def ps_device(index: int) -> str:
    return f"/job:ps/task:{index}"


def worker_device(index: int) -> str:
    return f"/job:worker/task:{index}"


def session_config(config: TrainConfig, task: Task,
                   ps_tasks: list[int] | None = None
                   ) -> tf.compat.v1.ConfigProto:
    """Thread counts and device filters for this task's server and session.

    ps_tasks: the ps tasks a worker's session uses (None: every one); a
    session waits for each of them to answer before its first run.

    Thread pools are per process and sized by the server's config, so the
    same proto goes to tf.distribute.Server and tf.compat.v1.Session. Several
    TensorFlow processes share two cores here: spinning idle threads would
    steal the cores the busy ones need.
    """
    intra, inter = config.op_threads()
    proto = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=intra,
        inter_op_parallelism_threads=inter,
        allow_soft_placement=False)
    proto.experimental.disable_thread_spinning = True
    if task.job_name == "ps":
        proto.device_filters.append(ps_device(task.task_index))
    else:
        # A worker talks to the ps tasks and itself, never to other workers,
        # so it need not wait for them to start.
        proto.device_filters.extend(
            ["/job:ps"] if ps_tasks is None else map(ps_device, ps_tasks))
        proto.device_filters.append(worker_device(task.task_index))
    return proto


GRPC_OPTIONS_ENV = "TF_GRPC_DEFAULT_OPTIONS"
NO_PINGS_MS = 2_000_000_000  # a keepalive period no run reaches


def give_up_silent_connections(config: TrainConfig) -> None:
    """Makes this process's gRPC client connections close once data sent
    on them stays unacknowledged for --worker_timeout_secs (TCP_USER_TIMEOUT).
    Call it before the server starts: TensorFlow reads the options once.

    Why: when a host's link is cut, a connection with data in flight waits
    out TCP's retransmission backoff, which doubles with each try; after a
    30 s cut its next try can come 25 s after the link is back, and every
    call on that connection (a ps fetching a worker's gradient, a new
    session's first run) waits as long. A connection closed meanwhile is
    opened anew at the first call after the link returns. gRPC sets
    TCP_USER_TIMEOUT on a client socket only with a keepalive time; the
    one here is so long that no ping is ever sent (a ps answers frequent
    pings on a connection that carries no data by closing it). Server
    sockets have gRPC's own default. Options the user set in
    TF_GRPC_DEFAULT_OPTIONS win."""
    ours = {"grpc.keepalive_time_ms": NO_PINGS_MS,
            "grpc.keepalive_timeout_ms": int(config.worker_timeout_secs * 1000)}
    theirs = [item for item in os.environ.get(GRPC_OPTIONS_ENV, "").split(",")
              if item.strip()]
    named = {item.split("=", 1)[0].strip() for item in theirs}
    theirs += [f"{key}={value}" for key, value in ours.items()
               if key not in named]
    os.environ[GRPC_OPTIONS_ENV] = ",".join(theirs)


def _ps_strategy(num_ps: int):
    """replica_device_setter strategy: shard variables by their ps index.

    `params/shard_<i>` goes to ps task i (the layout params.plan_shards
    cut by bytes); anything else the setter places (optimizer slots are
    colocated with their shard) goes to ps 0.
    """

    def choose(op) -> int:
        name = op.name
        if name.startswith("params/shard_"):
            return int(name.split("_")[1].split("/")[0]) % num_ps
        return 0

    return choose


def variable_placement(num_ps: int, worker_index: int):
    """A device function for tf.compat.v1.device: variables on the ps tasks
    (shard i on ps i), every other op on this worker.

    (tf.device rejects device functions in TF2; tf.compat.v1.device takes
    them.)
    """
    return tf.compat.v1.train.replica_device_setter(
        ps_tasks=num_ps, worker_device=worker_device(worker_index),
        ps_strategy=_ps_strategy(num_ps))
