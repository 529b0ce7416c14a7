"""The session helpers every role uses (trainer/common/tf_session.py)."""

import tensorflow as tf

from trainer.common.tf_session import make_callable


def test_a_callable_feeds_its_values_in_order():
    """The chief's loop: (token, count, generation), each an int64."""
    graph = tf.Graph()
    with graph.as_default():
        generation = tf.compat.v1.placeholder(tf.int64, [])
        step = tf.compat.v1.placeholder(tf.int64, [])
        out = generation * 100 + step
    with tf.compat.v1.Session(graph=graph) as session:
        call = make_callable(session, {"out": out}, [step, generation])
        assert call(3, -1) == {"out": -97}
        assert call(4, 7)["out"] == 704
