"""The training graph of one worker: placement, model, loop, eval, saver.

Every worker builds the same shared part (parameters and sync state on the
ps tasks, found by name) and its own part on its device: its slice of the
data, the model, and the training loop. The chief also builds the update,
the evaluation and the checkpoint saver.

The training loop runs inside the graph: one `session.run` executes up to
`num_steps` global steps in a `tf.while_loop`. A distributed session.run
costs far more than a small model's step (a RunGraph RPC to each ps,
a new thread, cleanup RPCs), so the Python loop only comes back between
logging, evaluation and checkpoint boundaries.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from trainer import data as data_lib
from trainer import model as model_lib
from trainer import params as params_lib
from trainer import sync as sync_lib
from trainer.cluster import Task
from trainer.config import TrainConfig

EVAL_CHUNK = 1000  # test images per forward pass; bounds the cnn's memory
_DROPOUT_SEED_SALT = 0x5EED


def ps_device(index: int) -> str:
    return f"/job:ps/task:{index}"


def worker_device(index: int) -> str:
    return f"/job:worker/task:{index}"


def session_config(config: TrainConfig, task: Task) -> tf.compat.v1.ConfigProto:
    """Thread counts and device filters for this task's server and session.

    Thread pools are per process and sized by the server's config, so the
    same proto goes to tf.distribute.Server and tf.compat.v1.Session. Several
    TensorFlow processes share two cores here: spinning idle threads would
    steal the cores the busy ones need.
    """
    proto = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=config.intra_op_threads,
        inter_op_parallelism_threads=config.inter_op_threads,
        allow_soft_placement=False)
    proto.experimental.disable_thread_spinning = True
    if task.job_name == "ps":
        proto.device_filters.append(ps_device(task.task_index))
    else:
        # A worker talks to the ps tasks and itself, never to other workers,
        # so it need not wait for them to start.
        proto.device_filters.extend(["/job:ps", worker_device(task.task_index)])
    return proto


def fingerprint(config: TrainConfig, task: Task, train_steps: int) -> str:
    """What every worker must agree on with the chief."""
    c = task.cluster
    return (f"ps={','.join(c.ps)} workers={','.join(c.workers)} "
            f"model={config.model} hidden_units={config.hidden_units} "
            f"batch_size={config.batch_size} seed={config.seed} "
            f"backup_workers={config.backup_workers} "
            f"train_steps={train_steps}")


def learning_rate(config: TrainConfig, step: tf.Tensor,
                  train_steps: int) -> tf.Tensor:
    """config.learning_rate_at(step) as a graph op (float32 scalar)."""
    if config.lr_schedule == "constant":
        return tf.constant(config.learning_rate)
    progress = tf.minimum(tf.cast(step, tf.float32) / train_steps, 1.0)
    return config.learning_rate * 0.5 * (1.0 + tf.cos(np.pi * progress))


def make_optimizer(config: TrainConfig, rate):
    """The update rule; `rate` is a float or a tensor."""
    if config.optimizer == "sgd":
        return tf.compat.v1.train.GradientDescentOptimizer(rate)
    if config.optimizer == "momentum":
        return tf.compat.v1.train.MomentumOptimizer(rate, config.momentum)
    return tf.compat.v1.train.AdamOptimizer(rate)


def example_uniform(seed: int, step: tf.Tensor, bounds: tuple[int, int],
                    width: int) -> tf.Tensor:
    """Uniform noise for rows [start, end) of global step `step`'s batch.

    Row r of the whole global batch always gets the same numbers, whichever
    worker computes it: the rows are one Philox stream keyed by (seed,
    step), and each worker starts the stream at its first row. So dropout,
    like everything else, does not depend on how the batch is split.

    Returns float32 [end - start, width] in [0, 1).
    """
    start, end = bounds
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(
        seed=tf.stack([tf.constant(seed ^ _DROPOUT_SEED_SALT, tf.int64),
                       tf.cast(step, tf.int64)]))
    first = start * width
    skip = first % 4  # Philox yields four floats per counter increment
    counter = counter + tf.constant([first // 4, 0], tf.uint64)
    noise = tf.raw_ops.StatelessRandomUniformV2(
        shape=[(end - start) * width + skip], key=key, counter=counter,
        alg=1, dtype=tf.float32)  # alg 1: Philox
    return tf.reshape(noise[skip:], [end - start, width])


def global_batch_dropout(seed: int, step: tf.Tensor, bounds: tuple[int, int]):
    """A model_lib.Dropout whose masks depend only on (seed, step, example)."""

    def dropout(x: tf.Tensor, rate: float) -> tf.Tensor:
        noise = example_uniform(seed, step, bounds, int(x.shape[1]))
        return tf.where(noise >= rate, x / (1.0 - rate), tf.zeros_like(x))

    return dropout


@dataclasses.dataclass
class Replica:
    """One worker's gradient computation for one step (tensors on it)."""

    step: tf.Tensor          # int64 [], the global step computed
    shard_grads: list        # float32 [n_s], gradient of the loss sum
    stats: tf.Tensor         # float32 [3]: examples, loss sum, correct


