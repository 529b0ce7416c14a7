"""TensorBoard scalars written from Python, in graph-mode and eager
programs alike."""

import tensorflow as tf


def summary_writer(logdir: str, graph=None):
    """A FileWriter for scalars built in Python; works in eager programs.

    (tf.compat.v1.summary.FileWriter refuses to be created in eager mode,
    but only checks at creation.)
    """
    with (graph or tf.Graph()).as_default():
        return tf.compat.v1.summary.FileWriter(logdir, graph)


def write_scalars(writer, step: int, values: dict) -> None:
    if writer is None:
        return
    summary = tf.compat.v1.Summary(value=[
        tf.compat.v1.Summary.Value(tag=tag, simple_value=float(value))
        for tag, value in values.items()])
    writer.add_summary(summary, step)
