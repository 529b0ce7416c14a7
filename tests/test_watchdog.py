"""The watchdog on its own: a stalled step, an unreachable ps, progress;
and the membership watch's last slices."""

import itertools
import threading
import types

import numpy as np
import pytest

from trainer.roles import membership
from trainer.roles import timing
from trainer.roles import watchdog as watchdog_lib


@pytest.fixture(autouse=True)
def fast_checks(monkeypatch):
    monkeypatch.setattr(timing, "WATCHDOG_CHECK_SECS", 0.05)
    monkeypatch.setattr(timing, "READ_DEADLINE_SECS", 0.1)


def watch(read, timeout_secs=0.5, wait_secs=3.0):
    """Runs a busy watchdog over `read`; returns the on_timeout calls."""
    calls, fired = [], threading.Event()

    def on_timeout(step, who):
        calls.append((step, who))
        fired.set()

    dog = watchdog_lib.Watchdog(
        read, lambda admitted: f"missing {admitted}", timeout_secs,
        on_timeout, unreachable="ps 0, which does not answer")
    with dog, dog.busy():
        fired.wait(wait_secs)
    return calls


def test_a_step_that_stands_still_times_out_naming_who_is_missing():
    assert watch(lambda: (7, [1.0, 0.0])) == [(7, "missing [1.0, 0.0]")]


def test_reads_that_fail_count_as_a_stall():
    def unreachable():
        raise TimeoutError("deadline exceeded")

    assert watch(unreachable) == [(None, "ps 0, which does not answer")]


def test_a_read_that_blocks_counts_as_a_stall_and_is_not_repeated():
    release, calls = threading.Event(), []

    def blocked():  # as a session.run to a ps that is cut off
        calls.append(1)
        release.wait(10)
        return 0, []

    try:
        assert watch(blocked) == [(None, "ps 0, which does not answer")]
        assert len(calls) == 1  # no pile of blocked reads
    finally:
        release.set()


def test_failing_reads_after_progress_report_the_last_step_seen():
    answers = iter([(3, [0.0]), (4, [0.0])])

    def read():
        answer = next(answers, None)
        if answer is None:
            raise TimeoutError("deadline exceeded")
        return answer

    assert watch(read) == [(4, "ps 0, which does not answer")]


def test_a_moving_step_never_times_out():
    steps = itertools.count()
    assert watch(lambda: (next(steps), [0.0]), wait_secs=1.5) == []


class Writer:
    """A FileWriter's add_summary, kept: [(step, {tag: value})]."""

    def __init__(self):
        self.written = []

    def add_summary(self, summary, step):
        self.written.append((step, {v.tag: v.simple_value
                                    for v in summary.value}))


def test_the_last_rounds_slices_are_written_even_if_no_check_ran():
    """A run that ends before the membership watch's first check still
    leaves each worker's slice at its last step (TensorBoard's cards)."""

    state = {"step": 30, "round": 30, "planned": np.array([True, True]),
             "admitted": np.array([True, True]),
             "roster": np.array([True, True]),
             "slices": np.array([[0, 40], [40, 64]]),
             "last_push": np.array([30, 30]),
             "issued_round": np.array([30, 30])}
    writer = Writer()
    watch = membership.MembershipWatch(
        lambda: state, None, None, None, types.SimpleNamespace(log_every=10), writer,
        on_unreachable=None)
    watch.write_last_slices()
    assert writer.written == [
        (30, {"membership/slice_0": 40.0, "membership/slice_1": 24.0})]
    watch.write_last_slices()   # nothing new to say: not written twice
    assert len(writer.written) == 1


def test_a_failed_runs_reason_survives_a_last_take_that_fails():
    """A halted run tells ps 0 to exit before the watch stops: the watch's
    last take then fails, and the run's own failure must come out, not
    the take's error; on a clean exit the take's error is raised."""
    def take():
        raise ConnectionError("ps 0 is gone")

    def make():
        return membership.MembershipWatch(
            lambda: None, take, None, types.SimpleNamespace(), None, None,
            on_unreachable=None)

    with pytest.raises(RuntimeError, match="halted"):
        with make():
            raise RuntimeError("halted: saved a checkpoint")
    with pytest.raises(ConnectionError):
        with make():
            pass