def compute_gradients(config: TrainConfig, flat: params_lib.FlatParams,
                      trainset: data_lib.InGraphTrainSet, step: tf.Tensor,
                      shard_values: list) -> Replica:
    """Forward and backward pass on this worker's slice of step `step`."""
    images, labels = trainset.batch(step)
    dropout = global_batch_dropout(config.seed, step, trainset.bounds)
    with tf.compat.v1.variable_scope(params_lib.SCOPE, reuse=tf.compat.v1.AUTO_REUSE,
                                     custom_getter=flat.getter(shard_values)):
        logits = model_lib.build(config.model, images, dropout, config.seed,
                                 config.hidden_units)
    losses = model_lib.per_example_loss(logits, labels)
    loss_sum = tf.reduce_sum(losses)
    grads = tf.gradients(loss_sum, shard_values)
    grads = [tf.zeros_like(v) if g is None else g
             for g, v in zip(grads, shard_values)]
    stats = tf.stack([tf.cast(tf.size(labels), tf.float32), loss_sum,
                      tf.reduce_sum(model_lib.correct(logits, labels))])
    return Replica(step, grads, stats)


@dataclasses.dataclass
class WorkerGraph:
    """Handles a worker's Python loop needs; chief-only fields are None."""

    graph: tf.Graph
    sync: sync_lib.SyncState
    flat: params_lib.FlatParams
    trainset: data_lib.InGraphTrainSet
    start_step: tf.Tensor     # feed: int64, the first step of a run
    num_steps: tf.Tensor      # feed: int64, at most this many steps
    loop_outputs: dict        # fetch: steps done, next step, stats sums
    resync_step: tf.Tensor | None = None
    ready: tf.Tensor | None = None
    chief_fingerprint: tf.Tensor | None = None
    finish_op: tf.Operation | None = None
    local_steps_in: tf.Tensor | None = None
    finished_count: tf.Tensor | None = None
    # Chief only:
    init_op: tf.Operation | None = None
    transient_init_op: tf.Operation | None = None
    start_op: tf.Operation | None = None
    mark_ready_op: tf.Operation | None = None
    saver: tf.compat.v1.train.Saver | None = None
    checkpoint_shapes: dict | None = None
    eval_outputs: dict | None = None
    testset_init: object | None = None
    take_finished: tuple | None = None
    stop_op: tf.Operation | None = None
    stop_reason_in: tf.Tensor | None = None
    shutdown_ops: list | None = None
    shutdown_status: tf.Tensor | None = None  # feed 1 when the run failed
    global_step: tf.Tensor | None = None
    admitted: tf.Tensor | None = None
    stop_reason: tf.Tensor | None = None


def _ps_strategy(num_ps: int):
    """replica_device_setter strategy: shard variables by their ps index.

    `params/shard_<i>` goes to ps task i (the layout params.plan_shards
    balanced by size); anything else the setter places (optimizer slots are
    colocated with their shard) goes to ps 0.
    """

    def choose(op) -> int:
        name = op.name
        if name.startswith("params/shard_"):
            return int(name.split("_")[1].split("/")[0]) % num_ps
        return 0

    return choose


