"""The graph every worker builds: shared state, its replica, the step loop.

Every worker builds the same shared part (parameters and sync state on the
ps tasks, found by name) and its own part on its device: its slice of the
data, the replica's computation (trainer/learning/replica.py) and the training
loop. The chief also builds the update, the evaluation, the checkpoint
saver and the ops that start and stop the run.

The training loop runs inside the graph: one `session.run` executes up to
`num_steps` global steps in a `tf.while_loop`. A distributed session.run
costs far more than a small model's step (a RunGraph RPC to each ps,
a new thread, cleanup RPCs), so the Python loop only comes back between
logging, evaluation and checkpoint boundaries.
"""

import dataclasses

import tensorflow as tf

from trainer.learning import batches
from trainer.cluster import devices
from trainer.learning import optim
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.sync import averaging as sync_lib
from trainer.saving.checkpoints import checkpoint_saver
from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig

LOOP_PARALLEL_ITERATIONS = 4


def fingerprint(config: TrainConfig, task: Task, train_steps: int) -> str:
    """What every worker must agree on with the chief."""
    c = task.cluster
    return (f"ps={','.join(c.ps)} workers={','.join(c.workers)} "
            f"model={config.model} hidden_units={config.hidden_units} "
            f"batch_size={config.batch_size} seed={config.seed} "
            f"backup_workers={config.backup_workers} "
            f"wire_dtype={config.wire_dtype} "
            f"ordered_pulls={config.ordered_pulls} train_steps={train_steps}")


@dataclasses.dataclass
class Coordination:
    """Start-up and shut-down handles every worker has (on ps 0)."""

    ready: tf.Tensor              # bool []: the chief has initialized
    chief_fingerprint: tf.Tensor  # string []
    stop_reason: tf.Tensor        # string []: why the chief stopped
    global_step: tf.Tensor        # int64 []
    admitted: tf.Tensor           # float32 [N]: 1 where admitted this step
    resync_step: tf.Tensor        # int64 []: where this worker starts
    local_steps_in: tf.Tensor     # feed int64 []: gradients this worker pushed
    finish_op: tf.Operation       # reports local_steps_in to the chief


@dataclasses.dataclass
class ChiefOps:
    """What only the chief runs: set-up, evaluation, checkpoints, the end."""

    init_op: tf.Operation
    transient_init_op: tf.Operation   # sync state a restore does not cover
    start_op: tf.Operation            # first tokens to every worker
    mark_ready_op: tf.Operation       # tells the workers to go
    saver: tf.compat.v1.train.Saver
    checkpoint_shapes: dict           # checkpoint key -> shape
    eval_outputs: dict                # {"loss", "accuracy"}: float32 []
    testset_init: object              # (session, images, labels) -> None
    param_values: dict                # parameter name -> float32 tensor
    take_finished: tuple              # dequeue (worker int32, steps int64)
    contributions: tf.Tensor          # int64 [N]: admitted gradients
    stop_reason_in: tf.Tensor         # feed string []
    stop_op: tf.Operation             # sends STOP with stop_reason_in
    shutdown_status: tf.Tensor        # feed int32 []: 1 if the run failed
    shutdown_ops: list                # one enqueue per ps: tells it to exit


@dataclasses.dataclass
class WorkerGraph:
    """What a worker's Python side runs; `chief` is None on other workers."""

    graph: tf.Graph
    sync: sync_lib.SyncState
    flat: params_lib.FlatParams
    trainset: batches.InGraphTrainSet
    start_step: tf.Tensor     # feed int64 []: the first step of a run
    num_steps: tf.Tensor      # feed int64 []: at most this many steps
    loop_outputs: dict        # fetch: steps done, next step, stats sums
    coord: Coordination
    chief: ChiefOps | None


def build_worker(config: TrainConfig, task: Task, num_train_examples: int,
                 num_test_examples: int, train_steps: int) -> WorkerGraph:
    """Builds the graph of worker `task.task_index`."""
    cluster, k = task.cluster, task.task_index
    graph = tf.Graph()
    with graph.as_default():
        layout = params_lib.plan_shards(replica_lib.model_specs(config),
                                        cluster.num_ps)
        with tf.compat.v1.device(devices.variable_placement(cluster.num_ps,
                                                            k)):
            flat = params_lib.FlatParams(layout)
            sync = sync_lib.SyncState(
                cluster.num_workers,
                config.replicas_to_aggregate(cluster.num_workers),
                flat.sizes, [devices.ps_device(i) for i in flat.ps_indices],
                fingerprint(config, task, train_steps),
                wire_dtype=config.wire_dtype,
                ordered_pulls=config.ordered_pulls)
            with tf.device(devices.worker_device(k)):
                trainset = batches.InGraphTrainSet(
                    num_train_examples, config.seed, config.batch_size,
                    batches.shard_bounds(config.batch_size,
                                         cluster.num_workers)[k])
                start_step = tf.compat.v1.placeholder(tf.int64, [],
                                                      "start_step")
                num_steps = tf.compat.v1.placeholder(tf.int64, [], "num_steps")
            update = (_ChiefUpdate(config, flat, sync, train_steps)
                      if task.is_chief else None)
            step_body = _StepBody(config, k, flat, sync, trainset, update)
            loop_outputs = _training_loop(sync, step_body, start_step,
                                          num_steps, train_steps)
            chief = (_chief_ops(config, cluster.num_ps, flat, sync,
                                update.optimizer, num_test_examples)
                     if update else None)
            g = WorkerGraph(graph, sync, flat, trainset, start_step,
                            num_steps, loop_outputs, _coordination(sync, k),
                            chief)
        graph.finalize()
    return g


