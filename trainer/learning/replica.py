"""One replica's computation: the model on a batch, dropout, gradients and
evaluation. The ps trainer and the baselines all compute through here.

Dropout masks depend only on (seed, step, example), never on which worker
computes an example, so a step's gradient is the same however the global
batch is split (the exactness tests rely on it).
"""

import dataclasses
from typing import Callable

import tensorflow as tf

from trainer.learning import batches
from trainer.learning import fixed_point
from trainer.learning import model as model_lib
from trainer.learning import params as params_lib
from trainer.common.config import TrainConfig
from trainer.learning.data import IMAGE_SIZE

MICRO_PARALLEL = 8  # micro-batches computed at once
EVAL_CHUNK = 1000  # test images per forward pass; bounds the cnn's memory
NUM_STATS = 3      # a replica's statistics: examples, loss sum, correct
_DROPOUT_SEED_SALT = 0x5EED


def param_specs(model: str, hidden_units: int,
                seed: int = 0) -> list[params_lib.ParamSpec]:
    """Model `model`'s parameters (names, shapes, initializers), in order."""
    return params_lib.record(lambda: model_lib.build(
        model, tf.zeros([1, IMAGE_SIZE, IMAGE_SIZE, 1]), seed=seed,
        hidden_units=hidden_units))


def model_specs(config: TrainConfig) -> list[params_lib.ParamSpec]:
    """The run's model's parameters, as param_specs gives them."""
    return param_specs(config.model, config.hidden_units, config.seed)


def logits(config: TrainConfig, layout: params_lib.FlatLayout,
           shard_values: list, images: tf.Tensor,
           dropout: model_lib.Dropout = model_lib.no_dropout) -> tf.Tensor:
    """The model with its parameters served from flat shard values.

    Args:
      shard_values: float32 [n_i] per shard of `layout`.
      images: float32 [n, 28, 28, 1] in [0, 1].
    Returns:
      float32 [n, 10].
    """
    with tf.compat.v1.variable_scope(
            params_lib.SCOPE, reuse=tf.compat.v1.AUTO_REUSE,
            custom_getter=layout.getter(shard_values)):
        return model_lib.build(config.model, images, dropout, config.seed,
                               config.hidden_units)


