"""Who is alive: the silence rule every watch applies (membership.py, and
the workers' watch on the chief's beat, here), and that watch, which posts
CHIEF_LOST to the state machine (states.py) once the beat stops: see
docs/how-it-works.md, "The chief's work moves"."""

import dataclasses
import time
from typing import Callable

from trainer.cluster import ports
from trainer.roles import timing
from trainer.roles.background import BackgroundThread
from trainer.roles.states import Event, Kind
from trainer.roles.takeover import BEATS, GENERATION, INDEX


def lost(silent: float, limit: float, flag: str, what: str,
         refuses: Callable[[], bool]) -> str | None:
    """Why a task silent for `silent` s is lost, or None: after `limit`
    (`flag`), or after timing.REFUSED_AFTER_SECS if refuses(), a connection
    (a gone process refuses; a host cut off or frozen does not)."""
    if silent >= limit:
        return f"no {what} for {limit:.0f} s, {flag}"
    if silent >= timing.REFUSED_AFTER_SECS and refuses():
        return "its port refuses connections"
    return None


def port_refuses(cluster) -> Callable[[int], bool]:
    """k -> worker k's port refuses connections now (0.5 s at most)."""
    return lambda k: ports.answer(cluster.workers[k], 0.5,
                                  "worker") == ports.REFUSED


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
    chief: int = 0                      # the chief's index, as last read
    roster: object = None               # bool [N], as last read

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
        chief, self.roster = int(record[INDEX]), roster
        self.chief = chief
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
            why = lost(now - self._since, *limit, "beat",
                       lambda: self.refuses(chief))
            if why is None:
                return None
            self._why, self._lost_at = why, now
        if now - self._lost_at >= (
                place_in_line(roster, chief, self.me) * self.timeout):
            return f"worker {chief} left: {self._why}"
        return None


class ChiefWatch(BackgroundThread):
    """Posts CHIEF_LOST once Judge calls the chief lost; past the last step,
    or out of the roster there, ENDED_AWAY. read: () -> {"record",
    "roster", "step"} (numpy), as Judge.update takes them."""

    def __init__(self, read: Callable[[], dict], judge: Judge,
                 post: Callable[[Event], bool], train_steps: int):
        super().__init__("chief-watch", timing.BEAT_SECS, timing.BEAT_SECS * 4)
        self._read, self._judge, self._post = read, judge, post
        self._train_steps = train_steps

    def run_once(self) -> bool | None:
        started = time.monotonic()
        try:
            read = self._read()
            record, roster, step = read["record"], read["roster"], read["step"]
        except Exception:  # noqa: BLE001 (no record yet, or ps 0 away)
            self._judge.forget()
            return None
        now = time.monotonic()
        judge = self._judge
        reason = judge.update(record, roster, now, now - started, int(step))
        if step >= self._train_steps and (reason or not roster[judge.me]):
            # The run ended while we were away, and its ps tasks exit next
            # (nemesis seed 961): a chief would wait for no ps.
            self._post(Event(Kind.ENDED_AWAY, (
                f"the run ended at step {int(step)}, its last, while this "
                "worker was away; nothing is left to do")))
        elif reason is not None:
            self._post(Event(Kind.CHIEF_LOST, reason))
        else:
            return None
        return False


def watch_chief(worker) -> ChiefWatch:
    """The watch on the chief's beat, on `worker`'s session (worker.Worker),
    with one Judge for the worker's life: a chief seen stepping before a
    reconnect is lost, not "in its start", if its beat stays silent after
    it (nemesis seed 921). Each watch measures silence from its first read."""
    g, config = worker.g, worker.config
    read = worker.callable({"record": g.lock.recorded,
                            "roster": g.handles.roster,
                            "step": g.handles.global_step})
    worker.judge = worker.judge or Judge(
        worker.k, config.worker_timeout_secs,
        port_refuses(worker.task.cluster), config.startup_timeout_secs)
    worker.judge.forget()
    return ChiefWatch(read, worker.judge, worker.machine.post,
                      worker.train_steps)


def place_in_line(roster, chief: int, me: int) -> int:
    """How many in roster (bool [N]) claim before `me`: lower, chief aside."""
    return sum(1 for k, inside in enumerate(roster[:me])
               if inside and k != chief)
