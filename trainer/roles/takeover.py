"""Exactly one chief: the lock on ps 0, the claim of the role, the beat
(docs/how-it-works.md, "Exactly one chief", "The chief's work moves").

A chief cut off still has its loop on ps 0, which writes once its link
returns. The lock, a queue of capacity 1 on ps 0, holds the generation:
a claim takes it (after a write in flight) and puts back the next; one a
chief killed in a write never put back is restored (claim_wait). ps 1
keeps a copy with --ps_mirrors: a ps 0 started again gives out none twice.

Every write a chief makes on the ps tasks, and what refuses it to a
deposed one (tests/test_guards.py checks it on the graph, op by op):
- the lock (`guarded`): a round's plan and each event's acts (sync/
  averaging.py), a step's update and advance (roles/step.py), the halt
  (sync/coordination.py); its loop ends once `current` is false;
- the record (`if_current`, a read then the write: a claim in between
  lets one through): the beat session's, the membership watch's LOST,
  take of the roster changes and log (roles/graph.py);
- `deposed_by` just before (Chief._check_still_chief): init, restore,
  refill, start (storage word, ready), stop; the end after a last step;
- none, and harmless: its push (not of the current round), an event
  taken (put back if refused), a beat in a round planned before the
  claim or a claim's own, pull turns passed or RELEASEd (costing only
  their order), the deadlines' take and LATE (of their round only), a
  checkpoint after a loop run (of steps it applied)."""

import time
from typing import Callable, NamedTuple

import tensorflow as tf

from trainer.cluster import devices
from trainer.roles import sessions, timing
from trainer.roles.background import BackgroundThread
from trainer.sync import mirrors

GENERATION, INDEX, BEATS = 0, 1, 2   # the fields of sync/chief
GUARD = "chief_guard"   # the name scope of a guard's cond (a test finds it)


class ChiefLock:
    """The lock and `sync/chief` (int64 [3]: generation, worker index,
    beats) on ps 0, built alike by every worker; it outlives restores."""

    def __init__(self, device: str, copy_device: str | None = None):
        """copy_device: where the last claimed generation is copied (ps 1
        with --ps_mirrors), or None. A claim's ops (`claim`): take
        (waits while the lock is out), put (records generation_in, index_in,
        0 beats, then fills the lock), recorded (int64 [3]; fails before the
        first claim), size (1 while the lock is in), last_generation."""
        self.device = device
        with tf.device(device):
            self.queue = tf.queue.FIFOQueue(
                1, [tf.int64], shapes=[[]], shared_name="sync/chief_lock",
                name="sync_chief_lock")
            self.record = _unsaved("sync/chief", [3])
            # int64 [] feed: the generation of the loop that writes (-1: none).
            self.loop_generation = tf.compat.v1.placeholder_with_default(
                tf.constant(-1, tf.int64), [], "chief_generation")
            self.take = self.queue.dequeue()
            self.size = self.queue.size()
            self.generation_in = tf.compat.v1.placeholder(tf.int64, [],
                                                          "generation_in")
            self.index_in = tf.compat.v1.placeholder(tf.int64, [], "index_in")
            recorded = [self.record.assign(
                tf.stack([self.generation_in, self.index_in,
                          tf.constant(0, tf.int64)]), read_value=False)]
            self.last_generation = tf.constant(0, tf.int64)
            if copy_device is not None:
                with tf.device(copy_device):
                    copy = _unsaved("ps_mirror/chief_generation", [])
                    recorded.append(copy.assign(self.generation_in,
                                                read_value=False))
                    self.last_generation = tf.cond(
                        copy.is_initialized(), copy.read_value,
                        lambda: tf.constant(0, tf.int64))
            with tf.control_dependencies(recorded):
                self.put = self.queue.enqueue(self.generation_in)
            self.recorded = self.record.read_value()
            self.is_recorded = self.record.is_initialized()
            self.beat = self.beat_op()

    def guarded(self, generation: tf.Tensor, write, refused, after=()):
        """write() if the lock holds `generation` (int64 []), else refused()
        (alike structures of tensors), once the lock is back. The take waits
        for `after`: with no input it would run at once, and a run aborted
        while it waits (a ps lost) would lose the lock."""
        with tf.device(self.device), tf.control_dependencies(after):
            held = self.queue.dequeue()
            with tf.name_scope(GUARD):
                out = tf.cond(tf.equal(held, generation), write, refused)
            flat = tf.nest.flatten(out)
            with tf.control_dependencies(flat):
                put = self.queue.enqueue(held)
            with tf.control_dependencies([put]):
                return tf.nest.pack_sequence_as(
                    out, [tf.identity(t) for t in flat])

    def current(self, generation: tf.Tensor) -> tf.Tensor:
        """bool []: `generation` is recorded (a cheap read; see guarded)."""
        with tf.device(self.device):
            return tf.equal(self.record.read_value()[GENERATION], generation)

    def if_current(self, generation: tf.Tensor, write, refused=None):
        """bool []: write() (an op, made here) ran, as it does if generation
        (int64 []) is recorded; with refused, write()'s tensors, else
        refused()'s (alike). The cheap check, for writes beside the loop
        (the beat, the watches'), which must not wait on a claim's lock."""
        def ran():
            with tf.control_dependencies([write()]):
                return tf.constant(True)
        branch = write if refused else ran
        with tf.device(self.device), tf.name_scope(GUARD):
            return tf.cond(self.current(generation), branch,
                           refused or (lambda: tf.constant(False)))

    def beat_op(self) -> tf.Operation:
        """Adds a beat to the record (a new op: one inside a loop's body
        runs at every iteration)."""
        with tf.device(self.device):
            return tf.raw_ops.ResourceScatterAdd(
                resource=self.record.handle, indices=[BEATS],
                updates=tf.constant([1], tf.int64))


