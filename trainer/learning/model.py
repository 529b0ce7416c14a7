"""The three MNIST models, as graph builders.

Each builder turns a batch of images into logits using only
`tf.compat.v1.get_variable` and `tf.nn` ops. Builders know nothing of
devices, clusters or optimizers: where a variable lives is decided by the
caller's variable scope (the trainer packs them into flat per-ps-shard
variables through a custom getter).

Initialisation is seeded per variable, so the same `seed` gives the same
initial parameters in every process and every cluster shape.
"""

from typing import Callable

import tensorflow as tf

from trainer.common.config import MODELS

IMAGE_PIXELS = 28 * 28
NUM_CLASSES = 10

# dropout(x, rate) -> x with a fraction `rate` of its units zeroed and the
# rest scaled by 1 / (1 - rate). The caller supplies it so that dropout masks
# can be a function of the example, not of the worker that computes it.
Dropout = Callable[[tf.Tensor, float], tf.Tensor]


def no_dropout(x: tf.Tensor, rate: float) -> tf.Tensor:
    del rate
    return x


class _Vars:
    """Creates variables with a distinct, reproducible seed each."""

    def __init__(self, seed: int):
        self._seed = seed
        self._count = 0

    def kernel(self, name: str, shape: list[int]) -> tf.Tensor:
        self._count += 1
        init = tf.compat.v1.glorot_uniform_initializer(
            seed=self._seed * 1000 + self._count)
        return tf.compat.v1.get_variable(name, shape, tf.float32, init)

    def bias(self, name: str, shape: list[int]) -> tf.Tensor:
        return tf.compat.v1.get_variable(
            name, shape, tf.float32, tf.compat.v1.zeros_initializer())

    def dense(self, name: str, x: tf.Tensor, units: int) -> tf.Tensor:
        """x [n, d] -> x @ kernel [d, units] + bias [units]."""
        kernel = self.kernel(f"{name}/kernel", [int(x.shape[1]), units])
        return tf.nn.bias_add(tf.matmul(x, kernel),
                              self.bias(f"{name}/bias", [units]))


def softmax(images: tf.Tensor, dropout: Dropout, seed: int,
            hidden_units: int) -> tf.Tensor:
    """Multinomial logistic regression, 784 x 10.

    Args:
      images: float32 [n, 28, 28, 1] in [0, 1].
    Returns:
      logits: float32 [n, 10].
    """
    del dropout, hidden_units
    x = tf.reshape(images, [-1, IMAGE_PIXELS])
    return _Vars(seed).dense("dense", x, NUM_CLASSES)


def mlp(images: tf.Tensor, dropout: Dropout, seed: int,
        hidden_units: int) -> tf.Tensor:
    """One hidden ReLU layer: 784 -> hidden_units -> 10.

    Args:
      images: float32 [n, 28, 28, 1] in [0, 1].
    Returns:
      logits: float32 [n, 10].
    """
    del dropout
    v = _Vars(seed)
    x = tf.reshape(images, [-1, IMAGE_PIXELS])
    hidden = tf.nn.relu(v.dense("hidden", x, hidden_units))
    return v.dense("logits", hidden, NUM_CLASSES)


def cnn(images: tf.Tensor, dropout: Dropout, seed: int,
        hidden_units: int) -> tf.Tensor:
    """A small conv net after Keras' mnist_convnet (34,826 parameters).

    conv 3x3x32 + ReLU -> max-pool 2 -> conv 3x3x64 + ReLU -> max-pool 2 ->
    flatten (1600) -> dropout 0.5 -> dense 10.

    Args:
      images: float32 [n, 28, 28, 1] in [0, 1].
    Returns:
      logits: float32 [n, 10].
    """
    del hidden_units
    v = _Vars(seed)

    def conv_block(x, name, filters_in, filters_out):
        kernel = v.kernel(f"{name}/kernel", [3, 3, filters_in, filters_out])
        x = tf.nn.conv2d(x, kernel, strides=1, padding="VALID")
        x = tf.nn.relu(tf.nn.bias_add(x, v.bias(f"{name}/bias",
                                                [filters_out])))
        return tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID")

    x = conv_block(images, "conv1", 1, 32)   # [n, 13, 13, 32]
    x = conv_block(x, "conv2", 32, 64)       # [n, 5, 5, 64]
    x = tf.reshape(x, [-1, 5 * 5 * 64])
    x = dropout(x, 0.5)
    return v.dense("logits", x, NUM_CLASSES)


_BUILDERS = {"softmax": softmax, "mlp": mlp, "cnn": cnn}
assert tuple(_BUILDERS) == MODELS


def build(name: str, images: tf.Tensor, dropout: Dropout = no_dropout,
          seed: int = 0, hidden_units: int = 128) -> tf.Tensor:
    """Builds model `name` on `images` [n, 28, 28, 1]; returns logits [n, 10]."""
    return _BUILDERS[name](images, dropout, seed, hidden_units)


def per_example_loss(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Softmax cross-entropy: logits [n, 10], int labels [n] -> float32 [n]."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                          logits=logits)


def correct(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """1.0 where the arg-max of logits [n, 10] equals labels [n], else 0.0."""
    predictions = tf.argmax(logits, axis=1, output_type=labels.dtype)
    return tf.cast(tf.equal(predictions, labels), tf.float32)
