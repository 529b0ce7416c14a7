"""The sync rule: who computes what in a step, what is averaged, when the
step is applied. Change the rule here.

The invariants it keeps (what checks each: docs/how-it-works.md):

I1. The update applied at step t is the mean, over exactly the global
    batch of step t (each example once), of per-example gradients at the
    parameters after step t - 1 (step_record.py records the first half).
I2. A push for (step, round) is admitted only in that round of that
    step, at most once (_take_event's `fresh`).
I3. The global step never goes back: only count_and_advance sets it, to
    t + 1 after step t's update.
I4. A worker out of the round (not in the roster, or benched) is given no
    slice; a probe's push is timed, never admitted.
I5. A member reads the parameters for step t only after step t - 1 is
    applied: its token comes from the plan, which runs after the update.
I6. A worker alive and reachable is taken back in: a push from outside
    the roster, or a JOINED, puts it in the next plan; one cut off for
    longer than --worker_timeout_secs joins again once ps 0 answers.
I7. At most one chief acts: every write here happens only while ps 0's
    lock holds this chief's generation (`guarded`, trainer/sync/chief_lock.py).

For global step t the chief runs rounds until one completes:

1. Plan: cut the global batch into one slice per member of the roster
   (trainer/sync/slices.py: equal, or balanced by measured speed), bump
   the round number r and hand member k the token (t, r, first, end).
2. Each member pulls the parameters, pushes the sum of its per-example
   gradients over its slice into its row (trainer/sync/transport.py) and
   announces (PUSHED, k, t, r).
3. Admit: take events until every member of round r has pushed for
   (t, r) (with --backup_workers=b, all but b). A push for another step
   or round is stale: dropped and counted. A worker that joins is in the
   next plan. A member that leaves (lost, or SIGTERM) before pushing ends
   the round unfinished; so does a member far past the round's deadline
   (balanced slices, trainer/sync/pace.py), which is then benched.
4. If the round finished: apply the admitted rows' sum divided by their
   example count, the gradient of the whole global batch (without
   backups); count each admitted worker; set global_step = t + 1. If
   not: plan step t again among those left, who compute the lost
   worker's examples. Nothing applied is ever redone.

Why this is exact whoever computes: each row is a gradient sum over its
slice, and dropout masks depend on the example, not the worker
(trainer/learning/replica.py), so a step's average does not depend on
how its batch was cut or who computed which slice.

Why not plain `SyncReplicasOptimizer`: its workers share one token
queue, so a fast worker can take a slow one's token and count twice in a
step. Here every worker has its own token queue and row.
"""

import dataclasses

import tensorflow as tf

from trainer.learning import fixed_point
from trainer.sync import act_table
from trainer.sync import pace as pace_lib
from trainer.sync import queues
from trainer.sync import slices as slices_lib
from trainer.sync import state as state_lib
from trainer.sync import step_record
from trainer.sync.state import JOINED, set_at as _set

