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
                 from it is staleness alone. Worker w's iterator yields
                 global batches w, w + N, w + 2N, ... (step i at the
                 learning rate of step i); a worker that runs more than
                 its share wraps round to its first batches, so the
                 results count the distinct batches trained
                 (`distinct_batches`).
    async_split  each function trains on global batch / N examples, and
                 N x train_steps functions are scheduled, so the examples
                 seen in all equal the trainer's: worker w feeds slice w
                 of global batch i to its i-th function. The step the
                 learning rate and the log count is functions / N. N times
                 as many updates, each on 1/N of the batch at the same
                 learning rate: not staleness alone.
"""

import os

import numpy as np
import tensorflow as tf

from absl import logging

from trainer.bench.baselines import common
from trainer.common.config import TrainConfig
from trainer.learning import batches
from trainer.learning import model as model_lib
from trainer.learning import optim
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.observe import progress


def run_async_task(config: TrainConfig, out_path: str, job: str, index: int,
                   ps_hosts: list[str], worker_hosts: list[str],
                   chief_host: str, split: bool = False) -> None:
    """Runs ps or worker `index` (forever), or the coordinator ("chief");
    split: the async_split variant (module docstring)."""
    cluster = tf.train.ClusterSpec({"ps": ps_hosts, "worker": worker_hosts,
                                    "chief": [chief_host]})
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
    _coordinate(config, out_path, strategy, len(worker_hosts), split)


def _dataset_fn(config, mnist, train_steps: int, num_workers: int,
                split: bool):
    """Per worker w: (images uint8 [m, 28, 28], labels int32 [m], step,
    first row), in the trainer's order. split: slice w of every global
    batch (m = its share); else global batches w, w + N, ... whole (m =
    --batch_size, first row 0)."""
    per_epoch = batches.steps_per_epoch(len(mnist.train_labels),
                                        config.batch_size)
    images, labels = mnist.train_images, mnist.train_labels.astype(np.int32)
    bounds = (batches.shard_bounds(config.batch_size, num_workers) if split
              else [(0, config.batch_size)] * num_workers)

    def dataset_fn(context: tf.distribute.InputContext):
        worker = context.input_pipeline_id % num_workers
        start, end = bounds[worker]
        x, y = tf.constant(images), tf.constant(labels)

        def slice_of(step):
            order = batches.epoch_order(len(labels), config.seed,
                                        step // per_epoch)
            rows = batches.slice_indices(order, step % per_epoch,
                                         config.batch_size, (start, end))
            return (tf.gather(x, rows), tf.gather(y, rows), step,
                    tf.constant(start, tf.int64))

        steps = (tf.data.Dataset.range(train_steps) if split else
                 tf.data.Dataset.range(worker, train_steps, num_workers))
        return steps.map(slice_of).repeat()

    return dataset_fn


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
    dataset_fn = _dataset_fn(config, mnist, train_steps, num_workers, split)
    # distribute_datasets_from_function gives dataset_fn the worker's
    # InputContext (input_pipeline_id: which slice it feeds).
    iterators = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)))

    def logits_of(x, dropout=model_lib.no_dropout):
        return replica_lib.logits(config, layout, [flat], x, dropout)

    @tf.function
    def train_slice(iterator):
        images, labels, step, first_row = next(iterator)
        dropout = _stateless_dropout(config.seed, step, first_row)
        with tf.GradientTape() as tape:
            out = logits_of(batches.model_input(images), dropout)
            stats = replica_lib.batch_stats(out, labels)
            loss_sum = stats[1]
        grad = tape.gradient(loss_sum, flat)
        rule.apply_flat(rule_state, flat, grad / stats[0],
                        optim.learning_rate(config, step, train_steps))
        return stats, step

    evaluate = common.test_set_evaluator(mnist, logits_of)
    writer = progress.summary_writer(config.logdir)

    per_step = num_workers if split else 1
    trained = set()  # the global batches (steps) functions trained on

    def run_steps(start: int, count: int) -> dict:
        results = [coordinator.schedule(train_slice, args=(iterators,))
                   for _ in range(count * per_step)]
        coordinator.join()
        fetched = [r.fetch() for r in results]
        trained.update(int(step) for _, step in fetched)
        return {"stats": np.sum([stats for stats, _ in fetched], axis=0)}

    outcome = progress.drive(run_steps, evaluate, None, config, 0,
                             train_steps, writer)
    writer.close()
    common.write_results(out_path, config, train_steps, outcome,
                         functions=train_steps * per_step,
                         examples_per_update=(config.batch_size / per_step),
                         distinct_batches=len(trained))
    logging.info("%s: %d functions of global batch / %d examples; %d "
                 "distinct global batches", "async_split" if split else
                 "async", train_steps * per_step, per_step, len(trained))
