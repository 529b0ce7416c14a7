"""One global step of the pipelined protocol (--chunk_kb), as the chief and
as any other worker runs it.

Read `PipelinedChiefStep.__call__` top to bottom: plan a round; on each ps,
resolve each chunk of it (apply it once every member's gradient chunk is
in); the chief's own piece; admit the round by its events; count the step,
or abandon the round and plan the step again. The chunk moves and the
reason they stay exact are in trainer/sync/pipeline.py; the rest of the
rule is the same as the whole-shard step's (trainer/roles/step.py).

Unlike the whole-shard step, a member pulls at the END of its piece: the
parameters of the next step, chunk by chunk as each is applied, while its
later chunks are still being pushed. They ride in the loop's variables
into the next piece (`carry`), which uses them if it is the very next
round, and reads the parameters afresh otherwise.
"""

import tensorflow as tf

from trainer.cluster import devices
from trainer.learning import replica as replica_lib
from trainer.roles.step import StepParts
from trainer.sync import chunk_apply
from trainer.sync import pipeline as pipeline_lib
from trainer.sync import state as state_lib

# The carry's label: (step, round, 1 if valid) of the values it holds.
NO_LABEL = (-1, -1, 0)


def _follows(token: tf.Tensor, label: tf.Tensor) -> tf.Tensor:
    """bool []: the carried chunks (labelled (step, round, valid)) are the
    parameters of token's step: pulled valid at the end of the round just
    before token's, which was step - 1's last."""
    return tf.logical_and(label[2] > 0, tf.logical_and(
        tf.equal(token[0], label[0] + 1), tf.equal(token[1], label[1] + 1)))


def _either(use_first: tf.Tensor, first: tf.Tensor,
            second: tf.Tensor) -> tf.Tensor:
    """`first` (float32 [n], n known) if use_first, else `second`
    (float32 [n]); `second` is empty (float32 [0]) when not used. A
    copy, no arithmetic, so the values are exact."""
    n = first.shape[0]
    both = tf.concat([first, second], axis=0)
    start = tf.where(use_first, 0, n)
    return tf.reshape(tf.slice(both, [start], [n]), [n])


def pipelined_piece(parts: StepParts, pipeline: pipeline_lib.Pipeline,
                    token: tf.Tensor, values: list) -> tuple:
    """Worker k's piece of round token = (step, round, first, end) with
    `values`, that step's parameters (float32 [n_c] per chunk).

    Returns (the op that announced its push, the carry for its next piece:
    the chunks pulled after it and their label, int64 [3]).
    """
    k = parts.k
    with tf.device(devices.worker_device(k)):
        token = tf.identity(token)
        step, round_ = token[0], token[1]
        replica = replica_lib.compute_gradients(
            parts.config, parts.flat, parts.trainset, step, token[2:],
            values)
        # Push each chunk, pull it back once its ps applied it.
        pushed, pulled, valid = pipeline.exchange(
            k, token, replica.shard_grads, replica.stats)
        label = tf.stack([step, round_, tf.cast(valid, tf.int64)])
    return pushed, pulled + [label]