def _unsaved(name: str, shape: list) -> tf.Variable:
    return tf.compat.v1.get_variable(
        name, shape, tf.int64, initializer=tf.compat.v1.zeros_initializer(),
        trainable=False, use_resource=True, collections=[])


class TakeOver(NamedTuple):
    """A worker taking over the chief's work: why, and its Claim."""
    reason: str
    claim: "Claim"


class BeatSession:
    """The chief's beat from a session of its own across connects (why:
    docs/how-it-works.md); it lands only in the beater's generation."""

    def __init__(self, target: str, task, config):
        graph = tf.Graph()
        with graph.as_default():
            lock = ChiefLock(devices.ps_device(0))
            self._generation = tf.compat.v1.placeholder(
                tf.int64, [], "generation")
            self._beat = lock.if_current(self._generation, lock.beat_op)
        # A beat later than this is as good as none to the others.
        self._session = sessions.Own(target, graph, config, task, [0],
                                     int(config.worker_timeout_secs * 1000))

    def beat(self, generation: int) -> bool:
        """Whether it landed; raises tf.errors.OpError if ps 0 is silent."""
        return bool(self._session.run(self._beat,
                                      {self._generation: generation}))

    def close(self) -> None:
        self._session.close()


class Claim:
    """A worker's claim, made before it builds the chief's graph, beating
    until `handed_over()`. generation, lost: from `claim`; previous: the
    chief it replaces; ps_down: the ps its graph does without, or None."""

    def __init__(self, target: str, task, config, index: int,
                 ps_down: int | None = None):
        self._session, self.lock = lock_session(
            target, task, config, generation_copy_device(config, ps_down))
        self.previous = int(self._session.run(self.lock.recorded)[INDEX])
        self.generation, self.lost = claim(self._session, self.lock, index,
                                           claim_wait(config))
        self._beat = ChiefBeat(lambda: self._session.run(self.lock.beat))
        self._beat.start()

    def handed_over(self) -> None:
        """The chief's own beat runs now: this one stops."""
        self._beat.stop()
        sessions.close_within(self._session)


