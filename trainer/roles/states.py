"""A worker process's roles as one state machine: states, the events that
move it, the table between them, and the loop that moves it.

    STARTING -> WORKER or CHIEF; WORKER -> CLAIMING -> CHIEF;
    WORKER, CHIEF -> RECONNECTING -> back to that role; any -> ENDED, FAILED

`Machine.run` does each state's work (run.py's Roles) and moves on the
Event it returns (TABLE). Threads beside a run (background.py) only `post`
what they saw; as the work may block in a session.run, post() ends it as
HOW says, through run.py's `interrupt`: at once (session closed) or at
the next step boundary (the chief's halt). The loop then takes the posted
event in place of the run's error: every decision is the table's, on the
loop; post() only keeps, of two posted at once, the higher priority
(Kind's order). No TensorFlow here: tests/test_states.py drives it."""

import dataclasses
import enum
import threading
from typing import Callable

from absl import logging

from trainer.common.errors import RunFailed


class State(enum.Enum):
    STARTING = "starting"          # its server up, asking who is the chief
    WORKER = "worker"              # computing the slices the chief hands out
    CLAIMING = "claiming"          # claiming the chief's role, building it
    CHIEF = "chief"                # doing the chief's work
    RECONNECTING = "reconnecting"  # its session closed; back to its role
    ENDED = "ended"                # trained to the end (exit 0)
    FAILED = "failed"              # the run failed (exit 1)


FINAL = (State.ENDED, State.FAILED)


class Kind(enum.IntEnum):
    """What happened; threads post the first six (the lower wins)."""
    CHIEF_LOST = 1       # the chief watch: the chief's beat stopped
    ENDED_AWAY = 2       # the chief watch: the run ended while we were away
    STALLED = 3          # the watchdog: no step for --startup_timeout_secs
    PS_BACK = 4          # the watchdog: ps 0 answers again after an outage
    PS_DOWN = 5          # the ps watch: a ps refuses connections
    PS_UP = 6            # the ps watch: the ps done without answers again
    # What a state's work returned.
    CHOSEN = 10          # STARTING: the role this task starts in
    CLAIMED = 11         # CLAIMING: the claim made, the chief's side built
    DONE = 12            # trained to the end
    PS_LOST = 13         # a run failed: a ps died, restarted or is cut off
    SERVING_CHANGED = 14  # a push refused: the chief serves shards otherwise
    RECONNECTED = 15     # RECONNECTING: the old session closed
    FAILURE = 16         # anything else: error holds it


POSTED = tuple(k for k in Kind if k < Kind.CHOSEN)


class How(enum.Enum):
    """How post() ends the state's blocked work."""
    NOW = "close the session"
    NOW_OR_EXIT = "close the session; exit if that does not end the run"
    AT_BOUNDARY = "halt the chief's loop at the next step boundary"


HOW = {Kind.CHIEF_LOST: How.NOW, Kind.ENDED_AWAY: How.NOW,
       Kind.STALLED: How.NOW_OR_EXIT, Kind.PS_BACK: How.NOW,
       Kind.PS_DOWN: How.NOW, Kind.PS_UP: How.AT_BOUNDARY}

# (state, what happened) -> the next state. A pair not here is ignored
# when posted (a thread late for its state) and a bug when returned.
TABLE = {
    (State.STARTING, Kind.CHOSEN): None,        # event.role
    (State.STARTING, Kind.FAILURE): State.FAILED,
    (State.WORKER, Kind.DONE): State.ENDED,
    (State.WORKER, Kind.CHIEF_LOST): State.CLAIMING,
    (State.WORKER, Kind.ENDED_AWAY): State.ENDED,
    (State.WORKER, Kind.STALLED): State.FAILED,
    (State.WORKER, Kind.PS_BACK): State.RECONNECTING,
    (State.WORKER, Kind.PS_LOST): State.RECONNECTING,
    (State.WORKER, Kind.SERVING_CHANGED): State.RECONNECTING,
    (State.WORKER, Kind.FAILURE): State.FAILED,
    (State.CLAIMING, Kind.CLAIMED): State.CHIEF,
    (State.CLAIMING, Kind.FAILURE): State.FAILED,
    (State.CHIEF, Kind.DONE): State.ENDED,
    (State.CHIEF, Kind.STALLED): State.FAILED,
    (State.CHIEF, Kind.PS_DOWN): State.RECONNECTING,
    (State.CHIEF, Kind.PS_UP): State.RECONNECTING,
    (State.CHIEF, Kind.PS_LOST): State.RECONNECTING,
    (State.CHIEF, Kind.SERVING_CHANGED): State.RECONNECTING,
    (State.CHIEF, Kind.FAILURE): State.FAILED,
    (State.RECONNECTING, Kind.RECONNECTED): None,  # back to self.role
    (State.RECONNECTING, Kind.FAILURE): State.FAILED,
}


