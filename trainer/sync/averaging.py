"""The sync rule: who computes what in a step, what is averaged, when the
step is applied. Its invariants (docs/how-it-works.md#invariants):

I1. Step t's update is the mean, over exactly its global batch (each
    example once), of per-example gradients at step t - 1's parameters.
I2. A push for (step, round) is admitted in that round only, at most once.
I3. The global step never goes back: only count_and_advance sets it.
I4. A worker out of the round gets no slice; a probe is never admitted.
I5. A member reads step t's parameters only after step t - 1 is applied:
    its token comes from the plan, which runs after the update.
I6. A worker alive and reachable is taken back in: a push from outside
    the roster, or a JOINED, puts it in the next plan; one cut off past
    --worker_timeout_secs joins again once ps 0 answers.
I7. At most one chief acts: each write here but a RELEASE of pull turns
    is `guarded` by ps 0's lock holding its generation (roles/takeover.py).

Step t runs rounds (plan, admit pushes, apply) until one completes; a
member that leaves first, or is far past the deadline (pace.py), ends
the round: docs/how-it-works.md#synchronous-averaging-elastic."""

import dataclasses

import numpy as np
import tensorflow as tf

from trainer.learning import fixed_point
from trainer.sync import (pace as pace_lib, queues, slices as slices_lib,
                          state as state_lib, step_record)
from trainer.sync.state import JOINED, LEAVING, LOST, PUSHED

BALANCE_GAIN = 0.2   # balanced slices only for rounds 20% shorter (prefer)


@dataclasses.dataclass
class Verdict:
    """How a round ended (tensors on ps 0)."""
    complete: tf.Tensor   # bool []: every needed member pushed
    rows: tf.Tensor       # int64 [R]: the admitted workers


