"""The roles' state machine (trainer/roles/states.py) driven by fake
events, without TensorFlow: the table, the loop, what a posted event
does to blocked work, and the one-line log of each move."""

import subprocess
import sys
import threading

import pytest

from tests import helpers
from trainer.common.errors import RunFailed
from trainer.roles import states
from trainer.roles.states import Event, How, Kind, Machine, State

def test_no_tensorflow_is_needed():
    code = ("import sys, trainer.roles.states; "
            "print('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO,
                            capture_output=True, text=True, timeout=60,
                            check=True)
    assert result.stdout.strip() == "False"


def test_every_row_names_states_and_every_state_but_final_leaves():
    for (state, kind), new in states.TABLE.items():
        assert isinstance(state, State) and isinstance(kind, Kind)
        assert state not in states.FINAL
        assert new is None or isinstance(new, State)
    leaving = {state for state, _ in states.TABLE}
    assert leaving == set(State) - set(states.FINAL)
    # Every posted kind has a way to end the blocked work.
    assert set(states.HOW) == set(states.POSTED)


def drive(script, who="worker 1"):
    """Runs a Machine whose work returns the next event of `script` for
    each state; returns (final state, states visited)."""
    machine, seen, events = Machine(who), [], iter(script)

    def work(state):
        seen.append(state)
        return next(events)

    return machine.run(work), seen, machine


def test_a_worker_that_takes_over_and_reconnects_as_the_chief():
    final, seen, machine = drive([
        Event(Kind.CHOSEN, "start", role=State.WORKER),
        Event(Kind.CHIEF_LOST, "worker 0 left"),
        Event(Kind.CLAIMED, "claimed"),
        Event(Kind.PS_LOST, "lost the ps tasks"),
        Event(Kind.RECONNECTED, "closed"),      # back to its role: chief
        Event(Kind.DONE, "trained")])
    assert final == State.ENDED
    assert seen == [State.STARTING, State.WORKER, State.CLAIMING,
                    State.CHIEF, State.RECONNECTING, State.CHIEF]
    assert machine.role == State.CHIEF


def test_a_worker_reconnects_as_a_worker():
    final, seen, _ = drive([
        Event(Kind.CHOSEN, "start", role=State.WORKER),
        Event(Kind.PS_BACK, "ps 0 answers again"),
        Event(Kind.RECONNECTED, "closed"),
        Event(Kind.ENDED_AWAY, "the run ended at step 300")])
    assert final == State.ENDED
    assert seen[-1] == State.WORKER


@pytest.mark.parametrize("state,kind,new", [
    (State.WORKER, Kind.STALLED, State.FAILED),
    (State.CHIEF, Kind.STALLED, State.FAILED),
    (State.CHIEF, Kind.PS_DOWN, State.RECONNECTING),
    (State.CHIEF, Kind.PS_UP, State.RECONNECTING),
    (State.WORKER, Kind.SERVING_CHANGED, State.RECONNECTING),
    (State.CLAIMING, Kind.FAILURE, State.FAILED),
])
def test_rows(state, kind, new):
    assert states.TABLE[(state, kind)] == new


def test_a_chief_is_never_told_to_claim_and_a_worker_never_halts():
    assert (State.CHIEF, Kind.CHIEF_LOST) not in states.TABLE
    assert (State.WORKER, Kind.PS_UP) not in states.TABLE
    assert (State.WORKER, Kind.PS_DOWN) not in states.TABLE


def test_a_pair_not_in_the_table_is_a_bug():
    machine = Machine("worker 1")
    with pytest.raises(AssertionError, match="no transition from starting"):
        machine.move(Event(Kind.DONE, "too soon"))


def test_an_exception_out_of_a_work_is_its_failure():
    machine = Machine("worker 2")

    def work(state):
        raise ValueError("no test set\nmore")

    assert machine.run(work) == State.FAILED
    assert machine.cause.kind == Kind.FAILURE
    assert machine.cause.reason == "ValueError: no test set"
    assert isinstance(machine.cause.error, ValueError)


class Blocked:
    """Fake work blocked in a session.run until its role's interrupt."""

    def __init__(self, machine):
        self.released = threading.Event()
        self.how = []
        machine.attach(self.interrupt)

    def interrupt(self, event, how):
        self.how.append((event.kind, how))
        self.released.set()

    def run(self, returns: Event) -> Event:
        assert self.released.wait(10), "no interrupt"
        return returns


def test_a_posted_event_ends_the_blocked_work_and_replaces_its_error():
    machine = Machine("worker 1")
    machine.move(Event(Kind.CHOSEN, "start", role=State.WORKER))
    blocked = Blocked(machine)
    poster = threading.Thread(target=machine.post, args=(
        Event(Kind.CHIEF_LOST, "worker 0 left: no beat for 10 s"),))
    poster.start()
    # The closed session makes the run fail with an error of its own.
    failed = blocked.run(Event(Kind.FAILURE, "Cancelled", error=OSError()))
    poster.join(10)
    assert blocked.how == [(Kind.CHIEF_LOST, How.NOW)]
    assert machine.move(machine.outcome(failed)) == State.CLAIMING
    assert machine.cause.reason.startswith("worker 0 left")
    assert machine.pending() is None


def test_of_two_posts_the_higher_priority_is_kept():
    machine = Machine("worker 1")
    machine.move(Event(Kind.CHOSEN, "start", role=State.WORKER))
    blocked = Blocked(machine)
    assert machine.post(Event(Kind.PS_BACK, "ps 0 back"))
    assert machine.post(Event(Kind.CHIEF_LOST, "chief lost"))
    assert not machine.post(Event(Kind.STALLED, "stalled"))
    assert machine.pending().kind == Kind.CHIEF_LOST
    assert [k for k, _ in blocked.how] == [Kind.PS_BACK, Kind.CHIEF_LOST]


def test_a_post_the_state_has_no_row_for_is_ignored():
    machine = Machine("worker 0")
    machine.move(Event(Kind.CHOSEN, "start", role=State.CHIEF))
    blocked = Blocked(machine)
    assert not machine.post(Event(Kind.CHIEF_LOST, "a chief's own watch"))
    assert machine.pending() is None and blocked.how == []
    assert machine.post(Event(Kind.PS_UP, "ps 1 answers"))
    assert blocked.how == [(Kind.PS_UP, How.AT_BOUNDARY)]


@pytest.mark.parametrize("returned", [
    Event(Kind.DONE, "trained to the end"),
    Event(Kind.FAILURE, "deposed", error=RunFailed("worker 2 took over"))])
def test_work_that_ended_on_its_own_keeps_its_event(returned):
    machine = Machine("worker 0")
    machine.move(Event(Kind.CHOSEN, "start", role=State.CHIEF))
    Blocked(machine)
    machine.post(Event(Kind.STALLED, "ps 0 silent"))
    assert machine.outcome(returned) is returned
    assert machine.pending() is None


def test_each_move_is_one_line_naming_the_task_the_states_and_why(caplog):
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.INFO)
    caplog.set_level("INFO")
    drive([Event(Kind.CHOSEN, "start", role=State.WORKER),
           Event(Kind.CHIEF_LOST, "worker 0 left: no beat for 10 s, "
                                  "--worker_timeout_secs"),
           Event(Kind.FAILURE, "the spare failed")])
    lines = [r.getMessage() for r in caplog.records]
    assert ("worker 1: worker -> claiming (worker 0 left: no beat for 10 s,"
            " --worker_timeout_secs)") in lines
    assert "worker 1: claiming -> failed (the spare failed)" in lines
    assert "worker 1: starting -> worker (start)" in lines
