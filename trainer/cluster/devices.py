"""Where things run: device names, variable placement and thread pools."""

import tensorflow as tf

from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig


def ps_device(index: int) -> str:
    return f"/job:ps/task:{index}"


def worker_device(index: int) -> str:
    return f"/job:worker/task:{index}"


def session_config(config: TrainConfig, task: Task) -> tf.compat.v1.ConfigProto:
    """Thread counts and device filters for this task's server and session.

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
        proto.device_filters.extend(["/job:ps", worker_device(task.task_index)])
    return proto


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
