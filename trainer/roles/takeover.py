"""The chief's work moves (docs/how-it-works.md#the-chiefs-work-moves):
the claim of its role, its beat on ps 0, and the others' watch on that."""

import dataclasses
import time
from typing import Callable, NamedTuple

import tensorflow as tf

from trainer.cluster import devices, ports
from trainer.roles import liveness, sessions, timing
from trainer.roles.background import BackgroundThread
from trainer.roles.states import Event, Kind
from trainer.sync import mirrors
from trainer.sync.chief_lock import BEATS, GENERATION, INDEX, ChiefLock


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


@dataclasses.dataclass
class Judge:
    """When worker `me` takes over, from readings of the chief's record."""

    me: int
    timeout: float                      # --worker_timeout_secs
    refuses: Callable[[int], bool]      # worker k's port refuses now
    starting: float = 0.0               # --startup_timeout_secs
    _seen: tuple | None = None     # (generation, beats) last seen
    _start: tuple = (None, None)   # (generation, first step; None if moved)
    _since: float = 0.0                 # when they last changed
    _lost_at: float | None = None
    _why: str = ""                      # why it was called lost

    def forget(self) -> None:
        """ps 0 did not answer: silence is measured anew from the next read."""
        self._seen = None

    def update(self, record, roster, now: float, read_secs: float = 0.0,
               step: int | None = None) -> str | None:
        """record: int64 [3] (generation, index, beats); roster: bool [N];
        step: the global step or None. Why to take over now, or None."""
        if read_secs > self.timeout / 2:
            # ps 0 held the reading up: the chief's beats could not land.
            self.forget()
        chief = int(record[INDEX])
        seen = (int(record[GENERATION]), int(record[BEATS]))
        if step is not None:   # a step that moved: the chief has started
            if self._start[0] != seen[0]:
                self._start = (seen[0], step)
            elif step != self._start[1]:
                self._start = (seen[0], None)
        if seen != self._seen or chief == self.me:
            self._seen, self._since, self._lost_at = seen, now, None
            return None
        if self._lost_at is None:
            limit = self.timeout, "--worker_timeout_secs"
            # No step since we first read its generation: still starting.
            if self._start[1] is not None and self.starting > self.timeout:
                limit = self.starting, "--startup_timeout_secs, in its start"
            why = liveness.lost(now - self._since, *limit, "beat",
                                lambda: self.refuses(chief))
            if why is None:
                return None
            self._why, self._lost_at = why, now
        if now - self._lost_at >= (
                place_in_line(roster, chief, self.me) * self.timeout):
            return f"worker {chief} left: {self._why}"
        return None


class ChiefWatch(BackgroundThread):
    """Posts CHIEF_LOST once Judge calls the chief lost, or ENDED_AWAY past
    the last step. read: () -> Judge.update's record, roster and step."""

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
            # The run ended while we were away: a chief would wait for no ps.
            self._post(Event(Kind.ENDED_AWAY, (
                f"the run ended at step {int(step)}, its last, while this "
                "worker was away; nothing is left to do")))
        else:
            self._post(Event(Kind.CHIEF_LOST, reason))
        return False


def place_in_line(roster, chief: int, me: int) -> int:
    """How many in roster (bool [N]) claim before `me`: lower, chief aside."""
    return sum(1 for k, inside in enumerate(roster[:me])
               if inside and k != chief)


def generation_copy_device(config, ps_down: int | None = None) -> str | None:
    """ps PS0_COPIES' device with --ps_mirrors unless it is down, else None."""
    return (devices.ps_device(mirrors.PS0_COPIES) if config.ps_mirrors
            and ps_down != mirrors.PS0_COPIES else None)


def port_refuses(cluster) -> Callable[[int], bool]:
    """k -> worker k's port refuses connections now (0.5 s at most)."""
    return lambda k: ports.answer(cluster.workers[k], 0.5,
                                  "worker") == ports.REFUSED


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
