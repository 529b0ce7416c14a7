"""single: the trainer's model, batches, loss, update rule and in-graph
step loop in one process, with no cluster and no servers: the ceiling a
cluster on one machine is held against.

    python -m trainer.bench.baselines.single CONFIG.json OUT.json

(the benchmark's line, trainer/bench/runs.py; not a user interface).
"""

import dataclasses
import sys

import tensorflow as tf

from trainer.bench.baselines import common
from trainer.bench.baselines import peer
from trainer.common.config import TrainConfig
from trainer.common.tf_session import make_callable
from trainer.learning import batches
from trainer.learning import fixed_point
from trainer.learning import optim
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.observe import progress
from trainer.observe import summaries


@dataclasses.dataclass
class SingleProcessGraph:
    """The same model, data and update in one process with no servers."""

    graph: tf.Graph
    trainset: batches.InGraphTrainSet
    init_op: tf.Operation
    start_step: tf.Tensor     # feed int64 []
    num_steps: tf.Tensor      # feed int64 []
    loop_outputs: dict        # steps_done, next_step, stats sums
    eval_outputs: dict
    testset_init: object


def build_single_process(config: TrainConfig, num_train_examples: int,
                         num_test_examples: int,
                         train_steps: int) -> SingleProcessGraph:
    """The baseline a cluster is measured against: no ps, no sync protocol.

    Same parameters layout (one flat variable), same in-graph batches,
    model, loss and optimizer, and the same in-graph loop; each step applies
    the mean gradient of the whole global batch directly.
    """
    graph = tf.Graph()
    with graph.as_default():
        flat = params_lib.FlatParams(params_lib.plan_shards(
            replica_lib.model_specs(config), 1))
        trainset = batches.InGraphTrainSet(
            num_train_examples, config.seed, config.batch_size,
            (0, config.batch_size))
        start_step = tf.compat.v1.placeholder(tf.int64, [], "start_step")
        num_steps = tf.compat.v1.placeholder(tf.int64, [], "num_steps")

        def one_step(done, step, stats):
            values = [v.read_value() for v in flat.variables]
            replica = replica_lib.compute_gradients(
                config, flat, trainset, step, trainset.bounds, values)
            fixed = replica_lib.fixed_point_of(config)
            mean = [fixed_point.mean(g, replica.stats[0], fixed)
                    for g in replica.shard_grads]
            optimizer = optim.make_optimizer(
                config, optim.learning_rate(config, step, train_steps))
            update = optimizer.apply_gradients(
                list(zip(mean, flat.variables)))
            with tf.control_dependencies([update]):
                return done + 1, step + 1, stats + replica.stats

        done, next_step, stats = tf.while_loop(
            lambda done, *_: done < num_steps, one_step,
            [tf.constant(0, tf.int64), start_step,
             tf.zeros([replica_lib.NUM_STATS])], parallel_iterations=4)
        eval_outputs, testset_init = replica_lib.evaluation(
            config, flat, [v.read_value() for v in flat.variables],
            num_test_examples)
        init_op = tf.compat.v1.global_variables_initializer()
        graph.finalize()
    return SingleProcessGraph(
        graph, trainset, init_op, start_step, num_steps,
        {"steps_done": done, "next_step": next_step, "stats": stats},
        eval_outputs, testset_init)


def run_single_process(config: TrainConfig, out_path: str) -> None:
    """The same training as the ps cluster's, in one process."""
    mnist, train_steps = common.load(config, need_test=True)
    g = build_single_process(config, len(mnist.train_labels),
                                       len(mnist.test_labels), train_steps)
    intra, inter = config.op_threads()
    session = tf.compat.v1.Session(graph=g.graph, config=tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=intra,
        inter_op_parallelism_threads=inter))
    g.trainset.initialize(session, mnist.train_images, mnist.train_labels)
    g.testset_init(session, mnist.test_images, mnist.test_labels)
    session.run(g.init_op)
    loop = make_callable(session, g.loop_outputs, [g.start_step, g.num_steps])
    writer = summaries.summary_writer(config.logdir, g.graph)
    outcome = progress.drive(loop, make_callable(session, g.eval_outputs),
                             None, config, 0, train_steps, writer)
    writer.close()
    common.write_results(out_path, config, train_steps, outcome)


def main(argv: list[str]) -> int:
    config_path, out_path = argv[1:3]
    run_single_process(peer.start_process(config_path), out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
