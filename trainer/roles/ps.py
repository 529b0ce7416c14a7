"""A ps task: serves the workers' variables until the chief ends the run."""

import time

from absl import logging
import tensorflow as tf

from trainer.cluster import devices
from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig
from trainer.common.errors import RunFailed
from trainer.roles import sessions, timing
from trainer.sync import coordination


def serve(config: TrainConfig, task: Task, server) -> None:
    """Serves variables until the chief queues our exit status. Polls the
    queue's size (server.join() never returns, nor lets signals in), then
    dequeues: one with a timeout could take it just as its deadline passed."""
    graph = tf.Graph()
    with graph.as_default(), tf.device(devices.ps_device(task.task_index)):
        queue = coordination.shutdown_queue(task.task_index)
        queued, take = queue.size(), queue.dequeue()
    with sessions.open_session(server.target, graph, config, task) as session:
        logging.info("%s serving", task.describe())
        while not session.run(queued):
            time.sleep(timing.POLL_SECS)
        status = session.run(take)
    if status:
        raise RunFailed("the chief stopped the run after an error; see its "
                        "log")
    logging.info("%s: the chief reported the end of training; exiting",
                 task.describe())