@dataclasses.dataclass(frozen=True)
class Event:
    """What a state's work returned, or a thread posted."""
    kind: Kind
    reason: str                         # one line for the log
    role: State | None = None           # with CHOSEN: the State to start in
    error: BaseException | None = None  # with FAILURE: the exception to raise


class Interrupted(Exception):
    """A role's work stopped at a step boundary for a posted event."""


class Machine:
    """One task's state; `post` from any thread, `run` on the loop's.
    who: the task, as log lines name it ("worker 1")."""

    def __init__(self, who: str):
        self.who, self.state = who, State.STARTING
        self.role: State | None = None      # WORKER or CHIEF, once chosen
        self.cause: Event | None = None     # the event of the last move
        self._pending: Event | None = None
        self._lock = threading.Lock()
        self._interrupt: Callable[[Event, How], None] = lambda e, how: None

    def attach(self, interrupt: Callable[["Event", How], None]) -> None:
        """interrupt(event, how): how the role ends its blocked work."""
        self._interrupt = interrupt

    def post(self, event: Event) -> bool:
        """From a thread: records `event`, ends the blocked work as HOW says.
        False (nothing done) if the state has no row for it, or an event
        of higher priority is pending."""
        assert event.kind in POSTED, event
        with self._lock:
            if (self.state, event.kind) not in TABLE or (
                    self._pending and self._pending.kind <= event.kind):
                return False
            self._pending = event
        self._interrupt(event, HOW[event.kind])
        return True

    def pending(self) -> Event | None:
        """The event posted and not yet taken (any thread)."""
        with self._lock:
            return self._pending

    def outcome(self, event: Event) -> Event:
        """What the loop acts on once the work returned `event`: the event
        posted meanwhile (its interrupt failed the work), if any; but a
        DONE, or a RunFailed of its own (halt, deposed chief), stands."""
        with self._lock:
            posted, self._pending = self._pending, None
        if event.kind == Kind.DONE or isinstance(event.error, RunFailed):
            return event
        return posted or event

    def move(self, event: Event) -> State:
        """Takes the transition of (state, event.kind); logs it."""
        key = (self.state, event.kind)
        if key not in TABLE:
            raise AssertionError(f"{self.who}: no transition from "
                                 f"{self.state.value} on {event.kind.name}")
        new = TABLE[key] or (event.role if event.kind == Kind.CHOSEN
                             else self.role)
        quiet = event.kind in (Kind.CHOSEN, Kind.DONE, Kind.CLAIMED,
                               Kind.RECONNECTED)
        (logging.info if quiet else logging.warning)(
            "%s: %s -> %s (%s)", self.who, self.state.value, new.value,
            event.reason)
        with self._lock:
            self.state, self.cause = new, event
            if new in (State.WORKER, State.CHIEF):
                self.role = new
        return new

    def run(self, work: Callable[[State], Event]) -> State:
        """work(state) for each state until ENDED or FAILED; an exception
        out of a state's work is its FAILURE."""
        while self.state not in FINAL:
            try:
                event = work(self.state)
            except Exception as e:  # noqa: BLE001 (the table decides)
                first = (str(e).splitlines() or [""])[0]
                event = Event(Kind.FAILURE, f"{type(e).__name__}: {first}",
                              error=e)
            self.move(self.outcome(event))
        return self.state