class PipelinedChiefStep:
    """The chief's pipelined step: a round, the chunks' applies on their
    ps, its own piece, then the count or the same step again."""

    def __init__(self, parts: StepParts, rule, update, pipeline):
        """rule: trainer/sync/averaging.Averaging; update:
        trainer/learning/optim.ChunkUpdate."""
        self.parts, self.rule, self.update = parts, rule, update
        self.pipeline = pipeline

    def initial_carry(self, start_token) -> list:
        """No chunks yet: the first piece reads them (label not valid)."""
        del start_token
        with tf.device(devices.worker_device(self.parts.k)):
            return ([tf.zeros([size]) for size in
                     self.parts.shared.shard_sizes]
                    + [tf.constant(NO_LABEL, tf.int64)])

    def continues(self, token, carry):
        del token, carry
        return None

    def loop_device(self, shared) -> str:
        return shared.shard_devices[0]

    def unfinished(self, token) -> tf.Tensor:
        """bool []: a step is half applied; the loop must finish it.

        Read after `token`, the next step, which comes after the round's
        verdict set the flag: otherwise the lowered loop reads it as the
        last iteration starts, before the verdict."""
        with tf.device(self.parts.shared.shard_devices[0]), \
                tf.control_dependencies([token]):
            return self.pipeline.partial.read_value() > 0

    def __call__(self, done, token, stats, *carry):
        parts, rule, pipe, step = self.parts, self.rule, self.pipeline, token[0]
        # Plan: slices for the members, tokens to the others.
        plan = rule.plan_round(step)
        # Resolve: on each ps, each chunk is applied once all are in. The
        # plan crosses to each ps once, packed.
        heres = chunk_apply.round_on_each_ps(pipe, step, plan)
        resolved = [chunk_apply.resolve(pipe, c, heres[device], self.update,
                                        parts.config.batch_size)
                    for c, device in enumerate(pipe.devices)]
        # Its own piece: with the chunks it pulled last round if that was
        # step - 1's last, else read afresh (after a round was abandoned).
        with tf.device(devices.worker_device(parts.k)):
            follows = _follows(plan.token, carry[-1])
            fresh = pipe.read_unless(follows, [heres[device].step
                                               for device in pipe.devices])
            values = [_either(follows, carried, read)
                      for carried, read in zip(carry[:-1], fresh)]
        pushed, carry = pipelined_piece(parts, pipe, plan.token, values)
        with tf.device(parts.shared.shard_devices[0]):
            # Admit: wait until every member pushed (or one left).
            with tf.control_dependencies([pushed]):
                verdict = rule.admit(step, plan.round)

            def count_step():
                # Count: steps and examples per worker, global step + 1,
                # after the stats rows are read (the next round's pushes
                # write them).
                step_stats = rule.stats_of(verdict.rows)
                with tf.control_dependencies([pipe.set_partial(0),
                                              step_stats]):
                    return rule.count_and_advance(step, []), step_stats

            def plan_again():
                with tf.control_dependencies([pipe.set_partial(1)]):
                    return (rule.unfinished_round(step),
                            tf.zeros([replica_lib.NUM_STATS]))

            # Both branches are on ps 0 only (a branch reaching another ps
            # costs it messages every round, taken or not).
            next_step, step_stats = tf.cond(verdict.complete, count_step,
                                            plan_again)
            # Abandoned: the chunks still waiting for this round give up;
            # those applied stay applied (pipeline.py).
            given_up = chunk_apply.abort_unless(pipe, heres,
                                                verdict.complete)
            # The next round is planned once every chunk of this one is
            # resolved: no chunk is applied while a round is planned.
            with tf.control_dependencies(pipeline_lib.group_by_device(
                    resolved + given_up, pipe.devices + pipe.devices)):
                next_step = tf.identity(next_step)
            return (done + tf.cast(verdict.complete, tf.int64),
                    state_lib.token(next_step), stats + step_stats, *carry)


class PipelinedWorkerStep:
    """Any other worker's pipelined pieces: the loop runs on the worker (so
    its per-step control messages do not go through ps 0) and goes on only
    while each token follows the round the carried chunks came from; the
    Python side then starts it again with the token, and the loop first
    reads the parameters afresh for it."""

    def __init__(self, parts: StepParts, pipeline):
        self.parts, self.pipeline = parts, pipeline

    def initial_carry(self, start_token) -> list:
        """The parameters of start_token's step, read now, labelled as if
        pulled in the round before it."""
        with tf.device(devices.worker_device(self.parts.k)):
            token = tf.identity(start_token)
            values = self.pipeline.read_for(token[0])
            label = tf.stack([token[0] - 1, token[1] - 1,
                              tf.constant(1, tf.int64)])
        return values + [label]

    def continues(self, token, carry):
        return _follows(token, carry[-1])

    def loop_device(self, shared) -> str:
        del shared
        return devices.worker_device(self.parts.k)

    def unfinished(self, token):
        del token
        return None

    def __call__(self, done, token, stats, *carry):
        pushed, carry = pipelined_piece(self.parts, self.pipeline, token,
                                        list(carry[:-1]))
        with tf.device(self.parts.shared.shard_devices[0]):
            with tf.control_dependencies([pushed]):
                next_token = self.parts.shared.next_token(self.parts.k)
        with tf.device(devices.worker_device(self.parts.k)):
            return (done + 1, tf.identity(next_token), stats, *carry)