def build_worker(config: TrainConfig, task: Task, num_train_examples: int,
                 num_test_examples: int, train_steps: int,
                 loop_parallel_iterations: int = 4) -> WorkerGraph:
    """Builds the graph of worker `task.task_index`."""
    cluster = task.cluster
    k = task.task_index
    device = worker_device(k)
    graph = tf.Graph()
    with graph.as_default():
        specs = params_lib.record(lambda: model_lib.build(
            config.model, tf.zeros([1, 28, 28, 1]), seed=config.seed,
            hidden_units=config.hidden_units))
        layout = params_lib.plan_shards(specs, cluster.num_ps)
        setter = tf.compat.v1.train.replica_device_setter(
            ps_tasks=cluster.num_ps, worker_device=device,
            ps_strategy=_ps_strategy(cluster.num_ps))
        with tf.compat.v1.device(setter):
            flat = params_lib.FlatParams(layout)
            sync = sync_lib.SyncState(
                cluster.num_workers,
                config.replicas_to_aggregate(cluster.num_workers),
                flat.sizes, [ps_device(i) for i in flat.ps_indices],
                fingerprint(config, task, train_steps))
            with tf.device(device):
                bounds = data_lib.shard_bounds(config.batch_size,
                                               cluster.num_workers)[k]
                trainset = data_lib.InGraphTrainSet(
                    num_train_examples, config.seed, config.batch_size, bounds)
                start_step = tf.compat.v1.placeholder(tf.int64, [],
                                                      "start_step")
                num_steps = tf.compat.v1.placeholder(tf.int64, [], "num_steps")
            optimizers = [] if task.is_chief else None
            loop_outputs = _training_loop(
                config, k, flat, sync, trainset, optimizers, start_step,
                num_steps, train_steps, loop_parallel_iterations)
            g = WorkerGraph(graph, sync, flat, trainset, start_step,
                            num_steps, loop_outputs)
            _add_coordination(g, k)
            if task.is_chief:
                _add_chief_parts(g, config, cluster.num_ps, optimizers[0],
                                 num_test_examples)
        graph.finalize()
    return g


def _training_loop(config, k, flat, sync, trainset, optimizers, start_step,
                   num_steps, train_steps, parallel_iterations) -> dict:
    """Runs steps start_step, start_step + 1, ... inside one session.run.

    `optimizers` is None on workers other than the chief; on the chief the
    loop appends the optimizer it builds (its rate depends on the step).

    The chief computes its gradient, admits R arrivals, applies the update
    and hands out the next step; other workers compute, push and wait for
    their next token. The loop ends after num_steps steps, at train_steps,
    or when the chief sends STOP.
    """
    with tf.device(sync.shard_devices[0]):
        first_step = tf.identity(start_step)
        max_steps = tf.identity(num_steps)
        zero_stats = tf.zeros([sync_lib.NUM_STATS])

    def keep_going(done, step, stats):
        del stats
        return tf.logical_and(
            done < max_steps,
            tf.logical_and(step >= 0, step < train_steps))

    def one_step(done, step, stats):
        with tf.device(worker_device(k)):
            step_on_worker, shard_values = sync.read_params(step,
                                                           flat.variables)
            replica = compute_gradients(config, flat, trainset,
                                        step_on_worker, shard_values)
            pushed = sync.push(k, replica.step, replica.shard_grads,
                               replica.stats)
        with tf.device(sync.shard_devices[0]):
            if optimizers is not None:
                mean_grads, step_stats = sync.aggregate(step)
                optimizer = make_optimizer(
                    config, learning_rate(config, step, train_steps))
                optimizers.append(optimizer)
                update = optimizer.apply_gradients(
                    list(zip(mean_grads, flat.variables)))
                next_step = sync.finish_step(step, [update, pushed])
                stats = stats + step_stats
            else:
                # Statistics are the chief's business; keeping them off
                # this loop saves a transfer per step.
                with tf.control_dependencies([pushed]):
                    next_step = sync.next_token(k)
            return done + 1, next_step, stats

    # The loop's control nodes (and so its condition) live on ps 0 with the
    # step: per step only the condition, the parameters and the gradients
    # cross between the worker and ps 0.
    with tf.device(sync.shard_devices[0]):
        zero = tf.constant(0, tf.int64)
        done, next_step, stats = tf.while_loop(
            keep_going, one_step, [zero, first_step, zero_stats],
            parallel_iterations=parallel_iterations)
    outputs = {"steps_done": done, "next_step": next_step, "stats": stats}
    if optimizers is not None:
        with tf.device(sync.shard_devices[0]), \
                tf.control_dependencies([done, next_step, stats]):
            outputs["dropped"] = sync.dropped.read_value()
    return outputs


