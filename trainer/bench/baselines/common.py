"""What the peers share: data, results, the initial parameters and eager
helpers for the step loop and the test set."""

import pathlib

import numpy as np
import tensorflow as tf

from trainer.common.config import TrainConfig
from trainer.learning import batches
from trainer.learning import data as data_lib
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.observe import results


def load(config: TrainConfig, need_test: bool):
    mnist = data_lib.load(data_lib.resolve_data_dir(config.data_dir),
                          config.download,
                          data_lib.source_list(config.data_url),
                          need_test=need_test)
    return mnist, config.resolved_train_steps(len(mnist.train_labels))


def write_results(path: str, config: TrainConfig, train_steps: int,
                  outcome: results.Outcome, **extra) -> None:
    results.write_json(pathlib.Path(path), {
        **results.results_fields(outcome, config, train_steps), **extra})


def initial_parameters(layout: params_lib.FlatLayout) -> np.ndarray:
    """The flat initial vector, computed as the ps trainer computes it."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        return session.run(layout.initial_value(0))


def eager_step_runner(train_step, order: tf.Variable, seed: int,
                       steps_per_epoch: int):
    """(start, count) -> {"stats"}: runs train_step for each step, with
    `order` (int32 [num_examples]) holding the step's epoch order."""
    epoch_loaded = [-1]

    def run_steps(start: int, count: int) -> dict:
        stats = tf.zeros([replica_lib.NUM_STATS])
        for step in range(start, start + count):
            epoch = step // steps_per_epoch
            if epoch != epoch_loaded[0]:
                order.assign(batches.epoch_order(
                    int(order.shape[0]), seed, tf.constant(epoch, tf.int64)))
                epoch_loaded[0] = epoch
            stats += train_step(tf.constant(step, tf.int64))
        return {"stats": stats.numpy()}

    return run_steps


def test_set_evaluator(mnist: data_lib.Mnist, logits_of):
    """() -> {"loss", "accuracy"} over the test set, in chunks."""
    test_images = tf.constant(mnist.test_images)
    test_labels = tf.constant(mnist.test_labels.astype(np.int32))
    count = len(mnist.test_labels)

    @tf.function
    def chunk(start, size):
        return replica_lib.chunk_sums(logits_of, test_images, test_labels,
                                      start, size)

    def evaluate():
        sums = np.zeros(2)
        for start in range(0, count, replica_lib.EVAL_CHUNK):
            size = min(replica_lib.EVAL_CHUNK, count - start)
            sums += [float(v) for v in chunk(tf.constant(start),
                                             tf.constant(size))]
        return {"loss": sums[0] / count, "accuracy": sums[1] / count}

    return evaluate
