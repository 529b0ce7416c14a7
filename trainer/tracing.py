"""--trace_steps: run chosen steps alone with TensorFlow's full trace, and
write what they show (a Chrome trace and a time breakdown per worker).

The traced steps are the same steps the run would take anyway (same
parameters, same batches), only run one per session.run; so tracing
changes no result, just the speed of those few steps.
"""

import pathlib

from absl import logging
import numpy as np
import tensorflow as tf

from trainer import devices
from trainer import timeline


def split_loop(loop, traced, trace_range: tuple[int, int], traces: list):
    """Wraps loop(start, count) so that steps in [first, end) run one at a
    time through `traced`, appending (step, RunMetadata) to `traces`.

    Outputs of the pieces are merged as one run's: steps_done and stats
    summed, next_step and dropped from the last piece. A piece that stops
    early (the chief's STOP, a skip of a backup worker) ends the run there.
    """
    first, end = trace_range

    def run(start: int, count: int) -> dict:
        pieces, step, stop = [], start, start + count
        while step < stop:
            if first <= step < end:
                metadata = tf.compat.v1.RunMetadata()
                out = traced(step, 1, run_metadata=metadata)
                traces.append((step, metadata))
                wanted = 1
            else:
                wanted = (min(stop, first) if step < first else stop) - step
                out = loop(step, wanted)
            pieces.append(out)
            if int(out["steps_done"]) != wanted:
                break
            step = int(out["next_step"])
            if step < 0:
                break
        return _merge(pieces)

    return run


def _merge(pieces: list[dict]) -> dict:
    merged = dict(pieces[-1])
    merged["steps_done"] = np.int64(sum(int(p["steps_done"])
                                        for p in pieces))
    if "stats" in merged:
        merged["stats"] = np.sum([p["stats"] for p in pieces], axis=0)
    return merged


def write_traces(traces: list, logdir: str, worker_index: int,
                 is_chief: bool, writer=None) -> dict | None:
    """Writes trace_worker<k>.json (Chrome trace) in logdir, logs the mean
    breakdown of the traced steps and returns it (None if none traced).

    `writer`, a summary FileWriter, also gets each step's RunMetadata for
    TensorBoard's graph view.
    """
    if not traces:
        return None
    folder = pathlib.Path(logdir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"trace_worker{worker_index}.json"
    steps = [step for step, _ in traces]
    metadatas = [metadata for _, metadata in traces]
    timeline.write_chrome_trace(str(path), metadatas, steps)
    device = devices.worker_device(worker_index)
    result = timeline.mean_breakdown(
        [timeline.breakdown(m, device, is_chief) for m in metadatas])
    result["steps"] = steps
    logging.info("wrote %s (steps %d to %d); mean step breakdown:\n%s",
                 path, steps[0], steps[-1], timeline.format_breakdown(result))
    if writer is not None:
        for step, metadata in traces:
            writer.add_run_metadata(metadata, f"step_{step}", step)
        writer.flush()
    return result