class _ChiefUpdate:
    """The chief's half of a step: admit R gradients, apply their mean.

    Built inside the loop body, since the learning rate depends on the
    step; keeps the optimizer it made, whose slots the saver needs.
    """

    def __init__(self, config, flat, sync, train_steps: int):
        self.config, self.flat, self.sync = config, flat, sync
        self.train_steps = train_steps
        self.optimizer = None

    def __call__(self, step: tf.Tensor, pushed: tf.Tensor):
        """Returns (next step int64 [], step statistics float32 [3])."""
        mean_grads, step_stats = self.sync.aggregate(step)
        self.optimizer = optim.make_optimizer(
            self.config, optim.learning_rate(self.config, step,
                                             self.train_steps))
        update = self.optimizer.apply_gradients(
            list(zip(mean_grads, self.flat.variables)))
        return self.sync.finish_step(step, [update, pushed]), step_stats


class _StepBody:
    """One global step of worker k, as the body of the in-graph loop."""

    def __init__(self, config, k, flat, sync, trainset, chief_update):
        self.config, self.k, self.flat, self.sync = config, k, flat, sync
        self.trainset, self.chief_update = trainset, chief_update

    def __call__(self, done, step, stats):
        sync = self.sync
        with tf.device(devices.worker_device(self.k)):
            step_on_worker, shard_values = sync.read_params(
                step, self.flat.variables, sync.pull_turns.wait(self.k, step))
            replica = replica_lib.compute_gradients(
                self.config, self.flat, self.trainset, step_on_worker,
                shard_values)
            pushed = tf.group(
                [sync.push(self.k, replica.step, replica.shard_grads,
                           replica.stats),
                 *sync.pull_turns.pass_on(self.k, step, shard_values)])
        with tf.device(sync.shard_devices[0]):
            if self.chief_update is not None:
                next_step, step_stats = self.chief_update(step, pushed)
                stats = stats + step_stats
            else:
                # Statistics are the chief's business; keeping them off
                # this loop saves a transfer per step.
                with tf.control_dependencies([pushed]):
                    next_step = sync.next_token(self.k)
            return done + 1, next_step, stats


def _training_loop(sync, step_body: _StepBody, start_step, num_steps,
                   train_steps: int) -> dict:
    """Runs steps start_step, start_step + 1, ... inside one session.run.

    The loop ends after num_steps steps, at train_steps, or when the chief
    sends STOP (a negative step).
    """
    # The loop's control nodes (and so its condition) live on ps 0 with the
    # step: per step only the condition, the parameters and the gradients
    # cross between the worker and ps 0.
    with tf.device(sync.shard_devices[0]):
        max_steps = tf.identity(num_steps)

        def keep_going(done, step, stats):
            del stats
            return tf.logical_and(
                done < max_steps,
                tf.logical_and(step >= 0, step < train_steps))

        done, next_step, stats = tf.while_loop(
            keep_going, step_body,
            [tf.constant(0, tf.int64), tf.identity(start_step),
             tf.zeros([replica_lib.NUM_STATS])],
            parallel_iterations=LOOP_PARALLEL_ITERATIONS)
    outputs = {"steps_done": done, "next_step": next_step, "stats": stats}
    if step_body.chief_update is not None:
        with tf.device(sync.shard_devices[0]), \
                tf.control_dependencies([done, next_step, stats]):
            outputs["dropped"] = sync.dropped.read_value()
    return outputs


def _coordination(sync: sync_lib.SyncState, k: int) -> Coordination:
    with tf.device(sync.shard_devices[0]):
        local_steps_in = tf.compat.v1.placeholder(tf.int64, [], "local_steps")
        return Coordination(
            ready=tf.raw_ops.VarIsInitializedOp(
                resource=sync.cluster_fingerprint.handle),
            chief_fingerprint=sync.cluster_fingerprint.read_value(),
            stop_reason=sync.stop_reason.read_value(),
            global_step=sync.global_step.read_value(),
            admitted=sync.admitted.read_value(),
            resync_step=sync.resync_step(k),
            local_steps_in=local_steps_in,
            finish_op=sync.finished.enqueue((tf.constant(k), local_steps_in)))


def _chief_ops(config: TrainConfig, num_ps: int, flat, sync, optimizer,
               num_test_examples: int) -> ChiefOps:
    init_op = tf.compat.v1.global_variables_initializer()
    with tf.device(sync.shard_devices[0]):
        stop_reason_in = tf.compat.v1.placeholder(tf.string, [],
                                                  "stop_reason")
        stop_op = sync.stop_op(stop_reason_in)
        take_finished = sync.finished.dequeue()
        contributions = sync.contributions.read_value()
    shutdown_status = tf.compat.v1.placeholder_with_default(
        tf.constant(0), [], "shutdown_status")
    shutdown_ops = []
    for i in range(num_ps):
        with tf.device(devices.ps_device(i)):
            shutdown_ops.append(
                sync_lib.shutdown_queue(i).enqueue(shutdown_status))
    saver, checkpoint_shapes = checkpoint_saver(
        flat, sync.transient_variables(), optimizer, config.keep_checkpoints)
    values = [v.read_value() for v in flat.variables]
    eval_outputs, testset_init = replica_lib.evaluation(
        config, flat, values, num_test_examples)
    return ChiefOps(
        init_op=init_op,
        transient_init_op=tf.compat.v1.variables_initializer(
            sync.transient_variables()),
        start_op=sync.start_op(),
        mark_ready_op=sync.cluster_fingerprint.initializer,
        saver=saver, checkpoint_shapes=checkpoint_shapes,
        eval_outputs=eval_outputs, testset_init=testset_init,
        param_values=flat.unflatten(values),
        take_finished=take_finished, contributions=contributions,
        stop_reason_in=stop_reason_in,
        stop_op=stop_op, shutdown_status=shutdown_status,
        shutdown_ops=shutdown_ops)