def lock_session(target: str, task, config, copy_device: str | None):
    """(session, ChiefLock) on the lock alone; uses only ps 0, copy_device."""
    graph = tf.Graph()
    with graph.as_default():
        lock = ChiefLock(devices.ps_device(0), copy_device)
    ps_tasks = [0] + ([mirrors.PS0_COPIES] if copy_device else [])
    return sessions.open_session(target, graph, config, task, ps_tasks), lock


def claim(session, lock, index: int, wait_secs: float) -> tuple[int, bool]:
    """Makes worker `index` the chief: takes the generation out of the lock
    (a fresh ps 0's: its copy's, if any), puts back the next. Returns (it,
    lost): lost if the lock stayed empty `wait_secs` (killed in a write)."""
    previous, lost = 0, False
    if not session.run(lock.is_recorded):
        previous = int(session.run(lock.last_generation))
    else:
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(wait_secs * 1000))
        try:
            previous = int(session.run(lock.take, options=options))
        except tf.errors.DeadlineExceededError:
            previous, lost = int(session.run(lock.recorded)[GENERATION]), True
    session.run(lock.put, {lock.generation_in: previous + 1,
                           lock.index_in: index})
    return previous + 1, lost


def claim_wait(config) -> float:
    """How long a claim waits for the lock (timing.CLAIM_WAIT_SHARE)."""
    return config.worker_timeout_secs * timing.CLAIM_WAIT_SHARE


def deposed_by(session, lock, generation: int, options=None) -> int | None:
    """Who claimed the role after `generation`, or None (a fresh ps 0 too)."""
    try:
        recorded = session.run(lock.recorded, options=options)
    except tf.errors.FailedPreconditionError:
        return None
    return None if recorded[GENERATION] == generation else int(recorded[INDEX])


class ChiefBeat(BackgroundThread):
    """Calls beat() (False: it did not land) every timing.BEAT_SECS once
    ours(); a takeover's `claim` beats on until ours lands (or stops)."""

    def __init__(self, beat: Callable[[], bool | None], claim=None,
                 ours: Callable[[], bool] = lambda: True):
        super().__init__("chief-beat", timing.BEAT_SECS, timing.BEAT_SECS * 4)
        self._beat, self._claim, self._ours = beat, claim, ours

    def run_once(self) -> None:
        try:
            landed = self._ours() and self._beat()
        except Exception:  # noqa: BLE001 (ps 0 away: the watchdogs judge)
            return
        if landed is not False:
            self._hand_over()

    def stop(self) -> None:
        super().stop()
        self._hand_over()

    def _hand_over(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.handed_over()


def generation_copy_device(config, ps_down: int | None = None) -> str | None:
    """ps PS0_COPIES' device with --ps_mirrors unless it is down, else None."""
    return (devices.ps_device(mirrors.PS0_COPIES) if config.ps_mirrors
            and ps_down != mirrors.PS0_COPIES else None)


def acting_chief(target: str, task, config) -> int | None:
    """The worker doing the chief's work if its beat goes on (two reads,
    timing.BEAT_SECS x 6 apart), else None (also if ps 0 is silent). Call
    it once ps 0 answers: a chief restarted while its own link is still
    down must not take the role back from a worker that took it over."""
    options = tf.compat.v1.RunOptions(timeout_in_ms=10000)
    session, lock = lock_session(target, task, config, None)
    try:
        with session:
            if not session.run(lock.is_recorded, options=options):
                return None
            first = session.run(lock.recorded, options=options)
            time.sleep(timing.BEAT_SECS * 6)
            then = session.run(lock.recorded, options=options)
    except tf.errors.OpError:
        return None
    if then[GENERATION] != first[GENERATION] or then[BEATS] == first[BEATS]:
        return None
    return int(then[INDEX])
