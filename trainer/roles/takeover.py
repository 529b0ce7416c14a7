"""The chief's work moves: claiming the chief's role, the chief's beat, and
the watch by which the other workers find a lost chief.

The chief's process beats: every timing.BEAT_SECS it adds one to the
beats of its record on ps 0 (`sync/chief`: generation, worker index, beats;
see trainer/sync/chief_lock.py). Every other worker watches that record
beside its training runs, and calls the chief lost once the silence rule
(liveness.lost) says so of its beats.

Then the worker with the lowest index among the others in the roster
posts CHIEF_LOST at once (trainer/roles/states.py); the next one a
further --worker_timeout_secs later, in case the first is lost too; and
so on. A claim made meanwhile by another worker shows as a new
generation, which resets the watch. In the CLAIMING state the worker
claims first, with a beat of its own (`Claim`), and then builds the
chief's side in its process (run.Roles._claim), which can take long on
a slow host: meanwhile the others see the new chief's beat and wait.
The new chief goes on from the state on the ps tasks: no step is
redone.
"""

import dataclasses
import time
from typing import Callable

import tensorflow as tf

from trainer.cluster import devices
from trainer.cluster import ports
from trainer.roles import liveness
from trainer.roles import timing
from trainer.roles.states import Event, Kind
from trainer.roles import sessions
from trainer.roles.background import BackgroundThread
from trainer.sync import mirrors
from trainer.sync.chief_lock import BEATS, GENERATION, INDEX, ChiefLock



@dataclasses.dataclass(frozen=True)
class TakeOver:
    """A worker taking over the chief's work: why, and its Claim."""
    reason: str
    claim: "Claim"


class BeatSession:
    """The chief's beat, from a session of our own (sessions.Own:
    a beat on the training session would queue behind its first runs
    after each connect) that lives as long as the chief's role, across
    connects. A beat lands only while the record is the beating chief's:
    a chief deposed meanwhile keeps no successor's alive."""

    def __init__(self, target: str, task, config):
        graph = tf.Graph()
        with graph.as_default():
            lock = ChiefLock(devices.ps_device(0))
            self._generation = tf.compat.v1.placeholder(tf.int64, [],
                                                        "generation")
            self._beat = lock.beat_in(self._generation)
        # A beat later than this is as good as none to the others.
        self._session = sessions.Own(target, graph, config, task, [0], int(
            config.worker_timeout_secs * 1000))

    def beat(self, generation: int) -> bool:
        """Whether the beat landed; raises tf.errors.OpError if ps 0 does
        not answer."""
        return bool(self._session.run(self._beat,
                                      {self._generation: generation}))

    def close(self) -> None:
        self._session.close()


class Claim:
    """A worker's claim of the chief's role, made before the worker builds
    the chief's graph, with a beat of its own until `handed_over()` (once
    the chief's BeatSession has landed a beat: ChiefBeat). generation, lost: as
    `claim` returns them; previous: the worker index of the chief it
    replaces. ps_down: the ps the worker's graph does without
    (trainer/roles/without_ps.py), or None."""

    def __init__(self, target: str, task, config, index: int,
                 ps_down: int | None = None):
        self._session, self.lock = lock_session(
            target, task, config,
            generation_copy_device(config, ps_down))
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
    """(a session, the ChiefLock): a graph of the lock alone, for a worker
    that claims or asks about the chief's role outside its own graph.
    copy_device: where the generation's copy is (generation_copy_device),
    or None for a session that only reads; the session uses ps 0 and that ps
    only, so that a ps done without does not hold it up."""
    graph = tf.Graph()
    with graph.as_default():
        lock = ChiefLock(devices.ps_device(0), copy_device)
    ps_tasks = [0] + ([mirrors.PS0_COPIES] if copy_device else [])
    return sessions.open_session(target, graph, config, task, ps_tasks), lock