# Balanced slices are cut only where the speeds predict rounds at least
# this much shorter than with equal slices (slices.prefer).
BALANCE_GAIN = 0.2


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
        """micro_batch: slices are whole micro-batches of this many rows
        (--micro_batch; 0: of single rows). chief: the worker that runs
        the rule. lock, generation: the ChiefLock and this chief's
        generation (int64 [] on ps 0) that guard every write
        (`guarded`); without a lock (the protocol's unit tests) the
        writes are not guarded."""
        self.shared, self.global_batch = shared, global_batch
        self.chief, self.lock, self.generation = chief, lock, generation
        self.unit = micro_batch or 1
        self.backup_workers, self.slices = backup_workers, slices
        self.pull_turns = pull_turns
        self.device = shared.shard_devices[0]
        self.pace = pace_lib.Pace(shared, slices, backup_workers, chief)

    def guarded(self, write, refused, after=()):
        """write() while the lock holds this chief's generation, else
        refused() (trainer/sync/chief_lock.py), the lock taken after
        `after`; write() without a lock."""
        if self.lock is None:
            return write()
        return self.lock.guarded(self.generation, write, refused, after)

    def plan(self, step: tf.Tensor) -> tuple:
        """Starts a round of step `step` (int64 []): slices for the roster,
        tokens to the other members (and a probe to a benched worker).
        Returns (planned: bool [], false if a newer chief holds the lock;
        the chief's token, int64 [4])."""
        with tf.device(self.device):
            return self.guarded(
                lambda: (tf.constant(True), self._plan(step)),
                lambda: (tf.constant(False), state_lib.token(step)))

    def _plan(self, step: tf.Tensor) -> tf.Tensor:
        s = self.shared
        with tf.device(self.device):
            roster, speed = s.roster.read_value(), s.speed.read_value()
            out = self.pace.benched(roster)
            # With fewer micro-batches than members, the last members sit
            # the round out: an empty slice would be timed as a member's.
            members = slices_lib.at_most(
                tf.logical_and(roster, tf.logical_not(out)),
                self.global_batch // self.unit, self.chief)
            weight = slices_lib.weights(speed, members, self.slices)
            batch, unit = self.global_batch, self.unit
            cut = slices_lib.prefer(
                slices_lib.bounds(tf.cast(members, tf.float32), batch, unit),
                slices_lib.bounds(weight, batch, unit), weight,
                BALANCE_GAIN)
            now = tf.timestamp()
            probe, count_benched = self.pace.probes(now, out)
            given = tf.logical_or(members, probe)
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

            def open_(count, aborted):
                return tf.logical_and(count < needed, tf.logical_not(aborted))

            def take_one(count, aborted):
                fresh, lost_member = self._take_event(step, round_)
                return (count + tf.cast(fresh, tf.int32),
                        tf.logical_or(aborted, lost_member))

            count, aborted = tf.while_loop(
                open_, take_one, [admitted, tf.constant(False)],
                parallel_iterations=1)
            with tf.control_dependencies([count, aborted]):
                rows = tf.where(s.admitted.read_value())[:, 0]
            return Verdict(tf.logical_not(aborted), rows)

    def _take_event(self, step, round_) -> tuple:
        """One event off sync/events, acted on. Returns (fresh push for
        this round: bool [], a member of the round left unfinished: bool
        []). A chief whose generation is over puts the event back for the
        newer chief and ends its round."""
        event = self.shared.events.dequeue()

        def give_back():
            with tf.control_dependencies([self.shared.events.enqueue(event)]):
                return tf.constant(False), tf.constant(True)

        # The lock only once an event is in: not held while waiting.
        return self.guarded(lambda: self._act_on(event, step, round_),
                            give_back, after=[event[0]])

    def _act_on(self, event, step, round_) -> tuple:
        """Acts on one event (kind, worker: int32 []; its step, round:
        int64 []; sent_at: float64 [], ps 0's clock) in round `round_` of
        step `step` (int64 []), as trainer/sync/act_table.py's table
        says: admits a push, times it, drops a stale one, takes a worker
        into or out of the roster with a membership record, or ends the
        round. Returns (fresh: bool [], lost_member: bool []), `decide`'s.
        """
        s = self.shared
        kind, worker, for_step, for_round, sent_at = event
        # Every read first, every write after them (a read racing a write
        # of the same event would see either value).
        roster = s.roster.read_value()
        inside = roster[worker]
        planned = s.planned.read_value()[worker]
        admitted = s.admitted.read_value()[worker]
        # A worker (re)joining is measured afresh.
        fresh_start = tf.equal(kind, JOINED)
        timed, examples_now, secs_now = self.pace.timing(
            kind, worker, for_round, sent_at, fresh_start, planned)
        abandon, bench_late = self.pace.late(kind, for_step, for_round, step,
                                             round_, sent_at)
        acts = act_table.decide(
            kind, inside, tf.not_equal(worker, self.chief), planned,
            admitted, tf.logical_and(tf.equal(for_step, step),
                                     tf.equal(for_round, round_)),
            timed, abandon)
        members = (state_lib.count(roster) - tf.cast(inside, tf.int32)
                   + tf.cast(acts.roster_now, tf.int32))
        one = worker[None]
        with tf.control_dependencies([acts.roster_now, members, examples_now,
                                      secs_now, acts.unfinished, abandon]):
            ops = [bench_late, *self.pace.record(
                worker, for_round, timed, fresh_start, examples_now,
                secs_now),
                _set(s.admitted, one, tf.logical_or(admitted, acts.fresh)),
                _set(s.roster, one, acts.roster_now),
                state_lib.set_if(s.last_push, worker, acts.pushed, for_round),
                s.dropped.assign_add(tf.cast(acts.dropped, tf.int64),
                                     read_value=False),
                queues.put_if(s.membership, acts.record,
                              (step, acts.record_kind, worker, members))]
        with tf.control_dependencies(ops):
            return tf.identity(acts.fresh), tf.identity(acts.lost_member)

    def unfinished_round(self, step: tf.Tensor) -> tf.Tensor:
        """After a round that lost a member: lets through every pull that
        waits for a turn (a member stuck behind the lost one in an order
        of --ordered_pulls), so it pushes, stale, and takes the new round's
        token. Returns step (int64 [])."""
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
        """The example-weighted mean of the gradients in `rows` (admit):
        (mean_grads, float32 [n_s] per shard on its ps; stats, float32 [3]
        summed over the admitted workers)."""
        s = self.shared
        with tf.device(self.device):
            stats = tf.reduce_sum(s.stats.sparse_read(rows), axis=0)
        mean_grads = []
        for grads, device in zip(s.grads, s.shard_devices):
            with tf.device(device):
                # int32 rows (--deterministic) add up to the same sum
                # in any order; float32 rows to nearly the same.
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
    """variable[k] = value where where[k] (bool [N]), else unchanged."""
    old = variable.read_value()
    return variable.assign(tf.where(where, tf.cast(value, old.dtype) +
                                    tf.zeros_like(old), old),
                           read_value=False)
