"""--ps_mirrors' refill (trainer/sync/mirrors.py) in process: which lost
variables can be filled from their partners, that a fill copies, and
that ps 0's step comes back only from whole copies."""

import types

import numpy as np
import tensorflow as tf

from trainer.sync import mirrors


def _variable(name, value, dtype=tf.float32):
    return tf.compat.v1.get_variable(
        name, initializer=tf.constant(value, dtype), use_resource=True)


def _graph():
    """A two-shard stand-in: a/b and c/d are (primary, copy) pairs, t the
    protocol's (starts afresh), step/step_copy/begun ps 0's step, its
    copy and the copy's start mark."""
    graph = tf.Graph()
    with graph.as_default():
        v = types.SimpleNamespace(
            a=_variable("a", [1.0, 2.0]), b=_variable("b", [1.0, 2.0]),
            c=_variable("c", [3.0]), d=_variable("d", [3.0]),
            t=_variable("t", [0.0]),
            step=_variable("step", 0, tf.int64),
            step_copy=_variable("step_copy", 0, tf.int64),
            begun=_variable("begun", 0, tf.int64))
        held = types.SimpleNamespace(
            global_step=v.step, step_copy=v.step_copy, begun=v.begun,
            whole=lambda: tf.equal(v.begun.read_value(),
                                   v.step_copy.read_value()))
        v.refill = mirrors.Refill(
            held, [(v.a, v.b), (v.c, v.d), (v.step, v.step_copy)], [v.t])
        v.uninitialized = tf.compat.v1.report_uninitialized_variables()
        v.bump = v.a.assign_add([1.0, 1.0])
        v.write = tf.group(v.step_copy.assign(7), v.begun.assign(7))
        v.half = v.begun.assign(8)
    return graph, v


def test_a_lost_variable_is_filled_from_its_partner_only_if_that_lives():
    graph, v = _graph()
    assert v.refill.ops_for(["a", "b"]) is None   # both copies gone
    assert v.refill.ops_for(["a", "other"]) is None   # no copy at all
    assert len(v.refill.ops_for(["b", "c", "t"])) == 3
    with tf.compat.v1.Session(graph=graph) as session:
        session.run([v.a.initializer, v.d.initializer, v.step.initializer,
                     v.step_copy.initializer, v.begun.initializer])
        session.run(v.bump)
        # b, c and t were "on the ps started again".
        assert not v.refill.after_restart(session, v.uninitialized)
        assert not len(session.run(v.uninitialized))
        np.testing.assert_array_equal(session.run(v.b), [2.0, 3.0])
        np.testing.assert_array_equal(session.run(v.c), [3.0])
        session.run(v.bump)
        session.run(v.refill.copy_all)   # after a restore: primaries win
        np.testing.assert_array_equal(session.run(v.b), [3.0, 4.0])


def test_ps0s_step_comes_back_from_its_copy_only_if_no_write_was_cut():
    graph, v = _graph()
    with tf.compat.v1.Session(graph=graph) as session:
        # "ps 0" (a, d's partner c, the step, t) lost after step 7's write.
        session.run([v.b.initializer, v.d.initializer,
                     v.step_copy.initializer, v.begun.initializer])
        session.run(v.write)
        assert v.refill.after_restart(session, v.uninitialized)
        assert session.run(v.step) == 7
        assert not len(session.run(v.uninitialized))
    graph, v = _graph()
    with tf.compat.v1.Session(graph=graph) as session:
        # Lost inside step 8's write: begun says 8, the copy 7.
        session.run([v.b.initializer, v.d.initializer,
                     v.step_copy.initializer, v.begun.initializer])
        session.run([v.write])
        session.run(v.half)
        assert not v.refill.after_restart(session, v.uninitialized)
        assert b"step" in session.run(v.uninitialized)   # left to restore