def claim(session, lock, index: int, wait_secs: float) -> tuple[int, bool]:
    """Makes worker `index` the chief: takes the generation out of the lock and
    puts back the next one. Returns (this chief's generation, lost), lost if a
    claim found the lock empty for `wait_secs`: a chief was killed inside
    a write, which may be half done, so the newest checkpoint must be
    restored. A claim on a fresh ps 0 (the run's first, or after ps 0
    was started again) finds no record and no generation, waits for none, and
    goes on from the generation's copy where there is one."""
    previous, lost = 0, False
    if not session.run(lock.is_recorded):
        previous = int(session.run(lock.last_generation))
    else:
        options = tf.compat.v1.RunOptions(
            timeout_in_ms=int(wait_secs * 1000))
        try:
            previous = int(session.run(lock.take, options=options))
        except tf.errors.DeadlineExceededError:
            previous, lost = int(session.run(lock.recorded)[GENERATION]), True
    generation = previous + 1
    session.run(lock.put, {lock.generation_in: generation,
                           lock.index_in: index})
    return generation, lost


def claim_wait(config) -> float:
    """How long a claim waits for the lock (timing.CLAIM_WAIT_SHARE)."""
    return config.worker_timeout_secs * timing.CLAIM_WAIT_SHARE


def deposed_by(session, lock, generation: int, options=None) -> int | None:
    """The worker that claimed the chief's role after `generation`, or None:
    a chief so deposed applied nothing since (trainer/sync/chief_lock.py).
    A fresh ps 0 (no record yet) has no other chief. options: RunOptions
    of the read, or None."""
    try:
        recorded = session.run(lock.recorded, options=options)
    except tf.errors.FailedPreconditionError:
        return None
    return None if recorded[GENERATION] == generation else int(recorded[INDEX])


class ChiefBeat(BackgroundThread):
    """The chief's beat: beat() every timing.BEAT_SECS while the chief runs;
    beat() returns False when it did not land (a deposed chief's).

    claim: the Claim of a worker taking over, or None. Its beat stops
    only once this one has landed (or this one stops): between the two,
    a slow host's start (the summary writer, the callables) could leave
    the record silent for --worker_timeout_secs, and another worker
    would take over from a chief that is fine.
    """

    def __init__(self, beat: Callable[[], bool | None], claim=None,
                 ours: Callable[[], bool] = lambda: True):
        """ours() says whether the chief's role is claimed yet: until it
        is, nothing beats but the takeover's claim."""
        super().__init__("chief-beat", timing.BEAT_SECS, timing.BEAT_SECS * 4)
        self._beat, self._claim, self._ours = beat, claim, ours

    def run_once(self) -> None:
        if not self._ours():
            return
        try:
            landed = self._beat()
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


@dataclasses.dataclass
class Judge:
    """Decides from readings of the chief's record when worker `me` takes
    over (pure: the watch below feeds it, tests too)."""

    me: int
    timeout: float                      # --worker_timeout_secs
    refuses: Callable[[int], bool]      # worker k's port refuses now
    starting: float = 0.0               # --startup_timeout_secs
    _seen: tuple | None = None     # (generation, beats) last seen
    _start: tuple | None = None    # (generation, step) at its first reading
    _since: float = 0.0                 # when they last changed
    _lost_at: float | None = None
    _why: str = ""                      # why it was called lost

    def forget(self) -> None:
        """ps 0 did not answer: silence is measured anew from the next
        reading (a chief cut off from ps 0 with us is not judged by it)."""
        self._seen = None

    def update(self, record, roster, now: float, read_secs: float = 0.0,
               step: int | None = None) -> str | None:
        """record: int64 [3] (generation, index, beats); roster: bool [N];
        read_secs: how long the reading took; step: the global step
        (None: unknown). Returns why to take over now, or None."""
        if read_secs > self.timeout / 2:
            # ps 0 stalled (stopped, cut off) while we read: the chief's
            # beats could not land either, so the silence is not its own.
            self.forget()
        chief = int(record[INDEX])
        seen = (int(record[GENERATION]), int(record[BEATS]))
        self._note_start(seen[0], step)
        if seen != self._seen or chief == self.me:
            self._seen, self._since, self._lost_at = seen, now, None
            return None
        if self._lost_at is None:
            why = liveness.lost(now - self._since, *self._limit(), "beat",
                                lambda: self.refuses(chief))
            if why is None:
                return None
            self._why, self._lost_at = why, now
        if now - self._lost_at >= (
                place_in_line(roster, chief, self.me) * self.timeout):
            return f"worker {chief} left: {self._why}"
        return None

    def _note_start(self, generation: int, step: int | None) -> None:
        """Keeps (generation, the step at its first reading), the step None
        once it has moved: the chief has started."""
        if step is None:
            return
        if self._start is None or self._start[0] != generation:
            self._start = (generation, step)
        elif step != self._start[1]:
            self._start = (generation, None)

    def _limit(self) -> tuple:
        """(the silence after which the chief is lost, its flag). A chief
        that has taken no step since this worker first read its generation is
        still starting: its first runs on fresh sessions have held its
        beat back for longer than --worker_timeout_secs on a starved host
        (docs/nemesis.md), so it is given --startup_timeout_secs. A port
        that refuses is judged as fast either way."""
        if (self._start is not None and self._start[1] is not None
                and self.starting > self.timeout):
            return self.starting, "--startup_timeout_secs, in its start"
        return self.timeout, "--worker_timeout_secs"


