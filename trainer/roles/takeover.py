"""The chief's work moves (docs/how-it-works.md#the-chiefs-work-moves): the
claim of the chief's role, the chief's beat on its record on ps 0
(trainer/sync/chief_lock.py), and the other workers' watch on that beat,
which finds a lost chief and orders the claims (lowest index first)."""

import dataclasses
import time
from typing import Callable

import tensorflow as tf

from trainer.cluster import devices, ports
from trainer.roles import liveness, sessions, timing
from trainer.roles.background import BackgroundThread
from trainer.roles.states import Event, Kind
from trainer.sync import mirrors
from trainer.sync.chief_lock import BEATS, GENERATION, INDEX, ChiefLock


@dataclasses.dataclass(frozen=True)
class TakeOver:
    """A worker taking over the chief's work: why, and its Claim."""
    reason: str
    claim: "Claim"


class BeatSession:
    """The chief's beat, from a session of its own across connects (on the
    training session it would queue behind each connect's first runs); it
    lands only while the record is the beater's: no successor kept alive."""

    def __init__(self, target: str, task, config):
        graph = tf.Graph()
        with graph.as_default():
            lock = ChiefLock(devices.ps_device(0))
            self._generation = tf.compat.v1.placeholder(
                tf.int64, [], "generation")
            self._beat = lock.beat_in(self._generation)
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
    """A worker's claim of the chief's role, made before it builds the
    chief's graph; it beats on its own until `handed_over()` (ChiefBeat).
    generation, lost: as `claim` returns them; previous: the index of the
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
    """(a session, the ChiefLock) on a graph of the lock alone. copy_device:
    the generation's copy (generation_copy_device), or None to only read.
    It uses ps 0 and that ps only: a ps done without does not hold it up."""
    graph = tf.Graph()
    with graph.as_default():
        lock = ChiefLock(devices.ps_device(0), copy_device)
    ps_tasks = [0] + ([mirrors.PS0_COPIES] if copy_device else [])
    return sessions.open_session(target, graph, config, task, ps_tasks), lock


def claim(session, lock, index: int, wait_secs: float) -> tuple[int, bool]:
    """Makes worker `index` the chief: takes the generation out of the lock
    (a fresh ps 0 has none: its copy's, if any) and puts back the next.
    Returns (it, lost): lost if the lock stayed empty `wait_secs`, a chief
    killed inside a write, so the newest checkpoint must be restored."""
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
    """The worker that claimed the chief's role after `generation`, or None
    (also on a fresh ps 0). options: RunOptions of the read."""
    try:
        recorded = session.run(lock.recorded, options=options)
    except tf.errors.FailedPreconditionError:
        return None
    return None if recorded[GENERATION] == generation else int(recorded[INDEX])


class ChiefBeat(BackgroundThread):
    """Calls beat() every timing.BEAT_SECS once ours() says the role is
    claimed; beat() returns False when it did not land (a deposed chief's).
    claim: a takeover's Claim, or None; its beat stops only once this one
    has landed (or stops), lest a slow start leave the record silent."""

    def __init__(self, beat: Callable[[], bool | None], claim=None,
                 ours: Callable[[], bool] = lambda: True):
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
    _start: tuple | None = None    # (generation, first step; None if moved)
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
        if step is not None:   # a step that moved: the chief has started
            if self._start is None or self._start[0] != seen[0]:
                self._start = (seen[0], step)
            elif step != self._start[1]:
                self._start = (seen[0], None)
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

    def _limit(self) -> tuple:
        """(the silence after which the chief is lost, its flag): a chief
        with no step since we first read its generation is still starting
        and gets --startup_timeout_secs (docs/how-it-works.md)."""
        if (self._start is not None and self._start[1] is not None
                and self.starting > self.timeout):
            return self.starting, "--startup_timeout_secs, in its start"
        return self.timeout, "--worker_timeout_secs"


class ChiefWatch(BackgroundThread):
    """A worker's watch on the chief, around its training runs: posts
    CHIEF_LOST once Judge calls the chief lost, or ENDED_AWAY if it is gone
    after the last step. read: () -> (record int64 [3], roster bool [N],
    global step int64 []) from ps 0; post: the worker's Machine.post."""

    def __init__(self, read: Callable[[], tuple], judge: Judge,
                 post: Callable[[Event], bool], train_steps: int):
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
            # The chief ended the run and exited while we were cut off or
            # frozen (ps 0 not yet gone): a chief now would wait for no ps.
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
    """Where the chief's generation has a copy: with --ps_mirrors, where ps
    0's other state has its copies, unless that ps is down."""
    return (devices.ps_device(mirrors.PS0_COPIES) if config.ps_mirrors
            and ps_down != mirrors.PS0_COPIES else None)


def port_refuses(cluster) -> Callable[[int], bool]:
    """k -> worker k's port refuses connections now (0.5 s at most)."""
    return lambda k: ports.answer(cluster.workers[k], 0.5,
                                  "worker") == ports.REFUSED


def acting_chief(target: str, task, config) -> int | None:
    """The worker doing the chief's work now if its beat goes on (read twice,
    timing.BEAT_SECS x 6 apart), else None (also if ps 0 is silent). Call it
    once ps 0 accepts connections: a chief started again while its link is
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
