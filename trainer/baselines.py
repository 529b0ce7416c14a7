"""The benchmark's two baselines, each run in processes of its own.

single: the ps trainer's model, batches, loss, update rule and in-graph step
  loop (graph.build_single_process) in one process, with no cluster and no
  servers: the ceiling a cluster on one machine is held against.
mwms: TensorFlow's MultiWorkerMirroredStrategy, what a user would pick
  instead of a parameter server: N worker processes on loopback, a custom
  training loop (no Keras) that all-reduces each step's gradient sums with
  collective ops (ring). Same initial parameters, batches, dropout masks
  and update kernels as the ps trainer, so the accuracies compare.

The benchmark starts them as
    python -m trainer.baselines single CONFIG.json OUT.json
    python -m trainer.baselines mwms CONFIG.json OUT.json INDEX HOST:PORT,...
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

from trainer import data as data_lib  # noqa: E402
from trainer import graph as graph_lib  # noqa: E402
from trainer import model as model_lib  # noqa: E402
from trainer import params as params_lib  # noqa: E402
from trainer import progress  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.train import make_callable, peak_rss_mb  # noqa: E402


def _load(config: TrainConfig, need_test: bool):
    mnist = data_lib.load(data_lib.resolve_data_dir(config.data_dir),
                          config.download,
                          data_lib.mirror_list(config.data_url),
                          need_test=need_test)
    return mnist, config.resolved_train_steps(len(mnist.train_labels))


def _write(path: str, config: TrainConfig, train_steps: int,
           outcome: progress.Outcome, **extra) -> None:
    results = {
        "train_steps": train_steps,
        **outcome.summary(config.batch_size),
        "eval_history": outcome.history,
        "peak_rss_mb": peak_rss_mb(),
        "flags": dataclasses.asdict(config),
        **extra,
    }
    if outcome.history:
        results["final_test_accuracy"] = outcome.history[-1]["accuracy"]
        results["final_test_loss"] = outcome.history[-1]["loss"]
    pathlib.Path(path).write_text(json.dumps(results, indent=2) + "\n")


def run_single_process(config: TrainConfig, out_path: str) -> None:
    """The same training as the ps cluster's, in one process."""
    mnist, train_steps = _load(config, need_test=True)
    g = graph_lib.build_single_process(config, len(mnist.train_labels),
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


class _UpdateRule:
    """The TF1 optimizers' update kernels on a local flat variable.

    ResourceApplyGradientDescent / Momentum / Adam are what
    tf.compat.v1.train's optimizers run, so both trainers update alike.
    """

    def __init__(self, config: TrainConfig, size: int):
        self.config = config
        zeros = lambda: tf.Variable(tf.zeros([size]))  # noqa: E731
        if config.optimizer == "momentum":
            self.accum = zeros()
        if config.optimizer == "adam":
            self.m, self.v = zeros(), zeros()
            self.beta1_power = tf.Variable(0.9)
            self.beta2_power = tf.Variable(0.999)

    def apply(self, var: tf.Variable, grad: tf.Tensor, rate: tf.Tensor):
        if self.config.optimizer == "sgd":
            tf.raw_ops.ResourceApplyGradientDescent(
                var=var.handle, alpha=rate, delta=grad)
        elif self.config.optimizer == "momentum":
            tf.raw_ops.ResourceApplyMomentum(
                var=var.handle, accum=self.accum.handle, lr=rate, grad=grad,
                momentum=self.config.momentum)
        else:
            tf.raw_ops.ResourceApplyAdam(
                var=var.handle, m=self.m.handle, v=self.v.handle,
                beta1_power=self.beta1_power, beta2_power=self.beta2_power,
                lr=rate, beta1=0.9, beta2=0.999, epsilon=1e-8, grad=grad)
            self.beta1_power.assign(self.beta1_power * 0.9)
            self.beta2_power.assign(self.beta2_power * 0.999)


def _initial_parameters(layout: params_lib.FlatLayout) -> np.ndarray:
    """The flat initial vector, computed as the ps trainer computes it."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        return session.run(layout.initial_value(0))


def run_mwms_worker(config: TrainConfig, out_path: str, index: int,
                    hosts: list[str]) -> None:
    """One worker of a MultiWorkerMirroredStrategy run on loopback."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": hosts},
        "task": {"type": "worker", "index": index}})
    tf.config.threading.set_intra_op_parallelism_threads(
        config.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(
        config.inter_op_threads)
    ring = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=ring))
    is_chief = index == 0
    mnist, train_steps = _load(config, need_test=is_chief)
    bounds = data_lib.shard_bounds(config.batch_size, len(hosts))[index]
    steps_per_epoch = data_lib.steps_per_epoch(len(mnist.train_labels),
                                               config.batch_size)
    specs = params_lib.record(lambda: model_lib.build(
        config.model, tf.zeros([1, 28, 28, 1]), seed=config.seed,
        hidden_units=config.hidden_units))
    layout = params_lib.FlatLayout(params_lib.plan_shards(specs, 1))
    # A plain (not mirrored) variable per worker: every worker applies the
    # same all-reduced gradient, so the copies stay equal.
    flat = tf.Variable(_initial_parameters(layout))
    rule = _UpdateRule(config, layout.sizes[0])
    images = tf.constant(mnist.train_images)
    labels = tf.constant(mnist.train_labels.astype(np.int32))
    order = tf.Variable(tf.zeros([len(mnist.train_labels)], tf.int32))
    num_examples = len(mnist.train_labels)

    def logits_of(x, dropout):
        with tf.compat.v1.variable_scope(params_lib.SCOPE,
                                         custom_getter=layout.getter([flat])):
            return model_lib.build(config.model, x, dropout, config.seed,
                                   config.hidden_units)

    @tf.function
    def train_step(step):
        def replica_step():
            first = (step % steps_per_epoch) * config.batch_size + bounds[0]
            indices = order[first:first + bounds[1] - bounds[0]]
            x = tf.cast(tf.gather(images, indices), tf.float32) / 255.0
            y = tf.gather(labels, indices)
            with tf.GradientTape() as tape:
                logits = logits_of(
                    tf.reshape(x, [-1, 28, 28, 1]),
                    graph_lib.global_batch_dropout(config.seed, step, bounds))
                loss_sum = tf.reduce_sum(model_lib.per_example_loss(logits, y))
            grad = tape.gradient(loss_sum, flat)
            stats = tf.stack([tf.cast(tf.size(y), tf.float32), loss_sum,
                              tf.reduce_sum(model_lib.correct(logits, y))])
            # One collective per step: gradient sums and stats together.
            total = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.concat([grad, stats], 0))
            grad_sum, stats = tf.split(total, [layout.sizes[0], 3])
            rule.apply(flat, grad_sum / stats[0], graph_lib.learning_rate(
                config, step, train_steps))
            return stats
        return strategy.run(replica_step)

    epoch_loaded = [-1]

    def run_steps(start: int, count: int) -> dict:
        stats = tf.zeros([3])
        for step in range(start, start + count):
            epoch = step // steps_per_epoch
            if epoch != epoch_loaded[0]:
                order.assign(tf.random.experimental.stateless_shuffle(
                    tf.range(num_examples, dtype=tf.int32),
                    seed=tf.constant([config.seed, epoch], tf.int64)))
                epoch_loaded[0] = epoch
            stats += train_step(tf.constant(step, tf.int64))
        return {"stats": stats.numpy()}

    evaluate = _test_set_evaluator(mnist, logits_of) if is_chief else None
    writer = progress.summary_writer(config.logdir) if is_chief else None
    outcome = progress.drive(run_steps, evaluate, None, config, 0,
                             train_steps, writer)
    if writer:
        writer.close()
    _write(out_path, config, train_steps, outcome, worker=index)


def _test_set_evaluator(mnist: data_lib.Mnist, logits_of):
    """() -> {"loss", "accuracy"} over the test set, in chunks."""
    test_images = tf.constant(mnist.test_images)
    test_labels = tf.constant(mnist.test_labels.astype(np.int32))
    count = len(mnist.test_labels)

    @tf.function
    def chunk(start, size):
        x = tf.cast(tf.slice(test_images, [start, 0, 0], [size, 28, 28]),
                    tf.float32) / 255.0
        y = tf.slice(test_labels, [start], [size])
        logits = logits_of(tf.reshape(x, [-1, 28, 28, 1]),
                           model_lib.no_dropout)
        return (tf.reduce_sum(model_lib.per_example_loss(logits, y)),
                tf.reduce_sum(model_lib.correct(logits, y)))

    def evaluate():
        sums = np.zeros(2)
        for start in range(0, count, graph_lib.EVAL_CHUNK):
            size = min(graph_lib.EVAL_CHUNK, count - start)
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