def _add_coordination(g: WorkerGraph, k: int) -> None:
    """Ops for start-up and shut-down that every worker needs."""
    sync = g.sync
    with tf.device(sync.shard_devices[0]):
        g.ready = tf.raw_ops.VarIsInitializedOp(
            resource=sync.cluster_fingerprint.handle)
        g.chief_fingerprint = sync.cluster_fingerprint.read_value()
        g.stop_reason = sync.stop_reason.read_value()
        g.global_step = sync.global_step.read_value()
        g.admitted = sync.admitted.read_value()
        g.resync_step = sync.resync_step(k)
        g.local_steps_in = tf.compat.v1.placeholder(tf.int64, [],
                                                    "local_steps")
        g.finish_op = sync.finished.enqueue((tf.constant(k),
                                             g.local_steps_in))


def _add_chief_parts(g: WorkerGraph, config: TrainConfig, num_ps: int,
                     optimizer, num_test_examples: int) -> None:
    sync, flat = g.sync, g.flat
    g.init_op = tf.compat.v1.global_variables_initializer()
    g.transient_init_op = tf.compat.v1.variables_initializer(
        sync.transient_variables())
    g.start_op = sync.start_op()
    g.mark_ready_op = sync.cluster_fingerprint.initializer
    with tf.device(sync.shard_devices[0]):
        g.stop_reason_in = tf.compat.v1.placeholder(tf.string, [],
                                                    "stop_reason")
        g.stop_op = sync.stop_op(g.stop_reason_in)
        g.take_finished = sync.finished.dequeue()
        g.finished_count = sync.finished.size()
    g.shutdown_status = tf.compat.v1.placeholder_with_default(
        tf.constant(0), [], "shutdown_status")
    g.shutdown_ops = []
    for i in range(num_ps):
        with tf.device(ps_device(i)):
            g.shutdown_ops.append(
                sync_lib.shutdown_queue(i).enqueue(g.shutdown_status))
    slots = {name: (lambda v, name=name: optimizer.get_slot(v, name))
             for name in optimizer.get_slot_names()}
    saveables = flat.saveables(slots)
    # Everything else global: the step, the dropped count and optimizer
    # state that is not per parameter (Adam's beta powers). Compared by
    # name: variables' == builds a graph op.
    covered = {v.op.name for v in flat.variables + sync.transient_variables()}
    covered |= {optimizer.get_slot(v, name).op.name for v in flat.variables
                for name in optimizer.get_slot_names()}
    plain = [v for v in tf.compat.v1.global_variables()
             if v.op.name not in covered]
    g.saver = tf.compat.v1.train.Saver(
        var_list=saveables + plain, max_to_keep=config.keep_checkpoints,
        sharded=False, save_relative_paths=True)
    g.checkpoint_shapes = flat.expected_checkpoint_shapes(
        optimizer.get_slot_names())
    for v in plain:
        g.checkpoint_shapes[v.op.name] = v.shape.as_list()
    g.eval_outputs, g.testset_init = _evaluation(config, flat,
                                                 num_test_examples)


