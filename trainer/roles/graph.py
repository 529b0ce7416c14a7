"""The graph every worker builds: the shared part on the ps tasks, found by
name, and on its own device its data and training loop (step.py); the
chief's also starts, stops, evaluates, checkpoints and ends the run."""

import dataclasses
import functools

import tensorflow as tf

from trainer.cluster import devices
from trainer.cluster.spec import Task
from trainer.common.config import WORKERS, TrainConfig, shared_settings
from trainer.learning import (batches, optim, params as params_lib,
                              replica as replica_lib)
from trainer.roles import step as step_lib, takeover
from trainer.saving.checkpoints import checkpoint_saver
from trainer.sync import (averaging, coordination, mirrors as mirrors_lib,
                          pull_turns as pull_turns_lib, state as state_lib,
                          transport as transport_lib)


def fingerprint(config: TrainConfig, task: Task, train_steps: int) -> str:
    """Words name=value every worker must agree on with the chief (so it
    can name the first that differs): the cluster, the WORKERS settings."""
    c = task.cluster
    words = [f"ps={','.join(c.ps)}", f"workers={','.join(c.workers)}"]
    words += [f"{name}={value}" for name, value in
              shared_settings(config, WORKERS, train_steps).items()]
    return " ".join(words)


@dataclasses.dataclass
class WorkerHandles:
    """Start-up and shut-down handles every worker has (on ps 0)."""
    ready: tf.Tensor              # bool []: the chief has initialized
    chief_fingerprint: tf.Tensor  # string []
    stop_reason: tf.Tensor        # string []: why the chief stopped
    global_step: tf.Tensor        # int64 []
    round: tf.Tensor              # int64 []: the chief's current round
    planned: tf.Tensor            # bool [N]: who is in this round
    admitted: tf.Tensor           # bool [N]: who pushed for this round
    join_op: tf.Operation         # drops old tokens, asks the chief in
    leave_op: tf.Operation        # tells the chief we leave (SIGTERM)
    tokens_waiting: tf.Tensor     # int32 []: tokens in our queue
    roster: tf.Tensor             # bool [N]: who is in
    next_token: tf.Tensor         # int64 [4]: waits for one
    pushed_in: tf.Tensor          # feed int64 []: gradients we pushed
    finish_op: tf.Operation       # reports pushed_in to the chief


@dataclasses.dataclass
class ChiefOps:
    """What only the chief runs: set-up, evaluation, checkpoints, the end."""
    init_op: tf.Operation
    uninitialized: tf.Tensor          # string [n]: global variables not set
    transient_init_op: tf.Operation   # sync state a restore does not cover
    transient_inits: dict             # name -> its initializer, each
    start_op: tf.Operation            # REJOIN to every worker
    mark_ready_op: tf.Operation       # tells the workers to go
    absorb_op: tf.Tensor              # queued joins in; roster bool [N]
    membership: list                  # records so far (state.take_membership)
    roster: tf.Tensor                 # bool [N]: who is in
    slices: tf.Tensor                 # int64 [N, 2]: this round's [first, end)
    last_push: tf.Tensor              # int64 [N]: round of each's last push
    issued_round: tf.Tensor           # int64 [N]: round of each's last token
    lost_in: tf.Tensor                # feed int32 []: a worker lost
    lost_op: tf.Tensor                # bool []: reported lost_in to the rule
    deadlines: tuple | None           # take_deadlines; None: no deadlines
    late_in: tuple                    # feed int64 [] x 2: step, round
    late_op: tf.Operation             # LATE for late_in
    halt_op: tf.Tensor                # int64 []: halts the loop (coordination)
    end_op: tf.Operation              # the final step to every worker
    generation: tf.Tensor             # feed int64 []: this chief's
    saver: tf.compat.v1.train.Saver
    checkpoint_shapes: dict           # checkpoint key -> shape
    eval_outputs: dict                # {"loss", "accuracy"}: float32 []
    testset_init: object              # (session, images, labels) -> None
    param_values: dict                # parameter name -> float32 tensor
    take_finished: tuple              # (workers int32 [n], steps int64 [n])
    contributions: tf.Tensor          # int64 [N, 2]: steps, examples
    by_step: tf.Tensor                # int32 [steps, 1 + N] (state.py)
    record_from: tf.Tensor            # int64 []: by_step's first step
    membership_log: "MembershipLog"   # the records kept on ps 0
    set_record_from: tf.Operation     # record_from = the global step
    stop_reason_in: tf.Tensor         # feed string []
    stop_op: tf.Operation             # sends STOP with stop_reason_in
    shutdown_status: tf.Tensor        # feed int32 []: 1 if the run failed
    shutdown_ops: list                # (ps, enqueue) per ps serving: exit
    refill: object = None             # sync/mirrors.Refill; None: no copies


