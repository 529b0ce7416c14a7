"""TensorBoard scalars and text written from Python, in graph-mode and
eager programs alike."""

import json

import tensorflow as tf

from trainer.observe import provenance

# The text card that identifies a run: one per (re)start of the chief.
RUN_TEXT_TAG = "run/start"


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


def write_text(writer, step: int, tag: str, markdown: str) -> None:
    """A card of TensorBoard's Text tab (`markdown`, rendered) at `step`."""
    if writer is None:
        return
    metadata = tf.compat.v1.SummaryMetadata(
        plugin_data=tf.compat.v1.SummaryMetadata.PluginData(
            plugin_name="text"))
    value = tf.compat.v1.Summary.Value(
        tag=tag, metadata=metadata,
        tensor=tf.make_tensor_proto(markdown, dtype=tf.string))
    writer.add_summary(tf.compat.v1.Summary(value=[value]), step)


def write_run_card(writer, step: int, flags: dict, cluster: dict) -> None:
    """The run/start card of this process's run (run_card), at `step`."""
    write_text(writer, step, RUN_TEXT_TAG,
               run_card(flags, cluster, provenance.collect(), step))


def run_card(flags: dict, cluster: dict, origin: dict, step: int) -> str:
    """The run/start card: markdown tables of the cluster, the provenance
    (`origin`, provenance.collect()) and every flag, so that a run is
    identified later in TensorBoard."""
    def table(rows: dict) -> str:
        lines = ["| name | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | `{_cell(v)}` |"
                  for k, v in sorted(rows.items())]
        return "\n".join(lines)

    return "\n\n".join([
        f"**started at global step {step}**",
        "### cluster", table({job: ", ".join(addresses) for job, addresses
                             in cluster.items()}),
        "### provenance", table(origin),
        "### flags", table(flags)])


def _cell(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("`", "'")
