"""A ps task: serves the variables the workers place on it until the chief
says the run is over."""

import time

from absl import logging
import tensorflow as tf

from trainer.cluster import devices
from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig
from trainer.common.errors import RunFailed
from trainer.sync import coordination
from trainer.roles import sessions
from trainer.roles import timing


def serve(config: TrainConfig, task: Task, server) -> None:
    """Serves variables until the chief puts an element in our queue.
    Polls the queue's size (not `server.join()`, which never returns, so
    that signals get through) and dequeues only once it is there: a
    dequeue with a timeout could take it just as the deadline passed."""
    graph = tf.Graph()
    with graph.as_default(), tf.device(devices.ps_device(task.task_index)):
        queue = coordination.shutdown_queue(task.task_index)
        queued, take = queue.size(), queue.dequeue()
    with sessions.open_session(server.target, graph, config,
                               task) as session:
        logging.info("%s serving", task.describe())
        while not session.run(queued):
            time.sleep(timing.POLL_SECS)
        status = session.run(take)
    if status:
        raise RunFailed("the chief stopped the run after an error; see its "
                        "log")
    logging.info("%s: the chief reported the end of training; exiting",
                 task.describe())
