"""How fast each member is, as the rule (trainer/sync/averaging.py) sees
it: every worker's speed and slice time, who is benched, when a benched
worker is probed, and when a round stops waiting for a member far behind
the others. All of it acts with balanced slices only; `--slices=equal`
keeps every member in every round and waits for all.

A slice is timed from the plan that issued its token to its push, both on
ps 0's clock (the event's time is stamped as it arrives there).
"""

import numpy as np
import tensorflow as tf

from trainer.sync import queues
from trainer.sync import slices as slices_lib
from trainer.sync.state import LATE, PUSHED, count as count_of, set_if

# How much of a worker's measured speed carries over to the next round.
SPEED_MEMORY = 0.7
# A member whose slices take BENCH_FACTOR times as long as every other
# member's, even with its balanced slice, or whose balanced share would be
# under MIN_SHARE of an equal one, is benched: its fixed cost per round,
# not its share, would hold every step (slices.benched). PROBE_SECS after
# its last token it gets a probe: an equal slice, timed but not waited
# for. Equal, not its tiny balanced share: a few examples finish fast on a
# starved host's refilled CPU budget and would let it back for rounds it
# then holds. Each time it is benched again (a probe made it look fast,
# its rounds did not), its probes come twice as far apart, up to
# 2^MAX_BACKOFF times: seconds, not steps, so that a worker fast again is
# back within a bound of time however fast the steps run.
BENCH_FACTOR, MIN_SHARE, PROBE_SECS, MAX_BACKOFF = 2.0, 0.25, 2.0, 2
# A round's deadline: LATE_FACTOR times the second slowest member's recent
# slice time, at least MIN_LATE_SECS, after the plan. A member then the
# only one late, with two pushed, is benched and the step planned again
# without it, as if it had left (`late`).
LATE_FACTOR, MIN_LATE_SECS = 3.0, 0.1