class ChiefWatch(BackgroundThread):
    """A worker's watch on the chief (a context manager around its
    training runs): posts CHIEF_LOST once Judge says the chief is lost,
    or ENDED_AWAY if it is gone after the last step (states.py)."""

    def __init__(self, read: Callable[[], tuple], judge: Judge,
                 post: Callable[[Event], bool], train_steps: int):
        """read: () -> (record int64 [3], roster bool [N], global step
        int64 []) from ps 0; post: the worker's Machine.post."""
        super().__init__("chief-watch", timing.BEAT_SECS, timing.BEAT_SECS * 4)
        self._read, self._judge, self._post = read, judge, post
        self._train_steps = train_steps

    def run_once(self) -> bool | None:
        started = time.monotonic()
        try:
            record, roster, step = self._read()
        except Exception:  # noqa: BLE001 (no record yet, or ps 0 away)
            self._judge.forget()
            return None
        now = time.monotonic()
        reason = self._judge.update(record, roster, now, now - started,
                                    int(step))
        if reason is None:
            return None
        if step >= self._train_steps:
            # The chief ended the run and exited while this worker was cut
            # off or frozen (ps 0 has not exited yet): a chief now would
            # wait for ps tasks that are gone.
            self._post(Event(Kind.ENDED_AWAY, (
                f"the run ended at step {int(step)}, its last, while this "
                "worker was away; nothing is left to do")))
        else:
            self._post(Event(Kind.CHIEF_LOST, reason))
        return False


def place_in_line(roster, chief: int, me: int) -> int:
    """How many workers claim the chief's role before worker `me`: those
    of a lower index in the roster (bool [N]), the chief aside."""
    return sum(1 for k, inside in enumerate(roster[:me])
               if inside and k != chief)


def generation_copy_device(config, ps_down: int | None = None) -> str | None:
    """Where the chief's generation has a copy: with --ps_mirrors, where ps 0's
    other state has its copies, unless that ps is down."""
    return (devices.ps_device(mirrors.PS0_COPIES) if config.ps_mirrors
            and ps_down != mirrors.PS0_COPIES else None)


def port_refuses(cluster) -> Callable[[int], bool]:
    """k -> worker k's port refuses connections now (0.5 s at most)."""
    return lambda k: ports.answer(cluster.workers[k], 0.5,
                                  "worker") == ports.REFUSED


def acting_chief(target: str, task, config) -> int | None:
    """The worker that does the chief's work now, if its beat goes on
    (read twice, timing.BEAT_SECS x 6 apart); None if none does, or ps 0 does
    not answer (a first start: then there is none). Call it once ps 0
    accepts connections: a chief started again while its own link is
    still down must not take the role back from a worker that took it
    over meanwhile."""
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
