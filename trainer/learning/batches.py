"""Batches: which examples each worker computes at each global step.

The same arithmetic runs on every worker, so the workers agree on the
global batch of every step without talking to each other: the epoch's
order is a stateless shuffle of (seed, epoch), and worker k takes the
contiguous slice shard_bounds(...)[k] of each global batch. The training
set lives in worker-local variables and is batched inside the graph.
"""

import numpy as np
import tensorflow as tf

from trainer.learning.data import IMAGE_SIZE


# --- Batching and sharding (the same arithmetic on every worker) ---

def shard_bounds(global_batch: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) slices of a global batch, one per worker.

    The first `global_batch % num_shards` slices hold one example more, so
    sizes differ by at most one and the slices cover the batch exactly once.
    A --batch_size smaller than the workers is refused by config.validate.
    """
    if num_shards < 1 or global_batch < num_shards:
        raise ValueError(f"a global batch of {global_batch} has no slice of "
                         f"at least one example for each of {num_shards}")
    base, extra = divmod(global_batch, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def steps_per_epoch(num_examples: int, global_batch: int) -> int:
    """Full global batches per epoch; the remainder of an epoch is skipped.
    A --batch_size above the examples is refused by the config
    (TrainConfig.resolved_train_steps, called once the data is read)."""
    if global_batch > num_examples:
        raise ValueError(f"a global batch of {global_batch} is more than the "
                         f"{num_examples} examples")
    return num_examples // global_batch


# --- In-graph batching (the training loop runs inside the graph) ---

class InGraphTrainSet:
    """The training set in worker-local variables, batched by global step.

    Create it under the worker's device. `initialize(session, images,
    labels)` fills the variables once; after that a batch costs no Python
    and no copy through the session.run boundary. The epoch's order is
    computed with a stateless shuffle of (seed, epoch), so every worker
    derives the same order without talking to the others, and cached until
    the epoch changes.
    """

    def __init__(self, num_examples: int, seed: int, global_batch: int,
                 bounds: tuple[int, int]):
        self.num_examples = num_examples
        self.seed = seed
        self.global_batch = global_batch
        self.bounds = bounds
        self.steps_per_epoch = steps_per_epoch(num_examples, global_batch)
        self._images_in = tf.compat.v1.placeholder(
            tf.uint8, [num_examples, IMAGE_SIZE, IMAGE_SIZE])
        self._labels_in = tf.compat.v1.placeholder(tf.int32, [num_examples])
        self._images = local_variable("train_images", self._images_in)
        self._labels = local_variable("train_labels", self._labels_in)
        self._order = local_variable("epoch_order",
                                      tf.zeros([num_examples], tf.int32))
        self._order_epoch = local_variable("epoch_of_order",
                                            tf.constant(-1, tf.int64))
        self._loaded = tf.compat.v1.is_variable_initialized(self._labels)

    def initialize(self, session, images: np.ndarray, labels: np.ndarray):
        """Fills the variables, unless an earlier session of this process
        did: they live on this worker's own server, which outlives a
        session, so a worker that reconnects (a ps lost, a link cut)
        does not copy the training set again."""
        if session.run(self._loaded):
            return
        session.run(
            [v.initializer for v in (self._images, self._labels, self._order,
                                     self._order_epoch)],
            {self._images_in: images, self._labels_in: labels.astype(np.int32)})

    def order(self, epoch: tf.Tensor) -> tf.Tensor:
        """The visiting order of `epoch`: int32 [num_examples]."""
        return epoch_order(self.num_examples, self.seed, epoch)

    def batch(self, step: tf.Tensor, bounds=None
              ) -> tuple[tf.Tensor, tf.Tensor]:
        """Rows bounds = (start, end) of the global batch of step `step`
        (int64 scalar); ints or int64 [] tensors, default self.bounds.

        Returns:
          images: float32 [m, 28, 28, 1] in [0, 1], m = end - start.
          labels: int32 [m].
        """
        epoch = step // self.steps_per_epoch
        position = step % self.steps_per_epoch

        def reload():
            fresh = self.order(epoch)
            with tf.control_dependencies([
                    self._order.assign(fresh, read_value=False),
                    self._order_epoch.assign(epoch, read_value=False)]):
                return tf.identity(fresh)

        order = tf.cond(tf.equal(epoch, self._order_epoch.read_value()),
                        self._order.read_value, reload)
        indices = slice_indices(order, position, self.global_batch,
                                bounds or self.bounds)
        images = tf.gather(self._images.read_value(), indices)
        labels = tf.gather(self._labels.read_value(), indices)
        return model_input(images), labels


def epoch_order(num_examples: int, seed: int, epoch: tf.Tensor) -> tf.Tensor:
    """The visiting order of `epoch` (int64 []): int32 [num_examples], a
    stateless shuffle of (seed, epoch), the same in every process."""
    return tf.random.experimental.stateless_shuffle(
        tf.range(num_examples, dtype=tf.int32),
        seed=tf.stack([tf.constant(seed, tf.int64),
                       tf.cast(epoch, tf.int64)]))


def slice_indices(order: tf.Tensor, position: tf.Tensor, global_batch: int,
                  bounds: tuple[int, int]) -> tf.Tensor:
    """Example indices of rows [start, end) of the `position`-th global
    batch of an epoch whose order is `order`: int32 [end - start]. The
    bounds are ints or integer [] tensors."""
    start, end = (tf.cast(b, tf.int32) for b in bounds)
    first = tf.cast(position, tf.int32) * global_batch + start
    return tf.slice(order, tf.reshape(first, [1]),
                    tf.reshape(end - start, [1]))


def model_input(images: tf.Tensor) -> tf.Tensor:
    """uint8 [n, 28, 28] pixels -> float32 [n, 28, 28, 1] in [0, 1], what
    the models take."""
    return tf.reshape(tf.cast(images, tf.float32) / 255.0,
                      [-1, IMAGE_SIZE, IMAGE_SIZE, 1])


def local_variable(name: str, initial_value) -> tf.Variable:
    """A variable of this worker alone (not shared, not checkpointed)."""
    return tf.compat.v1.Variable(
        initial_value, name=name, trainable=False, use_resource=True,
        collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
