"""The graph every worker builds: shared state, its replica, the step loop.

Every worker builds the same shared part (parameters, the averaging
protocol and the run's coordination on the ps tasks, found by name) and its
own part on its device: its slice of the data and the training loop, whose
body is the step (trainer/roles/step.py). The chief also builds the ops
that start, stop, evaluate, checkpoint and end the run.
"""

import dataclasses

import tensorflow as tf

from trainer.cluster import devices
from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig
from trainer.learning import batches
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.roles import step as step_lib
from trainer.saving.checkpoints import checkpoint_saver
from trainer.sync import averaging
from trainer.sync import coordination


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
class WorkerHandles:
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
    take_finished: tuple              # (workers int32 [n], steps int64 [n])
    contributions: tf.Tensor          # int64 [N]: admitted gradients
    stop_reason_in: tf.Tensor         # feed string []
    stop_op: tf.Operation             # sends STOP with stop_reason_in
    shutdown_status: tf.Tensor        # feed int32 []: 1 if the run failed
    shutdown_ops: list                # one enqueue per ps: tells it to exit


@dataclasses.dataclass
class WorkerGraph:
    """What a worker's Python side runs; `chief` is None on other workers."""

    graph: tf.Graph
    sync: averaging.Averaging
    coord: coordination.RunCoordination
    flat: params_lib.FlatParams
    trainset: batches.InGraphTrainSet
    start_step: tf.Tensor     # feed int64 []: the first step of a run
    num_steps: tf.Tensor      # feed int64 []: at most this many steps
    loop_outputs: dict        # fetch: steps done, next step, stats sums
    handles: WorkerHandles
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
            shard_devices = [devices.ps_device(i) for i in flat.ps_indices]
            sync = averaging.Averaging(
                cluster.num_workers,
                config.replicas_to_aggregate(cluster.num_workers),
                flat.sizes, shard_devices, wire_dtype=config.wire_dtype,
                ordered_pulls=config.ordered_pulls)
            coord = coordination.RunCoordination(
                shard_devices[0], fingerprint(config, task, train_steps))
            with tf.device(devices.worker_device(k)):
                trainset = batches.InGraphTrainSet(
                    num_train_examples, config.seed, config.batch_size,
                    batches.shard_bounds(config.batch_size,
                                         cluster.num_workers)[k])
                start_step = tf.compat.v1.placeholder(tf.int64, [],
                                                      "start_step")
                num_steps = tf.compat.v1.placeholder(tf.int64, [], "num_steps")
            parts = step_lib.StepParts(config, k, flat, sync, trainset)
            step_body = (step_lib.ChiefStep(parts, train_steps)
                         if task.is_chief else step_lib.WorkerStep(parts))
            loop_outputs = step_lib.training_loop(
                sync, step_body, start_step, num_steps, train_steps,
                task.is_chief)
            chief = (_chief_ops(config, cluster.num_ps, flat, sync, coord,
                                step_body.optimizer, num_test_examples)
                     if task.is_chief else None)
            g = WorkerGraph(graph, sync, coord, flat, trainset, start_step,
                            num_steps, loop_outputs,
                            _worker_handles(sync, coord, k), chief)
        graph.finalize()
    return g


def _worker_handles(sync: averaging.Averaging,
                    coord: coordination.RunCoordination,
                    k: int) -> WorkerHandles:
    with tf.device(sync.shard_devices[0]):
        local_steps_in = tf.compat.v1.placeholder(tf.int64, [], "local_steps")
        return WorkerHandles(
            ready=coord.chief_ready(),
            chief_fingerprint=coord.chief_fingerprint(),
            stop_reason=coord.read_stop_reason(),
            global_step=sync.global_step.read_value(),
            admitted=sync.admitted.read_value(),
            resync_step=sync.resync_step(k),
            local_steps_in=local_steps_in,
            finish_op=coord.report_finished(k, local_steps_in))


def _chief_ops(config: TrainConfig, num_ps: int, flat, sync, coord,
               optimizer, num_test_examples: int) -> ChiefOps:
    init_op = tf.compat.v1.global_variables_initializer()
    with tf.device(sync.shard_devices[0]):
        stop_reason_in = tf.compat.v1.placeholder(tf.string, [],
                                                  "stop_reason")
        stop_op = coord.stop_op(stop_reason_in, sync)
        take_finished = coord.take_reports()
        contributions = sync.contributions.read_value()
    shutdown_status = tf.compat.v1.placeholder_with_default(
        tf.constant(0), [], "shutdown_status")
    saver, checkpoint_shapes = checkpoint_saver(
        flat, averaging.transient_variables(), optimizer,
        config.keep_checkpoints)
    values = [v.read_value() for v in flat.variables]
    eval_outputs, testset_init = replica_lib.evaluation(
        config, flat, values, num_test_examples)
    return ChiefOps(
        init_op=init_op,
        transient_init_op=tf.compat.v1.variables_initializer(
            averaging.transient_variables()),
        start_op=sync.start_op(after=[coord.clear_stop_op()]),
        mark_ready_op=coord.mark_ready_op(),
        saver=saver, checkpoint_shapes=checkpoint_shapes,
        eval_outputs=eval_outputs, testset_init=testset_init,
        param_values=flat.unflatten(values),
        take_finished=take_finished, contributions=contributions,
        stop_reason_in=stop_reason_in,
        stop_op=stop_op, shutdown_status=shutdown_status,
        shutdown_ops=coord.shutdown_ops(num_ps, devices.ps_device,
                                        shutdown_status))