def example_uniform(seed: int, step: tf.Tensor, bounds, width: int
                    ) -> tf.Tensor:
    """Uniform noise for rows [start, end) of global step `step`'s batch.

    Row r of the whole global batch always gets the same numbers, whichever
    worker computes it: the rows are one Philox stream keyed by (seed,
    step), and each worker starts the stream at its first row. So dropout,
    like everything else, does not depend on how the batch is split.

    bounds: (start, end), ints or int64 [] tensors.
    Returns float32 [end - start, width] in [0, 1).
    """
    start, end = (tf.cast(b, tf.int64) for b in bounds)
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(
        seed=tf.stack([tf.constant(seed ^ _DROPOUT_SEED_SALT, tf.int64),
                       tf.cast(step, tf.int64)]))
    first = start * width
    skip = first % 4  # Philox yields four floats per counter increment
    counter = counter + tf.cast(tf.stack([first // 4, 0]), tf.uint64)
    noise = tf.raw_ops.StatelessRandomUniformV2(
        shape=tf.reshape((end - start) * width + skip, [1]), key=key,
        counter=counter, alg=1, dtype=tf.float32)  # alg 1: Philox
    return tf.reshape(noise[skip:], tf.stack([end - start, width]))


def global_batch_dropout(seed: int, step: tf.Tensor,
                         bounds: tuple[int, int]) -> model_lib.Dropout:
    """A dropout whose masks depend only on (seed, step, example)."""

    def dropout(x: tf.Tensor, rate: float) -> tf.Tensor:
        noise = example_uniform(seed, step, bounds, int(x.shape[1]))
        return tf.where(noise >= rate, x / (1.0 - rate), tf.zeros_like(x))

    return dropout


def batch_stats(logits_: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """float32 [NUM_STATS]: examples, loss sum and correct predictions of
    logits [n, 10] against int labels [n]."""
    return tf.stack([
        tf.cast(tf.size(labels), tf.float32),
        tf.reduce_sum(model_lib.per_example_loss(logits_, labels)),
        tf.reduce_sum(model_lib.correct(logits_, labels))])


@dataclasses.dataclass
class Replica:
    """One worker's gradient computation for one step (tensors on it)."""

    step: tf.Tensor          # int64 [], the global step computed
    # per shard: gradient of the loss sum, float32 [n_s] (int32 [n_s] in
    # fixed point with --deterministic; fixed_point.mean divides either)
    shard_grads: list
    stats: tf.Tensor         # float32 [NUM_STATS]


def fixed_point_of(config: TrainConfig) -> fixed_point.Scheme | None:
    """The run's fixed point (--deterministic), or None (float sums)."""
    if not config.deterministic:
        return None
    return fixed_point.scheme(config.batch_size, config.micro_batch_rows())


def compute_gradients(config: TrainConfig, layout: params_lib.FlatLayout,
                      trainset: batches.InGraphTrainSet, step: tf.Tensor,
                      bounds, shard_values: list) -> Replica:
    """Forward and backward pass on rows bounds = [first, end) (int64 [2]
    or a pair of ints) of the global batch of step `step`.

    The gradient is of the loss *sum* over the slice: the chief divides the
    sum of the workers' gradients by their example count, which weights
    every worker by its slice, whatever the slices' sizes.

    With --micro_batch=m the slice (whole micro-batches) is computed m rows
    at a time. A matmul's rows differ in their last bits with the number
    of rows it is given (the kernel blocks its sums by the shape), so only
    shapes fixed by the global batch, not by the slicing, give an example
    the same forward and backward pass whoever computes it. With
    --deterministic each micro-batch's gradient is then converted to fixed
    point and the sums are int32 (trainer/learning/fixed_point.py), so the
    slice's sum is the same integers in any order; without it they are
    float32 sums in micro-batch order.
    """
    m = config.micro_batch_rows()
    if not m:
        return _rows_gradients(config, layout, trainset, step, bounds,
                               shard_values)
    bounds = (bounds[0], bounds[1])
    first = tf.cast(bounds[0], tf.int64)
    count = (tf.cast(bounds[1], tf.int64) - first) // m
    # Read once for every micro-batch: the parameters by name (their
    # gradients are summed by name and flattened once, after the loop),
    # and the slice's images and labels.
    by_name = layout.unflatten(shard_values)
    names = list(by_name)
    images, labels = trainset.batch(step, bounds)

    def one_micro_batch(i, grads, stats):
        start = tf.cast(i * m, tf.int32)
        x = tf.ensure_shape(tf.slice(images, tf.stack([start, 0, 0, 0]),
                                     [m, IMAGE_SIZE, IMAGE_SIZE, 1]),
                            [m, IMAGE_SIZE, IMAGE_SIZE, 1])
        y = tf.slice(labels, tf.reshape(start, [1]), [m])
        rows = (first + i * m, first + (i + 1) * m)
        out = _model(config, by_name, x,
                     global_batch_dropout(config.seed, step, rows))
        part = batch_stats(out, y)
        new = tf.gradients(part[1], [by_name[n] for n in names])
        return (i + 1, [g if d is None else g + convert(d)
                        for g, d in zip(grads, new)], stats + part)

    fixed = fixed_point_of(config)
    convert, dtype = ((fixed.to_fixed, fixed_point.DTYPE)
                      if fixed else (tf.identity, tf.float32))
    _, grads, stats = tf.while_loop(
        lambda i, *_: i < count, one_micro_batch,
        [tf.constant(0, tf.int64),
         [tf.zeros(by_name[n].shape, dtype) for n in names],
         tf.zeros([NUM_STATS])], parallel_iterations=MICRO_PARALLEL)
    return Replica(step, layout.flatten(dict(zip(names, grads))), stats)


def _model(config: TrainConfig, by_name: dict, images: tf.Tensor,
           dropout: model_lib.Dropout) -> tf.Tensor:
    """logits() with the parameters given by name (float32 tensors)."""
    with tf.compat.v1.variable_scope(
            params_lib.SCOPE, reuse=tf.compat.v1.AUTO_REUSE,
            custom_getter=lambda getter, name, *a, **k: by_name[name]):
        return model_lib.build(config.model, images, dropout, config.seed,
                               config.hidden_units)


def _rows_gradients(config: TrainConfig, layout: params_lib.FlatLayout,
                    trainset: batches.InGraphTrainSet, step: tf.Tensor,
                    bounds, shard_values: list) -> Replica:
    """compute_gradients on rows [first, end) in one piece."""
    bounds = (bounds[0], bounds[1])
    images, labels = trainset.batch(step, bounds)
    dropout = global_batch_dropout(config.seed, step, bounds)
    out = logits(config, layout, shard_values, images, dropout)
    stats = batch_stats(out, labels)
    grads = tf.gradients(stats[1], shard_values)
    grads = [tf.zeros_like(v) if g is None else g
             for g, v in zip(grads, shard_values)]
    return Replica(step, grads, stats)


def chunk_sums(logits_of: Callable, images: tf.Tensor, labels: tf.Tensor,
               start, size) -> tuple[tf.Tensor, tf.Tensor]:
    """Loss sum and correct count of test images [start, start + size).

    Args:
      logits_of: float32 [m, 28, 28, 1] -> logits [m, 10], no dropout.
      images: uint8 [n, 28, 28]; labels: int32 [n].
    """
    x = batches.model_input(tf.slice(images, [start, 0, 0],
                                     [size, IMAGE_SIZE, IMAGE_SIZE]))
    y = tf.slice(labels, [start], [size])
    stats = batch_stats(logits_of(x), y)
    return stats[1], stats[2]


def evaluation(config: TrainConfig, layout: params_lib.FlatLayout,
               shard_values: list, num_examples: int):
    """Loss and accuracy over the whole test set in one session.run.

    The parameters are read once (shard_values); the test set, held in
    worker-local variables, goes through the model in chunks of EVAL_CHUNK
    images inside a while loop.

    Returns ({"loss", "accuracy"}: float32 [] tensors,
             initialize(session, images uint8 [n, 28, 28], labels [n])).
    """
    images_in = tf.compat.v1.placeholder(
        tf.uint8, [num_examples, IMAGE_SIZE, IMAGE_SIZE])
    labels_in = tf.compat.v1.placeholder(tf.int32, [num_examples])
    images = batches.local_variable("test_images", images_in)
    labels = batches.local_variable("test_labels", labels_in)
    num_chunks = -(-num_examples // EVAL_CHUNK)

    def chunk(i, loss_sum, correct_sum):
        start = i * EVAL_CHUNK
        size = tf.minimum(EVAL_CHUNK, num_examples - start)
        loss, correct = chunk_sums(
            lambda x: logits(config, layout, shard_values, x),
            images.read_value(), labels.read_value(), start, size)
        return i + 1, loss_sum + loss, correct_sum + correct

    _, loss_sum, correct_sum = tf.while_loop(
        lambda i, *_: i < num_chunks, chunk,
        [tf.constant(0), tf.constant(0.0), tf.constant(0.0)])
    outputs = {"loss": loss_sum / num_examples,
               "accuracy": correct_sum / num_examples}

    def initialize(session, test_images, test_labels):
        session.run([images.initializer, labels.initializer],
                    {images_in: test_images,
                     labels_in: test_labels.astype("int32")})

    return outputs, initialize
