"""The sync protocol's queues: FIFOs on a ps task, shared by name."""

import tensorflow as tf

# Never full in practice: an enqueue that blocked would stall its sender.
CAPACITY = 1 << 30


def shared_queue(shared_name: str, dtypes: list, shapes: list):
    """A FIFOQueue on the current device that every task building it with
    the same shared_name addresses alike; its op is named after it."""
    return tf.queue.FIFOQueue(CAPACITY, dtypes, shapes=shapes,
                              shared_name=shared_name,
                              name=shared_name.replace("/", "_"))


def step_queue(shared_name: str):
    """A shared queue of step numbers (int64 scalars)."""
    return shared_queue(shared_name, [tf.int64], [[]])
