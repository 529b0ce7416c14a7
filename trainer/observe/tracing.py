"""--trace_steps: run chosen steps with TensorFlow's full trace, and write
what they show (a Chrome trace and a time breakdown per worker).

The traced steps run in the same in-graph loop as every other step (same
parameters, same batches), in a session.run of their own that records the
step stats of every device; so tracing changes no result, only the speed
of those few steps (recording costs a little).
"""

import pathlib

from absl import logging
import numpy as np
import tensorflow as tf

from trainer.cluster import devices
from trainer.observe import timeline


def traced_run(session, fetches: dict, feeds: list, fixed=None):
    """(start, count, run_metadata) -> outputs: session.run with the full
    trace, feeding start and count to `feeds` and `fixed` (a feed dict)
    as it is. (A distributed session returns no step stats for callables
    made with trace options, so traced steps go through session.run.)"""
    options = tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE)

    def run(start: int, count: int, run_metadata) -> dict:
        return session.run(fetches, {**dict(zip(feeds, (start, count))),
                                     **(fixed or {})},
                           options=options, run_metadata=run_metadata)

    return run


def split_loop(loop, traced, trace_range: tuple[int, int], traces: list):
    """Wraps loop(start token, count) so that the steps in [first, end)
    run as one traced session.run of the same in-graph loop, appending
    (first step, steps, RunMetadata) to `traces`.

    A token is int64 [4] whose first element is the step. Outputs of the
    pieces are merged as one run's: steps_done and stats summed,
    next_token and dropped from the last piece. A piece that stops early
    (the chief's STOP or REJOIN, a step planned again) ends the run there.
    """
    first, end = trace_range

    def run(start, count: int) -> dict:
        pieces, token = [], np.asarray(start)
        step, stop = int(token[0]), int(token[0]) + count
        while step < stop:
            if first <= step < end:
                wanted = min(stop, end) - step
                metadata = tf.compat.v1.RunMetadata()
                out = traced(token, wanted, metadata)
                traces.append((step, int(out["steps_done"]), metadata))
            else:
                wanted = (min(stop, first) if step < first else stop) - step
                out = loop(token, wanted)
            pieces.append(out)
            if int(out["steps_done"]) != wanted:
                break
            token = out["next_token"]
            step = int(token[0])
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


def _per_step(breakdown: dict, count: int) -> dict:
    """A breakdown of `count` steps run in one loop, per step."""
    return {"step_ms": breakdown["step_ms"] / count,
            "ms": {c: v / count for c, v in breakdown["ms"].items()},
            "overlap_ms": breakdown["overlap_ms"] / count}


def _ranges(traces: list) -> str:
    return ", ".join(f"{step} to {step + count - 1}"
                     for step, count, _ in traces)


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
    timeline.write_chrome_trace(str(path), [m for _, _, m in traces],
                                [step for step, _, _ in traces])
    device = devices.worker_device(worker_index)
    per_step = [_per_step(timeline.breakdown(m, device, is_chief), count)
                for _, count, m in traces if count]
    result = timeline.mean_breakdown(per_step)
    result["steps"] = [step + i for step, count, _ in traces
                       for i in range(count)]
    result["num_steps"] = len(result["steps"])
    logging.info("wrote %s (steps %s); mean step breakdown:\n%s", path,
                 _ranges(traces), timeline.format_breakdown(result))
    if writer is not None:
        for step, _, metadata in traces:
            writer.add_run_metadata(metadata, f"step_{step}", step)
        writer.flush()
    return result
