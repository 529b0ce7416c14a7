"""One global step, as the chief and as any other worker runs it.

Read `ChiefStep` top to bottom: plan, pull, compute, push, admit, average,
apply, count; or, if a member left before pushing, plan the step again
among the others (sync/averaging.py). Both are the body of `training_loop`,
an in-graph tf.while_loop: one session.run runs many steps, as a distributed
one costs far more than a small model's step (a RunGraph RPC to each ps)."""

import dataclasses

import tensorflow as tf

from trainer.cluster import devices
from trainer.common.config import TrainConfig
from trainer.learning import (batches, optim, params as params_lib,
                              replica as replica_lib)
from trainer.sync import (averaging, state as state_lib,
                          transport as transport_lib)

LOOP_PARALLEL_ITERATIONS = 4


@dataclasses.dataclass
class StepParts:
    """What a worker's step is built from."""
    config: TrainConfig
    k: int                          # this worker's index
    flat: params_lib.FlatParams     # the parameters, one variable per shard
    shared: state_lib.SharedState
    transport: transport_lib.Transport
    pull_turns: object              # trainer/sync/pull_turns.PullTurns
    trainset: batches.InGraphTrainSet


def pull_compute_push(parts: StepParts, token: tf.Tensor) -> tf.Operation:
    """Worker k's slice of a step; token: (step, round, first, end), int64
    [4] on ps 0. Returns the op that pushed it and passed its pull turns."""
    k, step = parts.k, token[0]
    with tf.device(devices.worker_device(k)):
        # Pull step - 1's parameters, in our turn per shard (--ordered_pulls).
        turns = parts.pull_turns.wait(k, step)
        token_here, shard_values = parts.transport.pull(
            token, parts.flat.variables, turns)
        # Compute: the gradient sum over rows [first, end) of the batch.
        replica = replica_lib.compute_gradients(
            parts.config, parts.flat, parts.trainset, token_here[0],
            token_here[2:], shard_values)
        # Push: the gradient and stats into this worker's rows; announce.
        pushed = parts.transport.push(k, token_here, replica.shard_grads,
                                      replica.stats)
        passed = parts.pull_turns.pass_on(k, step, shard_values)
        return tf.group([pushed, *passed])


class ChiefStep:
    """The chief's loop body, (steps done, token, stats sums) -> the same,
    one on: plan a round (nothing if a newer chief holds the lock: the loop
    then ends), its own slice, then the step's update if every member
    pushed, else the same step again."""

    def __init__(self, parts: StepParts, rule: averaging.Averaging,
                 update: optim.ScheduledUpdate, mirrors=None):
        self.parts, self.rule, self.update = parts, rule, update
        self.mirrors = mirrors   # sync/mirrors.py, or None

    def __call__(self, done, token, stats):
        planned, own = self.rule.plan(token[0])
        return tf.cond(planned, lambda: self._round(done, own, stats),
                       lambda: (done, token, stats))

    def _round(self, done, own, stats):
        parts, rule, step = self.parts, self.rule, own[0]
        pushed = pull_compute_push(parts, own)
        with tf.device(parts.shared.shard_devices[0]):
            # A round planned is a beat: a chief whose loop runs is alive,
            # even while a starved host keeps its beat thread waiting.
            beat = rule.lock.beat_op() if rule.lock else tf.no_op()
            # Admit: wait until every member pushed (or one left).
            with tf.control_dependencies([pushed, beat]):
                verdict = rule.admit(step, own[1])

            def apply_step():
                # Average: their sum over their examples, per shard on its ps.
                mean_grads, step_stats = rule.average(verdict.rows)
                # Apply: the optimizer on each ps (and on the mirrors).
                if self.mirrors is None:
                    applied = self.update.apply(
                        step, list(zip(mean_grads, parts.flat.variables)))
                else:
                    applied = self.mirrors.apply(step, mean_grads, self.update)
                # Count: steps and examples per worker, global step + 1.
                next_step = rule.count_and_advance(step, [applied])
                if self.mirrors is not None:
                    next_step = self.mirrors.advance(next_step)
                return tf.constant(1, tf.int64), next_step, step_stats

            def not_applied():
                return (tf.constant(0, tf.int64), rule.unfinished_round(step),
                        tf.zeros([replica_lib.NUM_STATS]))
            # The update and the advance are one write under the chief's
            # lock: a chief deposed meanwhile applies nothing.
            applied, next_step, step_stats = tf.cond(
                verdict.complete,
                lambda: rule.guarded(apply_step, not_applied), not_applied)
            return (done + applied, state_lib.token(next_step),
                    stats + step_stats)


class WorkerStep:
    """Any other worker's slice of a step, then its next token."""

    def __init__(self, parts: StepParts):
        self.parts = parts

    def __call__(self, done, token, stats):
        pushed = pull_compute_push(self.parts, token)
        # Stats are the chief's (a transfer less per step). The next token
        # comes once the chief plans the next round (or STOP, REJOIN, end).
        with tf.device(self.parts.shared.shard_devices[0]):
            with tf.control_dependencies([pushed]):
                next_token = self.parts.shared.next_token(self.parts.k)
            return done + 1, next_token, stats


def training_loop(shared: state_lib.SharedState, step_body, start_token,
                  num_steps, train_steps: int, is_chief: bool,
                  min_workers: int, still_chief) -> dict:
    """Runs from `start_token` (int64 [4]) in one session.run until
    num_steps steps (slices, off the chief), train_steps, a token that is
    not work (STOP, REJOIN), or, on the chief, `halt` set, fewer than
    min_workers in, or `still_chief()` (builds a bool [] on ps 0, read
    each step) false: a newer chief took over. Returns the fetches:
    steps_done (int64 []), next_token (int64 [4]), stats (float32 [3]
    sums: examples averaged, loss sum, correct; zeros off the chief) and,
    on the chief, dropped (int64 [], stale gradients so far)."""
    # The loop's control nodes (and its condition) live on ps 0 with the
    # step: per step only the condition, parameters and gradients cross.
    with tf.device(shared.shard_devices[0]):
        max_steps = tf.identity(num_steps)

        def keep_going(done, token, _):
            step = token[0]
            go = (done < max_steps) & (step >= 0) & (step < train_steps)
            if is_chief:
                go &= tf.equal(shared.halt.read_value(), 0)
                roster = shared.roster.read_value()
                go &= (state_lib.count(roster) >= min_workers) & still_chief()
            return go
        done, next_token, stats = tf.while_loop(
            keep_going, step_body,
            [tf.constant(0, tf.int64), tf.identity(start_token),
             tf.zeros([replica_lib.NUM_STATS])],
            parallel_iterations=LOOP_PARALLEL_ITERATIONS)
        outputs = dict(steps_done=done, next_token=next_token, stats=stats)
        if is_chief:
            with tf.control_dependencies([done, next_token, stats]):
                outputs["dropped"] = shared.dropped.read_value()
    return outputs