class Averaging:
    """The rule over a SharedState; the chief runs all of it."""

    def __init__(self, shared: state_lib.SharedState, global_batch: int,
                 backup_workers: int, slices: str, pull_turns,
                 micro_batch: int = 0, chief: int = 0, lock=None,
                 generation: tf.Tensor | None = None):
        """micro_batch: slices are whole --micro_batch rows (0: 1). lock,
        generation: the ChiefLock and this chief's generation (int64 [] on
        ps 0) guarding every write; no lock (unit tests): unguarded."""
        self.shared, self.global_batch = shared, global_batch
        self.chief, self.lock, self.generation = chief, lock, generation
        self.backup_workers, self.slices = backup_workers, slices
        self.pull_turns, self.unit = pull_turns, micro_batch or 1
        self.device = shared.shard_devices[0]
        self.pace = pace_lib.Pace(shared, slices, backup_workers, chief)

    def guarded(self, write, refused, after=()):
        """write() while the lock holds this chief's generation, else
        refused(), the lock taken after `after`; write() without a lock."""
        if self.lock is None:
            return write()
        return self.lock.guarded(self.generation, write, refused, after)

    def plan(self, step: tf.Tensor) -> tuple:
        """Starts a round of `step` (int64 []): (planned: bool [], false if
        a newer chief holds the lock; the chief's token, int64 [4])."""
        with tf.device(self.device):
            return self.guarded(
                lambda: (tf.constant(True), self._plan(step)),
                lambda: (tf.constant(False), state_lib.token(step)))

    def _plan(self, step: tf.Tensor) -> tf.Tensor:
        s, batch, unit = self.shared, self.global_batch, self.unit
        with tf.device(self.device):
            roster, speed = s.roster.read_value(), s.speed.read_value()
            out = self.pace.benched(roster)
            # With fewer micro-batches than members, the last members sit
            # the round out: an empty slice would be timed as a member's.
            members = slices_lib.at_most(roster & ~out, batch // unit,
                                         self.chief)
            weight = slices_lib.weights(speed, members, self.slices)
            cut = slices_lib.prefer(
                slices_lib.bounds(tf.cast(members, tf.float32), batch, unit),
                slices_lib.bounds(weight, batch, unit), weight, BALANCE_GAIN)
            now = tf.timestamp()
            probe, count_benched = self.pace.probes(now, out)
            given = members | probe
            token_cut = tf.where(probe[:, None], slices_lib.bounds(
                tf.cast(roster, tf.float32), batch, unit), cut)
            # A read now: assign_add's value is a lazy read, which a loop
            # that captures it would repeat every iteration (from ps 0).
            round_ = tf.identity(s.round.assign_add(1))
            with tf.control_dependencies([count_benched]):
                writes = [s.planned.assign(members, read_value=False),
                          s.admitted.assign(tf.zeros_like(members),
                                            read_value=False),
                          s.slices.assign(cut, read_value=False),
                          _assign_where(s.issued_at, given, now),
                          _assign_where(s.issued_round, given, round_)]
            with tf.control_dependencies(writes):
                writes.append(self.pace.set_deadline(step, round_, members))
                sent = [queues.put_if(s.tokens[k], given[k], [state_lib.token(
                    step, round_, token_cut[k][0], token_cut[k][1])])
                        for k in range(s.num_workers) if k != self.chief]
                sent += self.pull_turns.cover_absent(step, members)
            with tf.control_dependencies(writes + sent):
                own = cut[self.chief]
                return state_lib.token(step, round_, own[0], own[1])

    def admit(self, step: tf.Tensor, round_: tf.Tensor) -> Verdict:
        """Takes events until the round is complete or lost a member."""
        s = self.shared
        with tf.device(self.device):
            with tf.control_dependencies([step, round_]):
                planned = state_lib.count(s.planned.read_value())
                # Admissions are kept on the ps: an admission cancelled
                # halfway (a session closed) goes on where it was.
                admitted = state_lib.count(s.admitted.read_value())
            needed = tf.maximum(planned - self.backup_workers, 1)
            def take_one(count, aborted):
                fresh, lost_member = self._take_event(step, round_)
                return count + tf.cast(fresh, tf.int32), aborted | lost_member
            count, aborted = tf.while_loop(
                lambda count, aborted: (count < needed) & ~aborted, take_one,
                [admitted, tf.constant(False)], parallel_iterations=1)
            with tf.control_dependencies([count, aborted]):
                rows = tf.where(s.admitted.read_value())[:, 0]
            return Verdict(~aborted, rows)

    def _take_event(self, step, round_) -> tuple:
        """(fresh, lost_member: bool []) of one event, the lock taken once
        it is in; a deposed chief gives it back and ends its round."""
        event = self.shared.events.dequeue()
        def give_back():
            with tf.control_dependencies([self.shared.events.enqueue(event)]):
                return tf.constant(False), tf.constant(True)
        return self.guarded(lambda: self._act_on(event, step, round_),
                            give_back, after=[event[0]])

    def _act_on(self, event, step, round_) -> tuple:
        """Acts on `event` by `decide`'s table: (kind, worker int32 [], step,
        round int64 [], sent_at float64 [] on ps 0's clock); step: int64 [].
        Returns (fresh, lost_member): bool []."""
        s = self.shared
        kind, worker, for_step, for_round, sent_at = event
        # Every read first, every write after them (a read racing a write
        # of the same event would see either value).
        roster = s.roster.read_value()
        inside = roster[worker]
        planned = s.planned.read_value()[worker]
        admitted = s.admitted.read_value()[worker]
        fresh_start = tf.equal(kind, state_lib.JOINED)  # measured afresh
        timed, examples_now, secs_now = self.pace.timing(
            kind, worker, for_round, sent_at, fresh_start, planned)
        abandon, bench_late = self.pace.late(kind, for_step, for_round, step,
                                             round_, sent_at)
        acts = decide(
            kind, inside, tf.not_equal(worker, self.chief), planned,
            admitted, tf.equal(for_step, step) & tf.equal(for_round, round_),
            timed, abandon)
        members = (state_lib.count(roster) - tf.cast(inside, tf.int32)
                   + tf.cast(acts.roster_now, tf.int32))
        with tf.control_dependencies([acts.roster_now, members, examples_now,
                                      secs_now, acts.unfinished, abandon]):
            ops = [bench_late, *self.pace.record(
                worker, for_round, timed, fresh_start, examples_now,
                secs_now),
                state_lib.set_at(s.admitted, worker[None],
                                 admitted | acts.fresh),
                state_lib.set_at(s.roster, worker[None], acts.roster_now),
                state_lib.set_if(s.last_push, worker, acts.pushed, for_round),
                s.dropped.assign_add(tf.cast(acts.dropped, tf.int64),
                                     read_value=False),
                queues.put_if(s.membership, acts.record,
                              (step, acts.record_kind, worker, members))]
        with tf.control_dependencies(ops):
            return tf.identity(acts.fresh), tf.identity(acts.lost_member)

    def unfinished_round(self, step: tf.Tensor) -> tf.Tensor:
        """step (int64 []) once every pull waiting for a turn behind a lost
        member (--ordered_pulls) is let through to push stale."""
        with tf.device(self.device), tf.control_dependencies(
                self.pull_turns.release_all()):
            return tf.identity(step)

    def absorb_queued(self) -> tf.Tensor:
        """Acts on the events queued now, without waiting (joins before the
        first step). Returns the roster after them (bool [N])."""
        s = self.shared
        with tf.device(self.device):
            step, round_ = s.global_step.read_value(), s.round.read_value()
            queued = s.events.size()
            def take(i):
                fresh, _ = self._take_event(step, round_)
                with tf.control_dependencies([fresh]):
                    return [i + 1]
            (taken,) = tf.while_loop(lambda i: i < queued, take,
                                     [tf.constant(0)], parallel_iterations=1)
            with tf.control_dependencies([taken]):
                return s.roster.read_value()

    def average(self, rows: tf.Tensor) -> tuple[list, tf.Tensor]:
        """(the example-weighted mean of `rows`' gradients, float32 [n_s]
        per shard on its ps; their stats summed, float32 [3])."""
        s = self.shared
        with tf.device(self.device):
            stats = tf.reduce_sum(s.stats.sparse_read(rows), axis=0)
        mean_grads = []
        for grads, device in zip(s.grads, s.shard_devices):
            with tf.device(device):
                # int32 rows (--deterministic) sum alike in any order.
                mean_grads.append(fixed_point.mean(
                    tf.reduce_sum(grads.sparse_read(rows), axis=0), stats[0],
                    s.fixed))
        return mean_grads, stats

    def count_and_advance(self, step: tf.Tensor, after: list) -> tf.Tensor:
        """After `after` (the update): counts the admitted workers and sets
        global_step = step + 1, which it returns (int64 [] on ps 0)."""
        s = self.shared
        with tf.device(self.device), tf.control_dependencies(after):
            # An admitted worker's stats row is this round's (its push).
            admitted = s.admitted.read_value()
            examples = tf.where(admitted, s.stats.read_value()[:, 0], 0.0)
            counted = s.contributions.assign_add(
                tf.stack([tf.cast(admitted, tf.int64),
                          tf.cast(tf.round(examples), tf.int64)], axis=1),
                read_value=False)
            recorded = step_record.record_step(
                s, self.global_batch, step, admitted, examples)
            with tf.control_dependencies([counted, recorded]):
                advance = s.global_step.assign(step + 1, read_value=False)
            with tf.control_dependencies([advance]):
                return tf.identity(step + 1)


