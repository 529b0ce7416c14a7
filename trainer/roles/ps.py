"""A ps task: serves the variables the workers place on it until the chief
says the run is over."""

from absl import logging
import tensorflow as tf

from trainer.cluster import devices
from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig
from trainer.common.errors import RunFailed
from trainer.sync import coordination


def serve(config: TrainConfig, task: Task, server) -> None:
    """Serves variables until the chief puts an element in our queue.

    `server.join()` would never return; instead the ps runs a dequeue on its
    own shutdown queue, a second at a time so that signals get through.
    """
    graph = tf.Graph()
    with graph.as_default(), tf.device(devices.ps_device(task.task_index)):
        wait = coordination.shutdown_queue(task.task_index).dequeue()
    options = tf.compat.v1.RunOptions(timeout_in_ms=1000)
    with tf.compat.v1.Session(server.target, graph=graph,
                              config=devices.session_config(config, task)
                              ) as session:
        logging.info("%s serving", task.describe())
        while True:
            try:
                status = session.run(wait, options=options)
                break
            except tf.errors.DeadlineExceededError:
                continue
    if status:
        raise RunFailed("the chief stopped the run after an error; see its "
                        "log")
    logging.info("%s: the chief reported the end of training; exiting",
                 task.describe())
