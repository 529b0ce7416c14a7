"""Speeds, benched workers, probes, round deadlines: balanced slices only
(`--slices=equal` waits for every member). A slice is timed from its plan
to its push, both on ps 0's clock. Why each rule is as it is:
docs/how-it-works.md#micro-batches ("Balanced slices")."""

import numpy as np
import tensorflow as tf

from trainer.sync import queues, slices as slices_lib
from trainer.sync.state import LATE, PUSHED, count as count_of, set_if

SPEED_MEMORY = 0.7   # how much of a measured speed carries over a round
# Benching (Pace.benched), and a benched worker's probe (an equal slice,
# timed, not waited for) PROBE_SECS after its last token, twice as far
# apart each time it is benched again, up to 2^MAX_BACKOFF.
BENCH_FACTOR, MIN_SHARE, PROBE_SECS, MAX_BACKOFF = 2.0, 0.25, 2.0, 2
# A round's deadline, after its plan: LATE_FACTOR times the second slowest
# member's recent slice time, at least MIN_LATE_SECS (`late`).
LATE_FACTOR, MIN_LATE_SECS = 3.0, 0.1


class Pace:
    """What the rule decides from SharedState's timing variables."""

    def __init__(self, shared, slices: str, backup_workers: int,
                 chief: int = 0):
        self.shared, self.chief = shared, chief
        self.balanced = slices == slices_lib.BALANCED
        # With backups a round already ends without its slowest members.
        self.deadlines = self.balanced and backup_workers == 0
        self.probe_secs = PROBE_SECS   # before the graph is built

    def benched(self, roster: tf.Tensor) -> tf.Tensor:
        """bool [N]: members (roster: bool [N]), not the chief, whose fixed
        cost per slice holds the round: slices over BENCH_FACTOR times every
        other member's, or a speed under MIN_SHARE times the mean."""
        if not self.balanced:
            return tf.zeros_like(roster, tf.bool)
        speed = self.shared.speed.read_value()
        secs = tf.where(roster, self.shared.slice_secs.read_value(), 0.0)
        top = tf.math.top_k(secs, tf.minimum(2, tf.size(secs))).values
        second = top[-1] if secs.shape[0] > 1 else tf.constant(0.0)
        others = tf.where(tf.equal(secs, top[0]), second, top[0])
        slow = (secs > BENCH_FACTOR * others) & (others > 0)
        measured, mean = slices_lib.measured_mean(speed, roster)
        few = measured & (speed < MIN_SHARE * mean)
        return (slow | few) & tf.not_equal(tf.range(tf.size(secs)), self.chief)

    def probes(self, now: tf.Tensor, out: tf.Tensor) -> tuple:
        """(bool [N]: the benched (out: bool [N]) with no slice outstanding
        whose probe is due at `now` (float64 [], ps 0's clock); the op
        counting the members benched since the last plan: it reads
        sync/planned, so the plan's writes wait for it)."""
        s = self.shared
        before = s.benched.read_value()
        newly = out & (s.planned.read_value() | tf.equal(before, 0))
        times = before + tf.cast(newly, tf.int64)
        with tf.control_dependencies([times]):
            count = s.benched.assign(times, read_value=False)
        wait = self.probe_secs * 2.0 ** tf.cast(
            tf.clip_by_value(times - 1, 0, MAX_BACKOFF), tf.float64)
        idle = tf.equal(s.issued_round.read_value(), s.answered.read_value())
        due = now - s.issued_at.read_value() >= wait
        return out & idle & due, count

    def set_deadline(self, step, round_, members: tf.Tensor) -> tf.Operation:
        """Asks trainer/roles/deadlines.py for a LATE event when the round
        has run too long, if there are members (bool [N]) to wait for."""
        s = self.shared
        if not self.deadlines:
            return tf.no_op()
        secs = tf.where(members, s.slice_secs.read_value(), 0.0)
        # The second slowest member's slice time (the only one's if one).
        typical = tf.math.top_k(secs, min(2, s.num_workers)).values[-1]
        wait = tf.maximum(LATE_FACTOR * typical, MIN_LATE_SECS)
        # No deadline while a member is unmeasured: a worker that just
        # joined warms up in its first slice, which is slow by nature.
        measured = tf.reduce_all(~members | (secs > 0))
        return queues.put_if(s.deadlines, measured & (count_of(members) > 2),
                             (step, round_, wait))

    def late(self, kind, for_step, for_round, step, round_, sent_at) -> tuple:
        """(the round ends unfinished: bool [], the op benching its late
        member) on an event (kind int32, steps and rounds int64, sent_at
        float64 on ps 0's clock: []). Late: planned, not admitted, not the
        chief; pushed: planned, not late (the chief pushes before taking
        events); "this round": for_step, for_round == step, round_; '-': any:

            kind   this round  late    pushed | ends  benched
            LATE       1        1       >= 2  |  1    the late member
            LATE       1        1       0, 1  |  0    none
            LATE       1        0, >= 2  -    |  0    none
            LATE       0        -        -    |  0    none
            other      -        -        -    |  0    none

        Its slice time becomes at least its time so far and over
        BENCH_FACTOR times any pushed member's: benched at the next plan.
        Two late members are waited for: neither would be benched, each as
        slow as the other, and the same members would redo the step."""
        s = self.shared
        abandon, which, taken = late_member(
            kind, for_step, for_round, step, round_, sent_at,
            s.planned.read_value(), s.admitted.read_value(),
            s.slice_secs.read_value(), s.issued_at.read_value(), self.chief)
        # Writes the late member only (never worker 0, whose slice_secs
        # the same event's record() may write).
        return abandon, tf.raw_ops.ResourceScatterMax(
            resource=s.slice_secs.handle, indices=which, updates=taken)

    def record(self, worker, for_round, timed, fresh_start, examples_now,
               secs_now) -> list:
        """Writes `timing`'s outputs for worker; on a (re)join
        (fresh_start) its measures and bench count back to 0."""
        s = self.shared
        measured = timed | fresh_start
        zero = tf.zeros_like(for_round)
        speed_now = tf.math.divide_no_nan(examples_now, secs_now)
        return [set_if(s.slice_examples, worker, measured, examples_now),
                set_if(s.speed, worker, measured, speed_now),
                set_if(s.slice_secs, worker, measured, secs_now),
                set_if(s.answered, worker, measured,
                       tf.where(timed, for_round, zero)),
                set_if(s.benched, worker, fresh_start, zero)]

    def timing(self, kind, worker, for_round, sent_at, fresh_start,
               planned) -> tuple:
        """(timed: a push timed from its token's issue, bool []; worker's
        slice examples and time averaged with it, float32 []; 0 on
        fresh_start: bool []). A push from outside the plan (planned: bool
        []; a probe, a deadline's leftover) replaces them, not averaged."""
        s = self.shared
        # A worker's first slice since it joined (answered 0) is not
        # averaged in: it warms up its session, often 10x a later one.
        first = tf.equal(s.answered.read_value()[worker], 0)
        timed = tf.equal(kind, PUSHED) & tf.equal(
            for_round, s.issued_round.read_value()[worker])
        elapsed = tf.cast(sent_at - s.issued_at.read_value()[worker],
                          tf.float32)
        memory = tf.where(planned, SPEED_MEMORY, 0.0)
        def averaged(old, new):
            kept = tf.where(first, old, tf.where(
                old > 0, memory * old + (1 - memory) * new, new))
            return tf.where(fresh_start, tf.zeros_like(old), kept)
        examples = averaged(s.slice_examples.read_value()[worker],
                            s.stats.read_value()[worker][0])
        secs = averaged(s.slice_secs.read_value()[worker], elapsed)
        return timed, examples, secs