@dataclasses.dataclass
class WorkerGraph:
    """What a worker's Python side runs; `chief` is None on other workers."""
    graph: tf.Graph
    coord: coordination.RunCoordination
    trainset: batches.InGraphTrainSet
    start_token: tf.Tensor    # feed int64 [4]: the first token of a run
    num_steps: tf.Tensor      # feed int64 []: at most this many steps
    loop_outputs: dict        # fetch: steps done, next token, stats sums
    handles: WorkerHandles
    chief: ChiefOps | None
    lock: takeover.ChiefLock  # the chief claims it at start, and beats
    ps_down: int | None = None  # the ps it does without, or None


def build_worker(config: TrainConfig, task: Task, num_train_examples: int,
                 num_test_examples: int, train_steps: int,
                 as_chief: bool | None = None,
                 ps_down: int | None = None) -> WorkerGraph:
    """Worker `task.task_index`'s graph: the chief's (by default worker 0's)
    or another's, doing without ps `ps_down` (--ps_mirrors) or None."""
    cluster, k, num_ps = task.cluster, task.task_index, task.cluster.num_ps
    as_chief = task.is_chief if as_chief is None else as_chief
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.device(
            devices.variable_placement(num_ps, k)):
        flat, shared = _parameters_and_state(config, cluster, train_steps,
                                             ps_down)
        turns = pull_turns_lib.PullTurns(
            cluster.num_workers, shared.shard_devices, config.ordered_pulls)
        coord = coordination.RunCoordination(
            shared, turns, fingerprint(config, task, train_steps),
            chief=k if as_chief else 0)
        lock = takeover.ChiefLock(
            shared.shard_devices[0],
            takeover.generation_copy_device(config, ps_down))
        with tf.device(devices.worker_device(k)):
            trainset = batches.InGraphTrainSet(
                num_train_examples, config.seed, config.batch_size,
                (0, config.batch_size))
            start_token = tf.compat.v1.placeholder(
                tf.int64, [state_lib.TOKEN_SIZE], "start_token")
            num_steps = tf.compat.v1.placeholder(tf.int64, [], "num_steps")
        transport = transport_lib.Transport(shared, config.wire_dtype)
        parts = step_lib.StepParts(config, k, flat, shared, transport, turns,
                                   trainset)
        if as_chief:
            rule = averaging.Averaging(
                shared, config.batch_size, config.backup_workers,
                config.slices, turns, config.micro_batch_rows(), chief=k,
                lock=lock, generation=lock.loop_generation)
            update = optim.ScheduledUpdate(config, train_steps)
            # --ps_mirrors' copies, with their own optimizer
            mirrors = (mirrors_lib.Mirrors(
                flat.variables, flat.ps_indices, num_ps,
                optim.ScheduledUpdate(config, train_steps), shared.global_step)
                if config.ps_mirrors and ps_down is None else None)
            step_body = step_lib.ChiefStep(parts, rule, update, mirrors)
        else:
            step_body = step_lib.WorkerStep(parts)
        loop_outputs = step_lib.training_loop(
            shared, step_body, start_token, num_steps, train_steps, as_chief,
            config.min_workers, lambda: lock.current(lock.loop_generation))
        chief = (_chief_ops(config, num_ps, flat, rule, coord,
                            update.optimizer, num_test_examples, mirrors)
                 if as_chief else None)
        g = WorkerGraph(graph, coord, trainset, start_token, num_steps,
                        loop_outputs, _worker_handles(shared, coord, k),
                        chief, lock, ps_down)
    graph.finalize()
    return g


def _parameters_and_state(config: TrainConfig, cluster, train_steps: int,
                          ps_down: int | None) -> tuple:
    """(FlatParams, SharedState), each shard on the ps that serves it."""
    num_ps = cluster.num_ps
    layout = params_lib.plan_shards(replica_lib.model_specs(config), num_ps)
    flat = params_lib.FlatParams(
        layout, mirrors_lib.served_by_copies(ps_down, num_ps))
    shard_devices = [
        devices.ps_device(mirrors_lib.serving_task(i, ps_down, num_ps))
        for i in flat.ps_indices]
    return flat, state_lib.SharedState(
        cluster.num_workers, flat.sizes, shard_devices, train_steps,
        replica_lib.fixed_point_of(config), ps_down)


def _worker_handles(shared: state_lib.SharedState,
                    coord: coordination.RunCoordination,
                    k: int) -> WorkerHandles:
    with tf.device(shared.shard_devices[0]):
        pushed_in = tf.compat.v1.placeholder(tf.int64, [], "pushed")
        return WorkerHandles(
            ready=tf.raw_ops.VarIsInitializedOp(
                resource=coord.cluster_fingerprint.handle),
            chief_fingerprint=coord.cluster_fingerprint.read_value(),
            stop_reason=coord.stop_reason.read_value(),
            global_step=shared.global_step.read_value(),
            round=shared.round.read_value(),
            planned=shared.planned.read_value(),
            admitted=shared.admitted.read_value(), join_op=coord.join_op(k),
            leave_op=shared.send_event(state_lib.LEAVING, k),
            tokens_waiting=shared.tokens[k].size(),
            roster=shared.roster.read_value(),
            next_token=shared.next_token(k), pushed_in=pushed_in,
            finish_op=coord.report_finished(k, pushed_in))


