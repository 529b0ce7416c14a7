"""The chief's side of the pipelined protocol (trainer/sync/pipeline.py):
each chunk's apply on its ps, once every member's copy of it is in, and
the ABORT that gives up on a round's chunks.

These run in the chief's loop, each chunk's part on that chunk's ps, so a
chunk is applied on its ps as soon as it is complete, whatever the other
chunks and ps tasks are doing. Every function takes the Pipeline (`pipe`)
whose state it works on.

What crosses from ps 0 to another ps per round is kept to one tensor
each way (`RoundHere`, `abort_unless`): every value ps 0 sends is a
message of its own (a gRPC call on a host of a fraction of a core, ps 0's
CPU being what limits the step when the links are fast), and a tf.cond
whose branches reach another ps sends it its predicate and dead tensors
even when not taken.
"""

import dataclasses

import tensorflow as tf

from trainer.sync.pipeline import ABORT, Pipeline, put_if


@dataclasses.dataclass
class RoundHere:
    """A planned round as one ps sees it (tensors on that ps)."""

    step: tf.Tensor       # int64 []
    round: tf.Tensor      # int64 []
    members: tf.Tensor    # float32 [N]: 1 where averaged in this round
    given: tf.Tensor      # bool [N]: handed a token


def round_on_each_ps(pipe: Pipeline, step, plan) -> dict:
    """{ps device: RoundHere}: the round's step, number, members and who
    got a token, packed on ps 0 into one int64 [2 + 2N] that crosses once
    to each ps (four tensors would be four messages per ps per round)."""
    with tf.device(pipe.devices[0]):
        packed = tf.concat([tf.stack([tf.cast(step, tf.int64), plan.round]),
                            tf.cast(plan.members, tf.int64),
                            tf.cast(plan.given, tf.int64)], axis=0)
    n, heres = pipe.shared.num_workers, {}
    for device in dict.fromkeys(pipe.devices):
        with tf.device(device):
            here = tf.identity(packed)
            heres[device] = RoundHere(here[0], here[1],
                                      tf.cast(here[2:2 + n], tf.float32),
                                      here[2 + n:] > 0)
    return heres


def resolve(pipe: Pipeline, c: int, here: RoundHere, update,
            global_batch: int) -> tf.Operation:
    """Chunk c's part of the round `here` (on chunk c's ps): waits for
    every member's arrival or the round's ABORT, applies the chunk unless
    abandoned or applied already, and posts +round (-round) on the ready
    queue of every worker given a token."""
    step, round_ = here.step, here.round
    with tf.device(pipe.devices[c]):
        aborted = _await_arrivals(pipe, c, step, round_, here.members)
        apply_now = tf.logical_and(
            tf.logical_not(aborted),
            tf.not_equal(pipe.applied_for[c].read_value(), step))

        def apply_chunk():
            rows = tf.where(here.members > 0.5)[:, 0]
            mean = tf.reduce_sum(pipe.shared.grads[c].sparse_read(rows),
                                 axis=0) / float(global_batch)
            var = pipe.flat.variables[c]
            saved = pipe.prev[c].assign(var.read_value(),
                                        read_value=False)
            with tf.control_dependencies([saved]):
                applied = update.apply(step, mean, var)
            with tf.control_dependencies([applied]):
                done = [pipe.applied_for[c].assign(step,
                                                   read_value=False)]
                if c == 0:
                    done += update.finish(step)
            with tf.control_dependencies(done):
                return tf.constant(True)

        resolved = tf.cond(apply_now, apply_chunk,
                           lambda: tf.constant(False))
        entry = tf.where(aborted, -round_, round_)
        with tf.control_dependencies([resolved]):
            return tf.group([put_if(queue, here.given[k], entry)
                             for k, queue in enumerate(pipe.ready[c])])

def _await_arrivals(pipe: Pipeline, c, step, round_, members):
    """Takes chunk c's arrival entries until every member of (step,
    round_) is in, or its ABORT. Returns bool [] aborted.

    Nearly always the first `members` entries are exactly theirs, so
    one dequeue of that many decides; a loop, entry by entry, runs only
    after stale entries (a probe's push, late pushes of an abandoned
    round, its leftover ABORTs)."""
    queue, n = pipe.arrivals[c], pipe.shared.num_workers
    needed = tf.cast(tf.reduce_sum(members), tf.int32)

    def judge(for_step, for_round, worker):
        """(fresh member pushes as float32 [N], ABORT seen: bool [])."""
        this = tf.logical_and(tf.equal(for_step, step),
                              tf.equal(for_round, round_))
        index = tf.maximum(worker, 0)
        member = tf.logical_and(worker >= 0,
                                tf.gather(members, index) > 0.5)
        fresh = tf.cast(tf.logical_and(this, member), tf.float32)
        arrived = tf.reduce_max(
            fresh[:, None] * tf.one_hot(index, n), axis=0)
        return arrived, tf.reduce_any(tf.logical_and(
            this, tf.equal(worker, ABORT)))

    arrived, aborted = judge(*queue.dequeue_many(needed))

    def entry_by_entry():
        def open_(arrived, aborted):
            return tf.logical_and(tf.reduce_sum(arrived) < tf.cast(
                needed, tf.float32), tf.logical_not(aborted))

        def take(arrived, aborted):
            more, abort_seen = judge(*[v[None] for v in queue.dequeue()])
            return (tf.maximum(arrived, more),
                    tf.logical_or(aborted, abort_seen))

        return tf.while_loop(open_, take, [arrived, aborted],
                             parallel_iterations=1)[1]

    complete = tf.equal(tf.reduce_sum(arrived),
                        tf.cast(needed, tf.float32))
    return tf.cond(tf.logical_or(complete, aborted),
                   lambda: aborted, entry_by_entry)

def abort_unless(pipe: Pipeline, heres: dict, complete) -> list:
    """Ops putting (step, round, ABORT) N times on every chunk's arrivals
    unless `complete` (bool [] on ps 0): a resolve waiting for its
    members' entries all at once then takes at least one ABORT whatever
    number it waits for. No cond: each ps gets the flag (one message) and
    enqueues N or 0 entries."""
    ops, n = [], pipe.shared.num_workers
    for c, device in enumerate(pipe.devices):
        here = heres[device]
        with tf.device(device):
            count = n * (1 - tf.cast(complete, tf.int32))
            ops.append(pipe.arrivals[c].enqueue_many(
                (tf.fill([count], here.step), tf.fill([count], here.round),
                 tf.fill([count], ABORT))))
    return ops