def late_member(kind, for_step, for_round, step, round_, sent_at, planned,
                admitted, slice_secs, issued_at, chief) -> tuple:
    """Pace.late's decision without variables (planned, admitted: bool
    [N]; slice_secs: float32 [N]; issued_at: float64 [N]; chief: int or
    int32 []): (ends: bool []; the member to bench: int32 [1], or [0];
    its slice time at least: float32 [1] or [0])."""
    late = planned & ~admitted & tf.not_equal(tf.range(planned.shape[0]),
                                              chief)
    pushed = planned & ~late
    abandon = (tf.equal(kind, LATE) & tf.equal(for_step, step)
               & tf.equal(for_round, round_) & tf.equal(count_of(late), 1)
               & (count_of(pushed) >= 2))
    punctual = tf.reduce_max(tf.where(pushed, slice_secs, 0.0))
    which = tf.cast(tf.where(late & abandon)[:, 0], tf.int32)
    return abandon, which, tf.maximum(
        tf.cast(sent_at - tf.gather(issued_at, which), tf.float32),
        1.01 * BENCH_FACTOR * punctual)


def late_np(kind, for_step, for_round, step, round_, sent_at, planned,
            admitted, slice_secs, issued_at, chief) -> tuple:
    """`late_member` in NumPy, row by row of Pace.late's table."""
    planned, admitted = np.asarray(planned, bool), np.asarray(admitted, bool)
    late = planned & ~admitted & (np.arange(len(planned)) != chief)
    pushed = planned & ~late
    ends = bool(kind == LATE and for_step == step and for_round == round_
                and late.sum() == 1 and pushed.sum() >= 2)
    if not ends:
        return False, np.zeros(0, np.int32), np.zeros(0, np.float32)
    which = np.flatnonzero(late).astype(np.int32)
    punctual = np.max(np.where(pushed, slice_secs, 0)).astype(np.float32)
    so_far = (sent_at - np.asarray(issued_at)[which]).astype(np.float32)
    return True, which, np.maximum(
        so_far, np.float32(1.01 * BENCH_FACTOR) * punctual)
