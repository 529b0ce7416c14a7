"""Exactly one chief: the lock's epochs on an in-process ps
(trainer/sync/chief_lock.py), the claim (trainer/roles/takeover.py), and
the judgement by which a worker calls the chief lost."""

import time

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from trainer.cluster import spec as cluster_spec
from trainer.common.config import TrainConfig
from trainer.roles import takeover
from trainer.roles.background import ThreadCall
from trainer.sync import averaging
from trainer.sync import chief_lock
from trainer.sync import coordination
from trainer.sync import pull_turns
from trainer.sync import state


@pytest.fixture
def lock_session():
    """A worker and a ps in process; the lock on the ps; a guarded write
    (counter += 1) for a fed epoch."""
    ports = helpers.free_ports(2)
    spec = tf.train.ClusterSpec({"worker": [f"localhost:{ports[0]}"],
                                 "ps": [f"localhost:{ports[1]}"]})
    server = tf.distribute.Server(spec, "worker", 0)
    tf.distribute.Server(spec, "ps", 0)
    graph = tf.Graph()
    with graph.as_default(), tf.device("/job:ps/task:0"):
        lock = chief_lock.ChiefLock("/job:ps/task:0")
        counter = tf.Variable(0, dtype=tf.int64, use_resource=True)
        epoch = tf.compat.v1.placeholder(tf.int64, [])
        write = lock.guarded(
            epoch, lambda: (tf.constant(True), counter.assign_add(1)),
            lambda: (tf.constant(False), counter.read_value()))
        init = counter.initializer
    session = tf.compat.v1.Session(server.target, graph=graph)
    session.run(init)
    yield session, lock, lambda e: session.run(write, {epoch: e})
    session.close()


def test_a_newer_claim_refuses_the_older_chiefs_writes(lock_session):
    session, lock, write = lock_session
    first, lost = takeover.claim(session, lock, 0, wait_secs=1)
    assert (first, lost) == (1, False)
    assert list(session.run(lock.recorded)) == [1, 0, 0]
    assert write(first) == (True, 1)
    second, lost = takeover.claim(session, lock, 2, wait_secs=1)
    assert (second, lost) == (2, False)
    assert list(session.run(lock.recorded)) == [2, 2, 0]
    # The old chief's write is refused and changes nothing; the new one's
    # goes through; the lock is back after each.
    assert write(first) == (False, 1)
    assert write(second) == (True, 2)
    assert session.run(lock.size) == 1


def test_a_lock_lost_inside_a_write_is_found_by_the_next_claim(lock_session):
    session, lock, _ = lock_session
    takeover.claim(session, lock, 0, wait_secs=1)
    session.run(lock.take)   # a chief killed between its take and its put
    epoch, lost = takeover.claim(session, lock, 1, wait_secs=0.5)
    assert (epoch, lost) == (2, True)
    assert session.run(lock.size) == 1


def test_a_write_waiting_for_its_input_does_not_hold_the_lock():
    """The chief waits for events most of the time; a lock taken while it
    waits was lost whenever that run was aborted (a ps lost), and the
    next chief restored a checkpoint it did not need (found with
    --ps_mirrors: ps 1 killed while the chief waited for a push)."""
    graph = tf.Graph()
    with graph.as_default():
        lock = chief_lock.ChiefLock("/cpu:0")
        inbox = tf.queue.FIFOQueue(1, [tf.int64], shapes=[[]])
        event = inbox.dequeue()
        write = lock.guarded(tf.constant(0, tf.int64),
                             lambda: event + 1, lambda: event, after=[event])
        send = inbox.enqueue(41)
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(lock.put, {lock.epoch_in: 0, lock.index_in: 0})
        waiting = ThreadCall(lambda: session.run(write), "write")
        time.sleep(0.5)
        assert session.run(lock.size) == 1   # not taken while it waits
        session.run(send)
        assert waiting.result(10) == 42
        assert session.run(lock.size) == 1


def test_beats_are_counted(lock_session):
    session, lock, _ = lock_session
    takeover.claim(session, lock, 0, wait_secs=1)
    for _ in range(3):
        session.run(lock.beat)
    assert list(session.run(lock.recorded)) == [1, 0, 3]


def test_the_chiefs_own_beat_lands_only_in_its_epoch():
    """takeover.BeatSession: the chief beats from a session of its own,
    and adds to the record only while the record is its own; once
    another worker has claimed the role, its beat lands nothing (a
    deposed chief must not keep its successor's record alive)."""
    ports = helpers.free_ports(2)
    worker, ps = f"localhost:{ports[0]}", f"localhost:{ports[1]}"
    spec = tf.train.ClusterSpec({"worker": [worker], "ps": [ps]})
    server = tf.distribute.Server(spec, "worker", 0)
    tf.distribute.Server(spec, "ps", 0)
    task = cluster_spec.from_flags("worker", 0, ps, worker)
    config = TrainConfig(logdir="unused")
    session, lock = takeover.lock_session(server.target, task, config, None)
    beats = takeover.BeatSession(server.target, task, config)
    try:
        first, _ = takeover.claim(session, lock, 0, wait_secs=1)
        assert beats.beat(first) and beats.beat(first)
        assert list(session.run(lock.recorded)) == [first, 0, 2]
        second, _ = takeover.claim(session, lock, 1, wait_secs=1)
        assert not beats.beat(first)
        assert beats.beat(second)
        assert list(session.run(lock.recorded)) == [second, 1, 1]
    finally:
        beats.close()
        session.close()


