"""async: TF2's ParameterServerStrategy with a ClusterCoordinator.

The parameter-server training TF2 offers, which is asynchronous only: the
coordinator (the "chief" task) schedules step functions; each worker runs
one when it is free, reading the parameters from the ps tasks, computing
its gradient and applying it there at once, whatever the other workers are
doing. Workers and ps tasks are plain servers that never return.

Same model, initial parameters, update rule and learning-rate schedule as
the trainer. Two variants:

    async        each function trains on a whole global batch, and
                 train_steps functions are scheduled: as many updates as
                 the trainer, each on as many examples, so what differs
                 from it is staleness alone. Function k trains on global
                 batch k at the learning rate of step k, on whichever
                 worker is free.
    async_split  each function trains on global batch / N examples, and
                 N x train_steps functions are scheduled, so the examples
                 seen in all equal the trainer's: function k trains on
                 slice k % N of global batch k // N. The step the
                 learning rate and the log count is functions / N. N times
                 as many updates, each on 1/N of the batch at the same
                 learning rate: not staleness alone.

The coordinator names each function's rows (step, first row, size):
ParameterServerStrategy gives every worker the same dataset and no worker
index (its InputContext's input_pipeline_id is always 0), so a dataset
cannot pick a worker's slice. The results count the distinct (step, first
row) slices the workers report having trained (`distinct_slices`), equal
to `functions` when each was trained once.
"""

import os
import sys

import numpy as np
import tensorflow as tf

from absl import logging

from trainer.bench.baselines import common
from trainer.bench.baselines import peer
from trainer.common.config import TrainConfig
from trainer.learning import batches
from trainer.learning import model as model_lib
from trainer.learning import optim
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.observe import progress
from trainer.observe import summaries


def extra_columns(leader: dict, outputs: dict, tasks: list) -> dict:
    """The distinct (step, first row) slices trained, of train_steps (or
    of N x train_steps with async_split); fewer if some were repeated."""
    del outputs, tasks
    return {"distinct_slices": leader.get("distinct_slices")}


# The coordinator leads; the workers and ps tasks are servers that never
# return from server.join(): the benchmark ends them.
PEER = peer.Peer(
    name="async", order=3,
    label="ParameterServerStrategy (async), {} worker(s)",
    help="async (ParameterServerStrategy, each update on the global batch)",
    ps=True, coordinator=True, ends_by_itself=False,
    extra_columns=extra_columns)


