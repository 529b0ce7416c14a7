"""One global step, as the chief and as any other worker runs it.

Read `ChiefStep.__call__` top to bottom for what happens in a step: pull
the parameters, compute a gradient, push it, then (the chief only) admit R
gradients, average them, apply the mean with the optimizer and count the
step. The protocol pieces are in trainer/sync/averaging.py; the optimizer
and its learning rate in trainer/learning/optim.py; the replica's gradient
in trainer/learning/replica.py.

Both run as the body of `training_loop`, an in-graph tf.while_loop: one
session.run executes many steps, since a distributed session.run costs far
more than a small model's step (a RunGraph RPC to each ps, a new thread,
cleanup RPCs).
"""

import dataclasses

import tensorflow as tf

from trainer.cluster import devices
from trainer.common.config import TrainConfig
from trainer.learning import batches
from trainer.learning import optim
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.sync import averaging

LOOP_PARALLEL_ITERATIONS = 4


@dataclasses.dataclass
class StepParts:
    """What a worker's step is built from."""

    config: TrainConfig
    k: int                          # this worker's index
    flat: params_lib.FlatParams     # the parameters, one variable per shard
    sync: averaging.Averaging
    trainset: batches.InGraphTrainSet


def pull_compute_push(parts: StepParts, step: tf.Tensor) -> tf.Operation:
    """Worker k's half of step `step` (int64 [] on ps 0): returns the op
    that pushed its gradient (and passed on its pull turns)."""
    sync, k = parts.sync, parts.k
    with tf.device(devices.worker_device(k)):
        # Pull: wait for this worker's turn on each shard (only with
        # --ordered_pulls), then read the parameters after step - 1.
        turns = sync.pull_turns.wait(k, step)
        step_on_worker, shard_values = sync.pull(step, parts.flat.variables,
                                                 turns)
        # Compute: the gradient sum of this worker's slice of the batch.
        replica = replica_lib.compute_gradients(
            parts.config, parts.flat, parts.trainset, step_on_worker,
            shard_values)
        # Push: the gradient and stats into this worker's rows; arrive.
        pushed = sync.push(k, replica.step, replica.shard_grads,
                           replica.stats)
        passed = sync.pull_turns.pass_on(k, step, shard_values)
        return tf.group([pushed, *passed])


class ChiefStep:
    """The chief's step: its own gradient, then the update of the step.

    Keeps the optimizer it builds (inside the loop, since the learning rate
    depends on the step), whose slots the checkpoint saver needs.
    """

    def __init__(self, parts: StepParts, train_steps: int):
        self.parts, self.train_steps = parts, train_steps
        self.optimizer = None

    def __call__(self, done, step, stats):
        """Loop body: (steps done, step, stats sums) -> the same, one on."""
        parts, sync = self.parts, self.parts.sync
        pushed = pull_compute_push(parts, step)
        with tf.device(sync.shard_devices[0]):
            # Admit: wait for R distinct workers' gradients for `step`.
            rows = sync.admit(step)
            # Average: their sum over their examples, per shard on its ps.
            mean_grads, step_stats = sync.average(rows)
            # Apply: the optimizer (trainer/learning/optim.py) on each ps.
            self.optimizer = optim.make_optimizer(
                parts.config,
                optim.learning_rate(parts.config, step, self.train_steps))
            update = self.optimizer.apply_gradients(
                list(zip(mean_grads, parts.flat.variables)))
            # Count: contributions, global step + 1, tokens to the workers.
            next_step = sync.count_and_advance(step, [update, pushed])
            return done + 1, next_step, stats + step_stats


class WorkerStep:
    """Any other worker's step: its gradient, then the next token."""

    def __init__(self, parts: StepParts):
        self.parts = parts

    def __call__(self, done, step, stats):
        pushed = pull_compute_push(self.parts, step)
        sync = self.parts.sync
        # Statistics are the chief's business; keeping them off this loop
        # saves a transfer per step. The next token comes once the chief
        # has applied this step (or is STOP).
        with tf.device(sync.shard_devices[0]):
            with tf.control_dependencies([pushed]):
                next_step = sync.next_token(self.parts.k)
            return done + 1, next_step, stats


def training_loop(sync: averaging.Averaging, step_body, start_step,
                  num_steps, train_steps: int, is_chief: bool) -> dict:
    """Runs steps start_step, start_step + 1, ... inside one session.run.

    The loop ends after num_steps steps, at train_steps, or when the chief
    sends STOP (a negative step). Returns the fetches: steps_done and
    next_step (int64 []), stats (float32 [3] sums; zeros off the chief)
    and, on the chief, dropped (int64 [], stale gradients so far).
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
    if is_chief:
        with tf.device(sync.shard_devices[0]), \
                tf.control_dependencies([done, next_step, stats]):
            outputs["dropped"] = sync.dropped.read_value()
    return outputs