@dataclasses.dataclass
class MembershipLog:
    """sync/membership_log on ps 0: read, and write(value_in)."""
    read: tf.Tensor            # string []: JSON of every record
    value_in: tf.Tensor        # feed string []
    write: tf.Tensor           # bool []: the log = value_in was written


def _membership_log(shared: state_lib.SharedState, mine) -> MembershipLog:
    with tf.device(shared.shard_devices[0]):
        value_in = tf.compat.v1.placeholder(tf.string, [], "membership_log")
        log = shared.membership_log
        return MembershipLog(log.read_value(), value_in, mine(
            lambda: log.assign(value_in, read_value=False)))


def _chief_ops(config: TrainConfig, num_ps: int, flat, rule, coord,
               optimizer, num_test_examples: int, mirrors) -> ChiefOps:
    init_op = tf.compat.v1.global_variables_initializer()
    shared = rule.shared
    # A deposed chief's watches run until its loop ends: their writes land
    # only in its generation (its last take would keep the roster changes
    # from the next chief). Fed `generation`, as the loop is.
    mine = functools.partial(rule.lock.if_current, rule.generation)
    with tf.device(shared.shard_devices[0]):
        stop_reason_in = tf.compat.v1.placeholder(tf.string, [], "stop_reason")
        lost_in = tf.compat.v1.placeholder(tf.int32, [], "lost_worker")
        late_in = (tf.compat.v1.placeholder(tf.int64, [], "late_step"),
                   tf.compat.v1.placeholder(tf.int64, [], "late_round"))
        late_op = shared.send_event(state_lib.LATE, 0, *late_in)
        deadlines = shared.take_deadlines() if rule.pace.deadlines else None
        stop_op = coord.stop_op(stop_reason_in)
        take_finished = coord.take_reports()
        contributions = shared.contributions.read_value()
        by_step = shared.by_step.read_value()
        record_from = shared.record_from.read_value()
        set_record_from = shared.record_from.assign(
            shared.global_step.read_value(), read_value=False)
    shutdown_status = tf.compat.v1.placeholder_with_default(
        tf.constant(0), [], "shutdown_status")
    transient = state_lib.transient_variables()
    afresh = transient + [shared.dropped]
    pairs = mirrors.pairs(optimizer) if mirrors else []
    copies = [c for _, c in pairs] + ([mirrors.begun] if mirrors else [])
    saver, checkpoint_shapes = checkpoint_saver(  # copies: not saved
        flat, transient + copies, optimizer, config.keep_checkpoints)
    values = [v.read_value() for v in flat.variables]
    eval_outputs, testset_init = replica_lib.evaluation(
        config, flat, values, num_test_examples)
    return ChiefOps(
        generation=rule.generation, init_op=init_op,
        uninitialized=tf.compat.v1.report_uninitialized_variables(),
        transient_init_op=tf.compat.v1.variables_initializer(transient),
        transient_inits={v.op.name: v.initializer for v in transient},
        refill=mirrors_lib.Refill(mirrors, pairs, afresh) if mirrors else None,
        start_op=coord.start_op(),
        mark_ready_op=coord.cluster_fingerprint.initializer,
        absorb_op=rule.absorb_queued(), membership=mine(
            shared.take_membership,
            lambda: [tf.zeros([0], d) for d in shared.membership.dtypes]),
        roster=shared.roster.read_value(), slices=shared.slices.read_value(),
        last_push=shared.last_push.read_value(),
        issued_round=shared.issued_round.read_value(),
        lost_in=lost_in,
        lost_op=mine(lambda: shared.send_event(state_lib.LOST, lost_in)),
        deadlines=deadlines, late_in=late_in, late_op=late_op,
        halt_op=coord.halt_op(rule.guarded), end_op=coord.end_op(),
        saver=saver, checkpoint_shapes=checkpoint_shapes,
        eval_outputs=eval_outputs, testset_init=testset_init,
        param_values=flat.unflatten(values), take_finished=take_finished,
        contributions=contributions, by_step=by_step, record_from=record_from,
        set_record_from=set_record_from, stop_reason_in=stop_reason_in,
        membership_log=_membership_log(shared, mine), stop_op=stop_op,
        shutdown_status=shutdown_status, shutdown_ops=coord.shutdown_ops(
            [i for i in range(num_ps) if i != shared.ps_down_here],
            devices.ps_device, shutdown_status))
