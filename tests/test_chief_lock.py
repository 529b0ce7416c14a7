"""Exactly one chief: the lock's generations on an in-process ps, the
claim and the chief's own beat (trainer/roles/takeover.py). The watch on
the beat: test_chief_watch.py."""

import time

import pytest
import tensorflow as tf

from tests import helpers
from trainer.cluster import spec as cluster_spec
from trainer.common.config import TrainConfig
from trainer.roles import takeover
from trainer.roles.background import ThreadCall
from trainer.sync import averaging
from trainer.sync import coordination
from trainer.sync import pull_turns
from trainer.sync import state


@pytest.fixture
def lock_session():
    """A worker and a ps in process; the lock on the ps; a guarded write
    (counter += 1) for a fed generation."""
    ports = helpers.free_ports(2)
    spec = tf.train.ClusterSpec({"worker": [f"localhost:{ports[0]}"],
                                 "ps": [f"localhost:{ports[1]}"]})
    server = tf.distribute.Server(spec, "worker", 0)
    tf.distribute.Server(spec, "ps", 0)
    graph = tf.Graph()
    with graph.as_default(), tf.device("/job:ps/task:0"):
        lock = takeover.ChiefLock("/job:ps/task:0")
        counter = tf.Variable(0, dtype=tf.int64, use_resource=True)
        generation = tf.compat.v1.placeholder(tf.int64, [])
        write = lock.guarded(
            generation, lambda: (tf.constant(True), counter.assign_add(1)),
            lambda: (tf.constant(False), counter.read_value()))
        init = counter.initializer
    session = tf.compat.v1.Session(server.target, graph=graph)
    session.run(init)
    yield session, lock, lambda e: session.run(write, {generation: e})
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
    generation, lost = takeover.claim(session, lock, 1, wait_secs=0.5)
    assert (generation, lost) == (2, True)
    assert session.run(lock.size) == 1


def test_a_write_waiting_for_its_input_does_not_hold_the_lock():
    """The chief waits for events most of the time; a lock taken while it
    waits was lost whenever that run was aborted (a ps lost), and the
    next chief restored a checkpoint it did not need (found with
    --ps_mirrors: ps 1 killed while the chief waited for a push)."""
    graph = tf.Graph()
    with graph.as_default():
        lock = takeover.ChiefLock("/cpu:0")
        inbox = tf.queue.FIFOQueue(1, [tf.int64], shapes=[[]])
        event = inbox.dequeue()
        write = lock.guarded(tf.constant(0, tf.int64),
                             lambda: event + 1, lambda: event, after=[event])
        send = inbox.enqueue(41)
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(lock.put, {lock.generation_in: 0, lock.index_in: 0})
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


def test_the_chiefs_own_beat_lands_only_in_its_generation():
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
        lock = takeover.ChiefLock(ps)
        rule = averaging.Averaging(shared, 64, 0, "equal", turns, lock=lock,
                                   generation=lock.loop_generation)
        halt = coordination.RunCoordination(shared, turns, "").halt_op(
            rule.guarded)
        halted = shared.halt.read_value()
        unhalt = shared.halt.assign(0)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(server.target, graph=graph) as session:
        session.run(init)
        first, _ = takeover.claim(session, lock, 0, wait_secs=1)
        assert session.run(halt, {lock.loop_generation: first}) == 0
        assert session.run(halted) == 1
        session.run(unhalt)   # as the next chief's start does
        second, _ = takeover.claim(session, lock, 1, wait_secs=1)
        assert session.run(halt, {lock.loop_generation: first}) == (
            coordination.NOT_HALTED)
        assert session.run(halted) == 0
        assert session.run(halt, {lock.loop_generation: second}) == 0
        assert session.run(halted) == 1
        assert session.run(lock.size) == 1


def test_a_deposed_chiefs_watches_write_nothing():
    """A deposed chief's membership watch runs until its loop ends: its
    take of the roster changes, its log write and its LOST land only in
    its generation, so the next chief keeps every change."""
    from trainer.cluster.spec import make_cluster, make_task
    from trainer.roles import graph as graph_lib
    ports = helpers.free_ports(2)
    cluster = make_cluster((f"localhost:{ports[1]}",),
                           (f"localhost:{ports[0]}",), "test")
    spec = tf.train.ClusterSpec(cluster.as_dict())
    server = tf.distribute.Server(spec, "worker", 0)
    tf.distribute.Server(spec, "ps", 0)
    g = graph_lib.build_worker(TrainConfig(logdir="unused"),
                               make_task(cluster, "worker", 0, "t"),
                               600, 100, 50)
    ops = g.chief
    with tf.compat.v1.Session(server.target, graph=g.graph) as session:
        session.run(ops.init_op)
        first, _ = takeover.claim(session, g.lock, 0, wait_secs=1)
        session.run(g.handles.join_op)   # a JOINED, then its record
        session.run(ops.absorb_op, {ops.generation: first})
        second, _ = takeover.claim(session, g.lock, 1, wait_secs=1)
        deposed, current = {ops.generation: first}, {ops.generation: second}
        assert len(session.run(ops.membership, deposed)[0]) == 0
        log = ops.membership_log
        assert not session.run(log.write, {log.value_in: "x", **deposed})
        assert session.run(log.read) == b"[]"
        assert not session.run(ops.lost_op, {ops.lost_in: 0, **deposed})
        # The record the deposed take left is the current chief's.
        _, kinds, workers, _ = session.run(ops.membership, current)
        assert (kinds.tolist(), workers.tolist()) == ([state.JOINED], [0])
        assert session.run(ops.lost_op, {ops.lost_in: 0, **current})
        assert session.run(log.write, {log.value_in: "y", **current})
        assert session.run(log.read) == b"y"