class Pace:
    """Timing state on ps 0 (SharedState's speed, slice_secs, issued_*,
    answered, benched, deadlines) and what the rule decides from it."""

    def __init__(self, shared, slices: str, backup_workers: int,
                 chief: int = 0):
        self.shared, self.chief = shared, chief
        self.balanced = slices == slices_lib.BALANCED
        # With backups a round already ends without its slowest members.
        self.deadlines = self.balanced and backup_workers == 0
        self.probe_secs = PROBE_SECS   # before the graph is built

    def benched(self, roster: tf.Tensor) -> tf.Tensor:
        """bool [N]: members that sit this round out (slices.benched)."""
        if not self.balanced:
            return tf.zeros_like(roster, tf.bool)
        s = self.shared
        return slices_lib.benched(s.slice_secs.read_value(),
                                  s.speed.read_value(), roster, BENCH_FACTOR,
                                  MIN_SHARE, self.chief)

    def probes(self, now: tf.Tensor, out: tf.Tensor) -> tuple:
        """Which benched workers (out: bool [N]) get a probe in a round
        planned at `now` (ps 0's clock, float64 []): bool [N], those with
        no slice outstanding PROBE_SECS x 2^(times benched - 1) after
        their last token; and the op that counts the members benched since
        the last plan (the plan's writes must wait for it: it reads
        sync/planned)."""
        s = self.shared
        before = s.benched.read_value()
        newly = tf.logical_and(out, tf.logical_or(
            s.planned.read_value(), tf.equal(before, 0)))
        times = before + tf.cast(newly, tf.int64)
        with tf.control_dependencies([times]):
            count = s.benched.assign(times, read_value=False)
        wait = self.probe_secs * tf.cast(tf.bitwise.left_shift(
            tf.constant(1, tf.int64),
            tf.clip_by_value(times - 1, 0, MAX_BACKOFF)), tf.float64)
        idle = tf.equal(s.issued_round.read_value(), s.answered.read_value())
        due = now - s.issued_at.read_value() >= wait
        return tf.logical_and(out, tf.logical_and(idle, due)), count

    def set_deadline(self, step, round_, members: tf.Tensor) -> tf.Operation:
        """Asks the chief's deadline thread (trainer/roles/deadlines.py)
        for a LATE event when round `round_` of `step` has run too long:
        (step, round, seconds) onto sync/deadlines, if there is a member
        (members: bool [N]) to wait for and a slice time to go by."""
        s = self.shared
        if not self.deadlines:
            return tf.no_op()
        secs = tf.where(members, s.slice_secs.read_value(), 0.0)
        # The second slowest member's slice time (the only one's if one).
        typical = tf.math.top_k(secs, min(2, s.num_workers)).values[-1]
        wait = tf.maximum(LATE_FACTOR * typical, MIN_LATE_SECS)
        # No deadline while a member is unmeasured: a worker that just
        # joined warms up in its first slice, which is slow by nature.
        measured = tf.reduce_all(tf.logical_or(tf.logical_not(members),
                                               secs > 0))
        return queues.put_if(s.deadlines, tf.logical_and(
            measured, count_of(members) > 2), (step, round_, wait))

    def late(self, kind, for_step, for_round, step, round_, sent_at
             ) -> tuple:
        """Acts on a LATE event (kind: int32 []; for_step, for_round, step,
        round_: int64 []; sent_at: float64 [], ps 0's clock): (the round
        ends unfinished: bool [], the op that benches its late member).

        A member is late if planned, not admitted, and not the chief;
        pushed if planned and not late (the chief counts as pushed: it
        pushes before taking events). Every combination ('-': any; "this
        round": for_step == step and for_round == round_):

            kind   this round  late    pushed | ends  benched
            LATE       1        1       >= 2  |  1    the late member
            LATE       1        1       0, 1  |  0    none
            LATE       1        0, >= 2  -    |  0    none
            LATE       0        -        -    |  0    none
            other      -        -        -    |  0    none

        The late member's slice time becomes at least the time it has
        taken so far (sent_at - its issued_at), and over BENCH_FACTOR
        times every punctual (pushed) member's, which benches it at the
        next plan; its push, when it comes, is timed. Two or more late
        members are waited for: the bench rule could bench neither, each
        as slow as the other, and the same members would redo the step.
        (late_member decides, late_np is its twin.)"""
        s = self.shared
        abandon, which, taken = late_member(
            kind, for_step, for_round, step, round_, sent_at,
            s.planned.read_value(), s.admitted.read_value(),
            s.slice_secs.read_value(), s.issued_at.read_value(), self.chief)
        # Writes the late member only (never worker 0, whose slice_secs
        # the same event's record() may write).
        bench_late = tf.raw_ops.ResourceScatterMax(
            resource=s.slice_secs.handle, indices=which, updates=taken)
        return abandon, bench_late

    def record(self, worker, for_round, timed, fresh_start, examples_now,
               secs_now) -> list:
        """The writes of one event's timing (`timing`'s outputs): worker's
        slice examples, slice time and speed (their ratio), the round it
        answered, and on a (re)join (fresh_start) its measures and bench
        count back to 0."""
        s = self.shared
        measured = tf.logical_or(timed, fresh_start)
        zero = tf.zeros_like(for_round)
        speed_now = tf.math.divide_no_nan(examples_now, secs_now)
        return [
            set_if(s.slice_examples, worker, measured, examples_now),
            set_if(s.speed, worker, measured, speed_now),
            set_if(s.slice_secs, worker, measured, secs_now),
            set_if(s.answered, worker, measured,
                   tf.where(timed, for_round, zero)),
            set_if(s.benched, worker, fresh_start, zero)]

    def timing(self, kind, worker, for_round, sent_at, fresh_start,
               planned) -> tuple:
        """A push timed from the issue of its token (a slice of this round,
        or a probe that arrives rounds later): (timed: bool [], the
        worker's slice examples and slice time averaged with it: float32
        []). fresh_start (bool []): its measures restart at 0. planned
        (bool []): it is in this round's plan; a push from outside it (a
        probe, or a slice a deadline left behind) replaces the old
        measure, which benched the worker: averaged with it, a worker fast
        again would need many probes to come back."""
        s = self.shared
        # A worker's first slice since it joined (answered 0) includes
        # warming up its session and graph, often 10x a later slice: kept,
        # it would make that worker look slow, and everyone look alike to
        # the bench rule, for several rounds.
        first = tf.equal(s.answered.read_value()[worker], 0)
        timed = tf.logical_and(tf.equal(kind, PUSHED), tf.equal(
            for_round, s.issued_round.read_value()[worker]))
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
    """Pace.late's decision, with no variable in it (planned, admitted:
    bool [N]; slice_secs: float32 [N]; issued_at: float64 [N]; chief: int
    or int32 []; the rest as in `late`): (the round ends: bool []; the
    member to bench: int32 [1], or [0] if none; its slice time at least:
    float32 [1] or [0])."""
    late = tf.logical_and(tf.logical_and(planned, tf.logical_not(
        admitted)), tf.not_equal(tf.range(planned.shape[0]), chief))
    n_late = count_of(late)
    n_pushed = count_of(tf.logical_and(planned, tf.logical_not(late)))
    abandon = tf.logical_and(
        tf.logical_and(tf.equal(kind, LATE), tf.logical_and(
            tf.equal(for_step, step), tf.equal(for_round, round_))),
        tf.logical_and(tf.equal(n_late, 1), n_pushed >= 2))
    punctual = tf.reduce_max(tf.where(
        tf.logical_and(planned, tf.logical_not(late)), slice_secs, 0.0))
    late = tf.logical_and(late, abandon)
    which = tf.cast(tf.where(late)[:, 0], tf.int32)
    taken = tf.maximum(
        tf.cast(sent_at - tf.gather(issued_at, which), tf.float32),
        1.01 * BENCH_FACTOR * punctual)
    return abandon, which, taken


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
