"""--ps_mirrors' refill (trainer/sync/mirrors.py) in process: which lost
variables can be filled from their partners, and that a fill copies."""

import numpy as np
import tensorflow as tf

from trainer.sync import mirrors


def _variable(name, value):
    return tf.compat.v1.get_variable(
        name, initializer=tf.constant(value, tf.float32), use_resource=True)


def test_a_lost_variable_is_filled_from_its_partner_only_if_that_lives():
    graph = tf.Graph()
    with graph.as_default():
        a, b = _variable("a", [1.0, 2.0]), _variable("b", [1.0, 2.0])
        c, d = _variable("c", [3.0]), _variable("d", [3.0])
        t = _variable("t", [0.0])   # the protocol's: starts afresh
        refill = mirrors.Refill([(a, b), (c, d)], [t])
        uninitialized = tf.compat.v1.report_uninitialized_variables()
        bump = a.assign_add([1.0, 1.0])
    assert refill.ops_for(["a", "b"]) is None   # both copies gone
    assert refill.ops_for(["a", "other"]) is None   # no copy at all
    assert len(refill.ops_for(["b", "c", "t"])) == 3
    with tf.compat.v1.Session(graph=graph) as session:
        session.run([a.initializer, d.initializer])
        session.run(bump)
        # b, c and t were "on the ps started again".
        refill.after_restart(session, uninitialized)
        assert not len(session.run(uninitialized))
        np.testing.assert_array_equal(session.run(b), [2.0, 3.0])
        np.testing.assert_array_equal(session.run(c), [3.0])
        session.run(bump)
        session.run(refill.copy_all)   # after a restore: primaries win
        np.testing.assert_array_equal(session.run(b), [3.0, 4.0])
