"""The benchmark's two baselines, each run in processes of its own.

single: the ps trainer's model, batches, loss, update rule and in-graph step
  loop (build_single_process) in one process, with no cluster and no
  servers: the ceiling a cluster on one machine is held against.
mwms: TensorFlow's MultiWorkerMirroredStrategy, what a user would pick
  instead of a parameter server: N worker processes on loopback, a custom
  training loop (no Keras) that all-reduces each step's gradient sums with
  collective ops (ring). Same initial parameters, batches, dropout masks
  and update kernels as the ps trainer, so the accuracies compare.

The benchmark starts them as
    python -m trainer.bench.baselines single CONFIG.json OUT.json
    python -m trainer.bench.baselines mwms CONFIG.json OUT.json INDEX HOST:PORT,...
where CONFIG.json holds a TrainConfig's fields; OUT.json gets the results.
"""

import dataclasses
import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import logging  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainer.learning import batches# noqa: E402
from trainer.learning import data as data_lib# noqa: E402
from trainer.learning import model as model_lib# noqa: E402
from trainer.learning import optim# noqa: E402
from trainer.learning import params as params_lib# noqa: E402
from trainer.observe import progress# noqa: E402
from trainer.learning import replica as replica_lib# noqa: E402
from trainer.common.config import TrainConfig  # noqa: E402
from trainer.common.tf_session import make_callable  # noqa: E402


def _load(config: TrainConfig, need_test: bool):
    mnist = data_lib.load(data_lib.resolve_data_dir(config.data_dir),
                          config.download,
                          data_lib.mirror_list(config.data_url),
                          need_test=need_test)
    return mnist, config.resolved_train_steps(len(mnist.train_labels))


def _write(path: str, config: TrainConfig, train_steps: int,
           outcome: progress.Outcome, **extra) -> None:
    progress.write_json(pathlib.Path(path), {
        **progress.results_fields(outcome, config, train_steps), **extra})


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
            replica = replica_lib.compute_gradients(config, flat, trainset,
                                                    step, values)
            mean = [g / replica.stats[0] for g in replica.shard_grads]
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
    mnist, train_steps = _load(config, need_test=True)
    g = build_single_process(config, len(mnist.train_labels),
                                       len(mnist.test_labels), train_steps)
    session = tf.compat.v1.Session(graph=g.graph, config=tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=config.intra_op_threads,
        inter_op_parallelism_threads=config.inter_op_threads))
    g.trainset.initialize(session, mnist.train_images, mnist.train_labels)
    g.testset_init(session, mnist.test_images, mnist.test_labels)
    session.run(g.init_op)
    loop = make_callable(session, g.loop_outputs, [g.start_step, g.num_steps])
    writer = progress.summary_writer(config.logdir, g.graph)
    outcome = progress.drive(loop, make_callable(session, g.eval_outputs),
                             None, config, 0, train_steps, writer)
    writer.close()
    _write(out_path, config, train_steps, outcome)


def _initial_parameters(layout: params_lib.FlatLayout) -> np.ndarray:
    """The flat initial vector, computed as the ps trainer computes it."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        return session.run(layout.initial_value(0))


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
    mnist, train_steps = _load(config, need_test=is_chief)
    bounds = batches.shard_bounds(config.batch_size, len(hosts))[index]
    steps_per_epoch = batches.steps_per_epoch(len(mnist.train_labels),
                                              config.batch_size)
    layout = params_lib.FlatLayout(params_lib.plan_shards(
        replica_lib.model_specs(config), 1))
    # A plain (not mirrored) variable per worker: every worker applies the
    # same all-reduced gradient, so the copies stay equal.
    flat = tf.Variable(_initial_parameters(layout))
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

    run_steps = _eager_step_runner(train_step, order, config.seed,
                                   steps_per_epoch)
    evaluate = _test_set_evaluator(mnist, logits_of) if is_chief else None
    writer = progress.summary_writer(config.logdir) if is_chief else None
    outcome = progress.drive(run_steps, evaluate, None, config, 0,
                             train_steps, writer)
    if writer:
        writer.close()
    _write(out_path, config, train_steps, outcome, worker=index)


def _eager_step_runner(train_step, order: tf.Variable, seed: int,
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


def _test_set_evaluator(mnist: data_lib.Mnist, logits_of):
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


def main(argv: list[str]) -> int:
    kind, config_path, out_path = argv[1:4]
    config = TrainConfig(**json.loads(pathlib.Path(config_path).read_text()))
    logging.set_verbosity(logging.INFO)
    logging.use_absl_handler()
    if kind == "single":
        run_single_process(config, out_path)
    elif kind == "mwms":
        run_mwms_worker(config, out_path, int(argv[4]), argv[5].split(","))
    else:
        raise SystemExit(f"unknown baseline {kind!r}; use single or mwms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
