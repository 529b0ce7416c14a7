"""Model output shapes, parameter counts and seeded initialisation."""

import numpy as np
import pytest
import tensorflow as tf

from trainer.learning import model
from trainer.learning import params

# Keras' mnist_convnet has 34,826 parameters; ours is the same network.
EXPECTED_PARAMS = {"softmax": 7850, "mlp": 784 * 128 + 128 + 128 * 10 + 10,
                   "cnn": 34826}


@pytest.mark.parametrize("name", model.MODELS)
def test_logits_shape_and_parameter_count(name):
    with tf.Graph().as_default():
        images = tf.zeros([5, 28, 28, 1])
        logits = model.build(name, images)
        variables = tf.compat.v1.global_variables()
        count = sum(int(np.prod(v.shape)) for v in variables)
    assert logits.shape.as_list() == [5, 10]
    assert count == EXPECTED_PARAMS[name]


def test_mlp_width_is_a_parameter():
    specs = params.record(lambda: model.build(
        "mlp", tf.zeros([1, 28, 28, 1]), hidden_units=32))
    assert [s.shape for s in specs] == [(784, 32), (32,), (32, 10), (10,)]


def initial_values(name, seed):
    with tf.Graph().as_default():
        logits = model.build(name, tf.zeros([1, 28, 28, 1]), seed=seed)
        del logits
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            return session.run(tf.compat.v1.global_variables())


def test_initialisation_is_seeded():
    first, again, other = (initial_values("cnn", 1), initial_values("cnn", 1),
                           initial_values("cnn", 2))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], other[0])


def test_dropout_is_the_callers():
    seen = []

    def recording_dropout(x, rate):
        seen.append((x.shape.as_list(), rate))
        return x

    with tf.Graph().as_default():
        model.build("cnn", tf.zeros([3, 28, 28, 1]), recording_dropout)
    assert seen == [([3, 1600], 0.5)]