def test_a_beat_that_did_not_land_hands_nothing_over(monkeypatch):
    """A takeover's claim beats on until the chief's own beat lands, not
    merely runs: a beat in a deposed epoch lands nothing."""
    monkeypatch.setattr(takeover, "BEAT_SECS", 0.02)
    events = []

    class Claim:
        def handed_over(self):
            events.append("handed over")

    with takeover.ChiefBeat(lambda: events.append("beat") or False,
                            Claim()):
        deadline = time.monotonic() + 10
        while events.count("beat") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events.count("beat") >= 3
        assert "handed over" not in events
    assert events[-1] == "handed over"   # at the stop


def judge(me, refused=()):
    return takeover.Judge(me, 5.0, lambda k: k in refused)


ROSTER = np.array([True, True, True, True])


def test_silence_counts_only_while_ps_0_answers():
    j = judge(1)
    assert j.update([1, 0, 7], ROSTER, 0.0) is None
    j.forget()   # ps 0 did not answer from here to 30 s
    # The beats have not moved since 0 s, but nothing could be read: the
    # silence is measured from the first reading after.
    assert j.update([1, 0, 7], ROSTER, 30.0) is None
    assert j.update([1, 0, 7], ROSTER, 34.9) is None
    assert "no beat for 5 s" in j.update([1, 0, 7], ROSTER, 35.0)


def test_a_reading_held_up_by_ps_0_does_not_count_as_silence():
    """Seed 502 of the nemesis: ps 0 was stopped for 22 s; the watch's
    reading and the chief's beats waited alike, and the first reading
    after (the beats not moved yet) deposed a healthy chief."""
    j = judge(1)
    assert j.update([1, 0, 7], ROSTER, 0.0) is None
    assert j.update([1, 0, 7], ROSTER, 22.0, read_secs=21.5) is None
    assert j.update([1, 0, 7], ROSTER, 26.9) is None
    assert "no beat for 5 s" in j.update([1, 0, 7], ROSTER, 27.0)


def test_the_lowest_member_takes_over_after_the_timeout():
    j1, j2 = judge(1), judge(2)
    for j in (j1, j2):
        assert j.update([1, 0, 7], ROSTER, 0.0) is None
        assert j.update([1, 0, 7], ROSTER, 4.9) is None   # still in time
    assert "no beat for 5 s" in j1.update([1, 0, 7], ROSTER, 5.0)
    # Worker 2 waits one timeout more, in case worker 1 is lost too.
    assert j2.update([1, 0, 7], ROSTER, 5.0) is None
    assert j2.update([1, 0, 7], ROSTER, 10.0).startswith("worker 0 left")


def test_a_refusing_port_is_lost_after_a_second():
    j = judge(1, refused={0})
    assert j.update([1, 0, 7], ROSTER, 0.0) is None
    assert j.update([1, 0, 7], ROSTER, 0.5) is None
    assert "refuses connections" in j.update([1, 0, 7], ROSTER, 1.0)


def test_beats_or_a_new_chief_reset_the_watch():
    j = judge(2)
    j.update([1, 0, 7], ROSTER, 0.0)
    assert j.update([1, 0, 8], ROSTER, 6.0) is None   # it beat
    after = np.array([False, True, True, True])   # worker 0 not back
    assert j.update([2, 1, 0], after, 12.0) is None  # worker 1 took over
    assert j.update([2, 1, 0], after, 16.0) is None
    # Worker 1 is the chief now; worker 2 is next in line.
    assert j.update([2, 1, 0], after, 17.0).startswith("worker 1 left")
    assert judge(1).update([2, 1, 0], ROSTER, 100.0) is None   # itself


def test_a_chief_gone_after_the_last_step_is_not_replaced():
    """Seed 507 of the nemesis: a worker whose link came back after the
    run's end saw the chief's port refuse (it had exited) and took over
    at step 300 of 300, then waited for ps tasks that had exited."""
    for step, took_over, ended in ((299, 1, []), (300, 0, [300])):
        lost, seen = [], []
        watch = takeover.ChiefWatch(
            lambda s=step: ([1, 0, 7], ROSTER, s), judge(1, refused={0}),
            lost.append, 300, seen.append)
        assert watch.run_once() is None   # the beat seen once
        time.sleep(takeover.REFUSED_AFTER_SECS + 0.1)
        assert watch.run_once() is False
        assert (len(lost), seen) == (took_over, ended)


