"""The sync protocol's queues: FIFOs on a ps task, shared by name."""

import tensorflow as tf

CAPACITY = 1 << 30   # never full: a blocked enqueue would stall its sender


def shared_queue(shared_name: str, dtypes: list, shapes: list):
    """A FIFOQueue on this device, one for all tasks naming it alike."""
    return tf.queue.FIFOQueue(CAPACITY, dtypes, shapes=shapes,
                              shared_name=shared_name,
                              name=shared_name.replace("/", "_"))


def put_if(queue, when: tf.Tensor, element) -> tf.Operation:
    """Enqueues `element` (its components, cast to the queue's dtypes) if
    `when` (bool []): an enqueue_many of 0 or 1 elements, so no cond."""
    count = tf.cast(when, tf.int32)
    element = [tf.cast(c, dtype) for c, dtype in zip(element, queue.dtypes)]
    return queue.enqueue_many([tf.broadcast_to(c, [count, *c.shape])
                               for c in element])
