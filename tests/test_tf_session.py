"""The session helpers every role uses (trainer/common/tf_session.py)."""

import tensorflow as tf

from trainer.common.tf_session import make_callable


def test_a_callables_fixed_feeds_are_read_at_each_call():
    """A fixed feed set after the callable was made (the chief's generation,
    once claimed, on a callable made beforehand) is the one fed."""
    graph = tf.Graph()
    with graph.as_default():
        generation = tf.compat.v1.placeholder(tf.int64, [])
        step = tf.compat.v1.placeholder(tf.int64, [])
        out = generation * 100 + step
    with tf.compat.v1.Session(graph=graph) as session:
        call = make_callable(session, {"out": out}, [step], {generation: -1})
        assert call(3)["out"] == -97
        call.fixed[generation] = 7
        assert call(4)["out"] == 704
