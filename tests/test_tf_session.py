"""The session helpers every role uses (trainer/common/tf_session.py)."""

import tensorflow as tf

from trainer.common.tf_session import error_summary, make_callable


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


def test_a_sessions_error_is_said_by_its_message_and_node():
    graph = tf.Graph()
    with graph.as_default():
        v = tf.compat.v1.get_variable("v", [2], use_resource=True)
        read = v.read_value() * 2
    with tf.compat.v1.Session(graph=graph) as session:
        try:
            session.run(read)
        except tf.errors.FailedPreconditionError as e:
            said = error_summary(e)
    assert said.startswith("Could not find variable v."), said
    assert said.endswith("(at Read/ReadVariableOp)"), said
    assert len(said) <= 200 + len(" (at Read/ReadVariableOp)")


def test_a_remote_tasks_error_is_joined_to_what_went_wrong_there():
    error = tf.errors.UnavailableError(
        None, None, "From /job:ps/replica:0/task:1:\nSocket closed\n"
                    "Additional GRPC error information: ...")
    assert error_summary(error) == (
        "From /job:ps/replica:0/task:1: Socket closed")


def test_an_error_without_a_message_is_said_by_its_type():
    assert error_summary(tf.errors.CancelledError(None, None, "")) == (
        "CancelledError")