def run_task(config: TrainConfig, out_path: str, job: str, index: int,
             hosts: dict, split: bool = False) -> None:
    """Runs ps or worker `index` (forever), or the coordinator ("chief");
    split: the async_split variant (module docstring)."""
    cluster = tf.train.ClusterSpec({"ps": hosts["ps"],
                                    "worker": hosts["worker"],
                                    "chief": hosts["chief"]})
    tf.config.threading.set_intra_op_parallelism_threads(
        config.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(
        config.inter_op_threads)
    if job in ("ps", "worker"):
        server = tf.distribute.Server(cluster, job_name=job, task_index=index,
                                      protocol="grpc", start=True)
        logging.info("%s %d serving (server.join(): never returns)", job,
                     index)
        server.join()
    os.environ.pop("TF_CONFIG", None)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    _coordinate(config, out_path, strategy, len(hosts["worker"]), split)


def _plan(config, num_workers: int, split: bool):
    """What each scheduled function trains on: a function of k (its
    position in scheduling order) -> (step, first row, rows) as int64
    tensors []; and the functions per step. async: function k is global
    batch k whole; async_split: function k is slice k % N of global
    batch k // N."""
    per_step = num_workers if split else 1
    bounds = (batches.shard_bounds(config.batch_size, num_workers) if split
              else [(0, config.batch_size)])

    def function_args(k: int) -> tuple:
        start, end = bounds[k % per_step]
        return tuple(tf.constant(v, tf.int64)
                     for v in (k // per_step, start, end - start))

    return function_args, per_step


def _train_set_fn(mnist):
    """Per worker: the training set, (images uint8 [60000, 28, 28], labels
    int32 [60000]), again at every next(). ParameterServerStrategy gives
    every worker the same dataset (no worker index), so the coordinator
    names each function's rows instead (_plan)."""
    images, labels = mnist.train_images, mnist.train_labels.astype(np.int32)
    return lambda: tf.data.Dataset.from_tensors((images, labels)).repeat()


def _rows(config, num_examples: int, per_epoch: int, step: tf.Tensor,
          first_row: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
    """Example indices of rows [first_row, first_row + size) of global
    batch `step` (int64 [] each), in the trainer's order: int32 [size]."""
    order = batches.epoch_order(num_examples, config.seed, step // per_epoch)
    first = (step % per_epoch) * config.batch_size + first_row
    return tf.slice(order, tf.reshape(tf.cast(first, tf.int32), [1]),
                    tf.reshape(tf.cast(size, tf.int32), [1]))


def _stateless_dropout(seed: int, step: tf.Tensor, first_row: tf.Tensor):
    """Dropout keyed by (seed, step, first row): the same for a slice
    wherever it runs. Not the trainer's masks (those need the row offset
    as a Python int); async training is not exact anyway."""

    def dropout(x: tf.Tensor, rate: float) -> tf.Tensor:
        noise = tf.random.stateless_uniform(
            tf.shape(x), seed=tf.stack([step + seed * 1_000_003, first_row]))
        return tf.where(noise >= rate, x / (1.0 - rate), tf.zeros_like(x))

    return dropout


def _coordinate(config, out_path, strategy, num_workers: int,
                split: bool) -> None:
    mnist, train_steps = common.load(config, need_test=True)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    layout = params_lib.FlatLayout(params_lib.plan_shards(
        replica_lib.model_specs(config), 1))
    rule = optim.update_rule(config)
    with strategy.scope():
        flat = tf.Variable(common.initial_parameters(layout))
        rule_state = rule.flat_state(layout.sizes[0])
    iterators = iter(coordinator.create_per_worker_dataset(
        _train_set_fn(mnist)))
    function_args, per_step = _plan(config, num_workers, split)
    per_epoch = batches.steps_per_epoch(len(mnist.train_labels),
                                        config.batch_size)

    def logits_of(x, dropout=model_lib.no_dropout):
        return replica_lib.logits(config, layout, [flat], x, dropout)

    @tf.function
    def train_slice(iterator, step, first_row, size):
        train_images, train_labels = next(iterator)
        rows = _rows(config, len(mnist.train_labels), per_epoch, step,
                     first_row, size)
        images = tf.gather(train_images, rows)
        labels = tf.gather(train_labels, rows)
        dropout = _stateless_dropout(config.seed, step, first_row)
        with tf.GradientTape() as tape:
            out = logits_of(batches.model_input(images), dropout)
            stats = replica_lib.batch_stats(out, labels)
            loss_sum = stats[1]
        grad = tape.gradient(loss_sum, flat)
        rule.apply_flat(rule_state, flat, grad / stats[0],
                        optim.learning_rate(config, step, train_steps))
        return stats, step, first_row

    evaluate = common.test_set_evaluator(mnist, logits_of)
    writer = summaries.summary_writer(config.logdir)
    trained = set()  # (step, first row) of every slice trained

    def run_steps(start: int, count: int) -> dict:
        results = [coordinator.schedule(
            train_slice, args=(iterators, *function_args(k)))
            for k in range(start * per_step, (start + count) * per_step)]
        coordinator.join()
        fetched = [r.fetch() for r in results]
        trained.update((int(s), int(r)) for _, s, r in fetched)
        return {"stats": np.sum([f[0] for f in fetched], axis=0)}

    outcome = progress.drive(run_steps, evaluate, None, config, 0,
                             train_steps, writer)
    writer.close()
    common.write_results(out_path, config, train_steps, outcome,
                         functions=train_steps * per_step,
                         examples_per_update=(config.batch_size / per_step),
                         distinct_slices=len(trained))
    logging.info("%s: %d functions of global batch / %d examples; %d "
                 "distinct slices", "async_split" if split else "async",
                 train_steps * per_step, per_step, len(trained))


if __name__ == "__main__":
    sys.exit(peer.main(PEER, run_task))
