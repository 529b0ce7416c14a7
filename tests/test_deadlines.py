"""The chief's deadline thread (trainer/roles/deadlines.py), in-process:
it times the newest queued request and sends LATE for that round."""

import time

import numpy as np
import tensorflow as tf

from trainer.roles import deadlines
from trainer.roles import membership
from trainer.sync import state


def test_the_newest_request_gets_its_late_event_after_its_seconds():
    with tf.Graph().as_default():
        shared = state.SharedState(2, [3], ["/cpu:0"])
        put_in = (tf.compat.v1.placeholder(tf.int64, [None]),
                  tf.compat.v1.placeholder(tf.int64, [None]),
                  tf.compat.v1.placeholder(tf.float32, [None]))
        put = shared.deadlines.enqueue_many(put_in)
        late_in = (tf.compat.v1.placeholder(tf.int64, []),
                   tf.compat.v1.placeholder(tf.int64, []))
        late_op = shared.send_event(state.LATE, 0, *late_in)
        take_event = shared.events.dequeue()
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            # Two rounds planned before the thread looks: the older one is
            # over by then, only the newer one is timed.
            session.run(put, {put_in[0]: [4, 4], put_in[1]: [8, 9],
                              put_in[2]: [0.01, 0.3]})
            start = time.monotonic()
            with deadlines.RoundDeadlines(session, shared.take_deadlines(),
                                          late_op, *late_in):
                kind, worker, step, round_, _ = session.run(
                    take_event, options=tf.compat.v1.RunOptions(
                        timeout_in_ms=10000))
                waited = time.monotonic() - start
            assert (kind, worker, step, round_) == (state.LATE, 0, 4, 9)
            assert 0.3 <= waited < 5.0
            assert session.run(shared.events.size()) == 0


def test_the_watch_checks_a_benched_worker_with_a_slice_outstanding():
    """A member a round's deadline left behind is no longer planned; if
    it died, only its outstanding slice lets the membership watch find
    it. A benched worker that answered its probe is idle, not silent."""
    state_now = membership._Round(
        step=7, round=12,
        planned=np.array([1, 1, 0, 0, 0], bool),
        admitted=np.array([1, 0, 0, 0, 0], bool),
        roster=np.array([1, 1, 1, 1, 0], bool),
        slices=np.zeros([5, 2], np.int64),
        last_push=np.int64([12, 11, 9, 10, 3]),
        issued_round=np.int64([12, 12, 11, 10, 5]))
    # 1: planned, not pushed; 2: benched, its slice of round 11 out;
    # 3: benched, answered; 4: not in the roster.
    assert membership.late(state_now, chief=0) == [1, 2]
    # Worker 2 as the chief (it took over): never its own late member.
    assert membership.late(state_now, chief=2) == [1]