def _assign_where(variable, where: tf.Tensor, value) -> tf.Operation:
    old = variable.read_value()
    new = tf.cast(value, old.dtype) + tf.zeros_like(old)
    return variable.assign(tf.where(where, new, old), read_value=False)


@dataclasses.dataclass
class Acts:
    """What one event does (each of shape [], like decide's inputs)."""
    pushed: tf.Tensor       # bool: a push; its round goes to last_push
    unfinished: tf.Tensor   # bool: planned in the round, not admitted yet
    fresh: tf.Tensor        # bool: the push is admitted (admitted |= it)
    dropped: tf.Tensor      # bool: a push neither admitted nor a probe's
    roster_now: tf.Tensor   # bool: the worker is in the roster after it
    record: tf.Tensor       # bool: a membership record is put
    record_kind: tf.Tensor  # like kind: the record's (JOINED, LOST, ...)
    lost_member: tf.Tensor  # bool: the round ends unfinished


def decide(kind, inside, other, planned, admitted, current, timed,
           abandon) -> Acts:
    """What the chief does with one event off sync/events (Averaging._act_on),
    with no variable in it: `decide` in the graph, its twin `decide_np`. In
    ('-': either): the worker is in the roster (in), the chief (ch), planned
    (pl), admitted (ad); the event is this step and round's (cu); a push is
    timed (ti, pace.timing). Out: the push is admitted (fresh) or dropped and
    counted (drop); the worker's roster bit after ("in": unchanged); the
    membership record put (its kind); the round ends unfinished (lost):

        kind             in ch pl ad cu ti | fresh  drop  roster  record  lost
        PUSHED           1  -  1  0  1  -  | 1      0     1       none    0
        PUSHED           1  -  1  0  0  -  | 0      1     1       none    0
        PUSHED           1  -  1  1  -  -  | 0      1     1       none    0
        PUSHED           1  -  0  -  -  1  | 0      0     1       none    0
        PUSHED           1  -  0  -  -  0  | 0      1     1       none    0
        PUSHED           0  -  1  0  1  -  | 1      0     1       JOINED  0
        PUSHED           0  -  1  0  0  -  | 0      1     1       JOINED  0
        PUSHED           0  -  1  1  -  -  | 0      1     1       JOINED  0
        PUSHED           0  -  0  -  -  -  | 0      1     1       JOINED  0
        JOINED           1  -  1  0  -  -  | 0      0     1       JOINED  1
        JOINED           1  -  1  1  -  -  | 0      0     1       JOINED  0
        JOINED           1  -  0  -  -  -  | 0      0     1       JOINED  0
        JOINED           0  -  -  -  -  -  | 0      0     1       JOINED  0
        LOST or LEAVING  1  0  1  0  -  -  | 0      0     0       kind    1
        LOST or LEAVING  1  0  1  1  -  -  | 0      0     0       kind    0
        LOST or LEAVING  1  0  0  -  -  -  | 0      0     0       kind    0
        LOST or LEAVING  1  1  -  -  -  -  | 0      0     1       none    0
        LOST or LEAVING  0  -  -  -  -  -  | 0      0     0       none    0
        LATE             -  -  -  -  -  -  | 0      0     in      none    0

    A LATE event that ends the round (Pace.late's `abandon`) sets lost.
    Inputs of shape [], or [B] for B events: kind (int32); inside (in),
    other (not ch), planned (pl), admitted (ad), current (cu), timed (ti),
    abandon (bool)."""
    pushed = tf.equal(kind, PUSHED)
    unfinished = planned & ~admitted
    fresh = pushed & current & unfinished
    probed = timed & inside & ~planned
    # A push from outside the roster: a worker given up on is alive after
    # all, and joins again. A probe's push from the roster is not dropped.
    joins = (tf.equal(kind, JOINED) | pushed) & ~inside
    leaves = (tf.equal(kind, LOST) | tf.equal(kind, LEAVING)) & inside & other
    # A member joining again was restarted: its old self will never push.
    restarted = tf.equal(kind, JOINED) & inside
    # A member left, was restarted, or is far too late: plan again.
    lost_member = abandon | ((leaves | restarted) & unfinished)
    return Acts(pushed, unfinished, fresh, pushed & ~(fresh | probed),
                joins | (inside & ~leaves), joins | leaves | restarted,
                tf.where(leaves, kind, JOINED), lost_member)


def decide_np(kind: int, inside: bool, other: bool, planned: bool,
              admitted: bool, current: bool, timed: bool,
              abandon: bool) -> dict:
    """`decide` in plain Python, row by row of its table: Acts
    but pushed and unfinished, as a dict (record_kind JOINED if none)."""
    fresh = record = lost = False
    dropped, roster, record_kind = kind == PUSHED, inside, JOINED
    unfinished = planned and not admitted
    if kind == PUSHED:
        fresh = unfinished and current
        dropped = not fresh and not (inside and not planned and timed)
        roster, record = True, not inside
    elif kind == JOINED:
        roster = record = True
        lost = inside and unfinished
    elif kind in (LOST, LEAVING) and inside and other:
        roster, record, record_kind = False, True, kind
        lost = unfinished
    return {"fresh": fresh, "dropped": dropped, "roster_now": roster,
            "record": record, "record_kind": np.int32(record_kind),
            "lost_member": lost or abandon}