def test_a_worker_says_when_its_logdir_is_not_the_chiefs(tmp_path):
    from trainer.saving import storage
    chiefs, other = tmp_path / "chief", tmp_path / "other"
    chiefs.mkdir()
    other.mkdir()
    word = storage.mark(chiefs)
    assert not storage.warn_if_elsewhere(str(chiefs), lambda: word.encode())
    assert storage.warn_if_elsewhere(str(other), lambda: word.encode())
    (other / storage.MARK_FILE).write_text("another chief's\n")
    assert storage.warn_if_elsewhere(str(other), lambda: word.encode())
    assert not storage.warn_if_elsewhere(str(other), lambda: b"")


def test_a_spare_gives_what_it_built_or_raises_its_error():
    assert ThreadCall(lambda: 42, "spare-chief").result() == 42

    def fails():
        raise ValueError("no test set")

    with pytest.raises(ValueError, match="no test set"):
        ThreadCall(fails, "spare-chief").result()


def test_a_claims_beat_stops_only_once_the_chiefs_own_has_landed(
        monkeypatch):
    """A worker taking over beats from its claim until the chief's own
    beat lands: a slow start between the two must not look like silence
    (nemesis seed 622: a second takeover from a chief that was fine)."""
    monkeypatch.setattr(takeover, "BEAT_SECS", 0.02)
    events = []

    class Claim:
        def handed_over(self):
            events.append("handed over")

    def beat():
        events.append("beat")
        if events.count("beat") < 3:   # ps 0 slow to answer at first
            raise tf.errors.UnavailableError(None, None, "not yet")

    with takeover.ChiefBeat(beat, Claim()):
        deadline = time.monotonic() + 10
        while events.count("beat") < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert events[:4] == ["beat", "beat", "beat", "handed over"]
    assert events.count("handed over") == 1
    events.clear()
    with takeover.ChiefBeat(lambda: events.append("fails") or 1 / 0,
                            Claim()):
        time.sleep(0.1)
    assert events[-1] == "handed over"   # at the stop, never before
    assert events.count("handed over") == 1


def test_no_beat_before_the_role_is_claimed(monkeypatch):
    """Until the chief has claimed its role (ours() is false) it does not
    beat, and a takeover's claim goes on beating for it."""
    monkeypatch.setattr(takeover, "BEAT_SECS", 0.02)
    events, claimed = [], []

    class Claim:
        def handed_over(self):
            events.append("handed over")

    with takeover.ChiefBeat(lambda: events.append("beat"), Claim(),
                            ours=lambda: bool(claimed)):
        time.sleep(0.2)
        assert events == []
        claimed.append(True)
        deadline = time.monotonic() + 10
        while "handed over" not in events and time.monotonic() < deadline:
            time.sleep(0.01)
    assert events[:2] == ["beat", "handed over"]


def test_a_deposed_chiefs_halt_is_refused():
    """The halt is shared on ps 0: a chief deposed while out of reach,
    which calls its halt when it comes back (a ps it did without answers
    again, SIGTERM), must not end its successor's loop."""
    ports = helpers.free_ports(2)
    spec = tf.train.ClusterSpec({"worker": [f"localhost:{ports[0]}"],
                                 "ps": [f"localhost:{ports[1]}"]})
    server = tf.distribute.Server(spec, "worker", 0)
    tf.distribute.Server(spec, "ps", 0)
    ps = "/job:ps/task:0"
    graph = tf.Graph()
    with graph.as_default(), tf.device(ps):
        shared = state.SharedState(2, [5, 3], [ps, ps])
        turns = pull_turns.PullTurns(2, [ps, ps], False)
        lock = chief_lock.ChiefLock(ps)
        rule = averaging.Averaging(shared, 64, 0, "equal", turns, lock=lock,
                                   epoch=lock.loop_epoch)
        halt = coordination.RunCoordination(shared, turns, "").halt_op(
            rule.guarded)
        halted = shared.halt.read_value()
        unhalt = shared.halt.assign(0)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(server.target, graph=graph) as session:
        session.run(init)
        first, _ = takeover.claim(session, lock, 0, wait_secs=1)
        assert session.run(halt, {lock.loop_epoch: first}) == 0
        assert session.run(halted) == 1
        session.run(unhalt)   # as the next chief's start does
        second, _ = takeover.claim(session, lock, 1, wait_secs=1)
        assert session.run(halt, {lock.loop_epoch: first}) == (
            coordination.NOT_HALTED)
        assert session.run(halted) == 0
        assert session.run(halt, {lock.loop_epoch: second}) == 0
        assert session.run(halted) == 1
        assert session.run(lock.size) == 1