def _evaluation(config: TrainConfig, flat: params_lib.FlatParams,
                num_examples: int):
    """Loss and correct count over the whole test set in one run.

    The parameters are read once; the test set, held in worker-local
    variables, goes through the model in chunks of EVAL_CHUNK images.
    """
    images_in = tf.compat.v1.placeholder(tf.uint8, [num_examples, 28, 28])
    labels_in = tf.compat.v1.placeholder(tf.int32, [num_examples])
    images = data_lib.local_variable("test_images", images_in)
    labels = data_lib.local_variable("test_labels", labels_in)
    values = [v.read_value() for v in flat.variables]
    num_chunks = -(-num_examples // EVAL_CHUNK)

    def chunk(i, loss_sum, correct_sum):
        start = i * EVAL_CHUNK
        size = tf.minimum(EVAL_CHUNK, num_examples - start)
        x = tf.cast(tf.slice(images.read_value(), [start, 0, 0],
                             [size, 28, 28]), tf.float32) / 255.0
        y = tf.slice(labels.read_value(), [start], [size])
        with tf.compat.v1.variable_scope(params_lib.SCOPE,
                                         reuse=tf.compat.v1.AUTO_REUSE,
                                         custom_getter=flat.getter(values)):
            logits = model_lib.build(config.model, tf.reshape(x, [-1, 28, 28, 1]),
                                     seed=config.seed,
                                     hidden_units=config.hidden_units)
        return (i + 1,
                loss_sum + tf.reduce_sum(model_lib.per_example_loss(logits, y)),
                correct_sum + tf.reduce_sum(model_lib.correct(logits, y)))

    _, loss_sum, correct_sum = tf.while_loop(
        lambda i, *_: i < num_chunks, chunk,
        [tf.constant(0), tf.constant(0.0), tf.constant(0.0)])
    outputs = {"loss": loss_sum / num_examples,
               "accuracy": correct_sum / num_examples}

    def initialize(session, test_images, test_labels):
        session.run([images.initializer, labels.initializer],
                    {images_in: test_images,
                     labels_in: test_labels.astype("int32")})

    return outputs, initialize


@dataclasses.dataclass
class SingleProcessGraph:
    """The same model, data and update in one process with no servers."""

    graph: tf.Graph
    trainset: data_lib.InGraphTrainSet
    init_op: tf.Operation
    start_step: tf.Tensor
    num_steps: tf.Tensor
    loop_outputs: dict
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
        specs = params_lib.record(lambda: model_lib.build(
            config.model, tf.zeros([1, 28, 28, 1]), seed=config.seed,
            hidden_units=config.hidden_units))
        flat = params_lib.FlatParams(params_lib.plan_shards(specs, 1))
        trainset = data_lib.InGraphTrainSet(
            num_train_examples, config.seed, config.batch_size,
            (0, config.batch_size))
        start_step = tf.compat.v1.placeholder(tf.int64, [], "start_step")
        num_steps = tf.compat.v1.placeholder(tf.int64, [], "num_steps")

        def one_step(done, step, stats):
            values = [v.read_value() for v in flat.variables]
            replica = compute_gradients(config, flat, trainset, step, values)
            mean = [g / replica.stats[0] for g in replica.shard_grads]
            optimizer = make_optimizer(
                config, learning_rate(config, step, train_steps))
            update = optimizer.apply_gradients(
                list(zip(mean, flat.variables)))
            with tf.control_dependencies([update]):
                return done + 1, step + 1, stats + replica.stats

        done, next_step, stats = tf.while_loop(
            lambda done, *_: done < num_steps, one_step,
            [tf.constant(0, tf.int64), start_step,
             tf.zeros([sync_lib.NUM_STATS])], parallel_iterations=4)
        eval_outputs, testset_init = _evaluation(config, flat,
                                                 num_test_examples)
        init_op = tf.compat.v1.global_variables_initializer()
        graph.finalize()
    return SingleProcessGraph(
        graph, trainset, init_op, start_step, num_steps,
        {"steps_done": done, "next_step": next_step, "stats": stats},
        eval_outputs, testset_init)
