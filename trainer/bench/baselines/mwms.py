"""mwms: TensorFlow's MultiWorkerMirroredStrategy, what a user would pick
instead of a parameter server: N worker processes, a custom training loop
(no Keras) that all-reduces each step's gradient sums with collective ops
(ring). Same initial parameters, batches, dropout masks and update kernels
as the ps trainer, so the accuracies compare."""

import json
import os
import sys

import numpy as np
import tensorflow as tf

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

PEER = peer.Peer(
    name="mwms", order=1, label="MWMS, {} worker(s)",
    help="mwms (MultiWorkerMirroredStrategy, ring all-reduce)")


def run_task(config: TrainConfig, out_path: str, job: str, index: int,
             hosts: dict) -> None:
    """Worker `index` (the only job) of the ring over hosts["worker"]."""
    del job
    run_mwms_worker(config, out_path, index, hosts["worker"])


def _mwms_strategy(config: TrainConfig, index: int, hosts: list[str]):
    """This process as worker `index` of a ring all-reduce over `hosts`."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": hosts},
        "task": {"type": "worker", "index": index}})
    tf.config.threading.set_intra_op_parallelism_threads(
        config.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(
        config.inter_op_threads)
    ring = tf.distribute.experimental.CommunicationImplementation.RING
    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=ring))


def run_mwms_worker(config: TrainConfig, out_path: str, index: int,
                    hosts: list[str]) -> None:
    """One worker of a MultiWorkerMirroredStrategy run on loopback."""
    strategy = _mwms_strategy(config, index, hosts)
    is_chief = index == 0
    mnist, train_steps = common.load(config, need_test=is_chief)
    bounds = batches.shard_bounds(config.batch_size, len(hosts))[index]
    steps_per_epoch = batches.steps_per_epoch(len(mnist.train_labels),
                                              config.batch_size)
    layout = params_lib.FlatLayout(params_lib.plan_shards(
        replica_lib.model_specs(config), 1))
    # A plain (not mirrored) variable per worker: every worker applies the
    # same all-reduced gradient, so the copies stay equal.
    flat = tf.Variable(common.initial_parameters(layout))
    rule = optim.update_rule(config)
    rule_state = rule.flat_state(layout.sizes[0])
    images = tf.constant(mnist.train_images)
    labels = tf.constant(mnist.train_labels.astype(np.int32))
    order = tf.Variable(tf.zeros([len(mnist.train_labels)], tf.int32))

    def logits_of(x, dropout=model_lib.no_dropout):
        return replica_lib.logits(config, layout, [flat], x, dropout)

    @tf.function
    def train_step(step):
        def replica_step():
            indices = batches.slice_indices(
                order, step % steps_per_epoch, config.batch_size, bounds)
            x = batches.model_input(tf.gather(images, indices))
            y = tf.gather(labels, indices)
            with tf.GradientTape() as tape:
                logits = logits_of(x, replica_lib.global_batch_dropout(
                    config.seed, step, bounds))
                stats = replica_lib.batch_stats(logits, y)
                loss_sum = stats[1]  # sliced while the tape records
            grad = tape.gradient(loss_sum, flat)
            # One collective per step: gradient sums and stats together.
            total = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.concat([grad, stats], 0))
            grad_sum, stats = tf.split(total, [layout.sizes[0],
                                               replica_lib.NUM_STATS])
            rule.apply_flat(rule_state, flat, grad_sum / stats[0],
                            optim.learning_rate(config, step, train_steps))
            return stats
        return strategy.run(replica_step)

    run_steps = common.eager_step_runner(train_step, order, config.seed,
                                   steps_per_epoch)
    evaluate = common.test_set_evaluator(mnist, logits_of) if is_chief else None
    writer = summaries.summary_writer(config.logdir) if is_chief else None
    outcome = progress.drive(run_steps, evaluate, None, config, 0,
                             train_steps, writer)
    if writer:
        writer.close()
    common.write_results(out_path, config, train_steps, outcome, worker=index)


if __name__ == "__main__":
    sys.exit(peer.main(PEER, run_task))
