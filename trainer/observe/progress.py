"""Driving a step loop to the end: log lines, summaries, evaluations.

The chief of the ps cluster and the benchmark's baselines all train the
same way: runs of steps that end at the next log, evaluation or checkpoint
boundary; a line and TensorBoard scalars every `log_every` steps; a test-set
evaluation every `eval_every` steps and at the end. Training time counts
the step runs only, not evaluation or checkpoint pauses, and not the first
step, which waits for every worker to start and warms up the graph; images
per second and time-to-accuracy are measured on it.
"""

import dataclasses
import json
import os
import pathlib
import re
import resource
import time
from typing import Callable

from absl import logging
import tensorflow as tf

from trainer.learning import optim
from trainer.common.config import TrainConfig
from trainer.observe import provenance


@dataclasses.dataclass
class Outcome:
    history: list        # evaluations: step, accuracy, loss, train_secs
    train_secs: float    # time in step runs, first step excluded
    timed_steps: int     # steps in train_secs
    dropped: int         # late gradients dropped (backup workers)
    wall_secs: float = 0.0  # first step to last, pauses included
    timed_examples: float = 0.0  # examples averaged in train_secs

    def summary(self) -> dict:
        """Times, images/s and mean step time, for results files. Images
        are the examples whose gradients were averaged: with backup
        workers, fewer than the global batch per step."""
        return {
            "wall_time_secs": self.wall_secs,
            "train_time_secs": self.train_secs,
            "images_per_sec": (self.timed_examples / self.train_secs
                               if self.train_secs else None),
            "mean_step_time_ms": (1000.0 * self.train_secs / self.timed_steps
                                  if self.timed_steps else None),
        }


def results_fields(outcome: Outcome, config: TrainConfig,
                   train_steps: int) -> dict:
    """What every trainer's results file holds: final accuracy and loss,
    steps, times, images/s, evaluations, peak memory, the flags and the
    provenance (versions, machine, commit: provenance.py)."""
    final = ({"final_test_accuracy": outcome.history[-1]["accuracy"],
              "final_test_loss": outcome.history[-1]["loss"]}
             if outcome.history else {})
    return {**final, "train_steps": train_steps,
            **outcome.summary(),
            "eval_history": outcome.history, "peak_rss_mb": peak_rss_mb(),
            "flags": dataclasses.asdict(config),
            "provenance": provenance.collect()}


def write_json(path: pathlib.Path, value: dict,
               indent: int | None = 2) -> None:
    """Writes `value` to `path` whole or not at all (a temporary file in
    the same folder, then a rename)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=indent) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclasses.dataclass
class _Interval:
    """Steps between two log lines, summed as the runs report them."""

    start_time: float
    steps: int = 0
    examples: float = 0.0
    loss_sum: float = 0.0
    correct: float = 0.0

    def add(self, steps: int, stats) -> None:
        """stats: a run's sums of (examples, loss sum, correct)."""
        self.steps += steps
        self.examples += float(stats[0])
        self.loss_sum += float(stats[1])
        self.correct += float(stats[2])


def steps_to_boundary(config: TrainConfig, step: int, train_steps: int) -> int:
    """Steps until the next log, eval or checkpoint boundary or the end."""
    ends = [train_steps]
    for every in (config.log_every, config.eval_every,
                  config.checkpoint_every):
        ends.append((step // every + 1) * every)
    return min(ends) - step


# What drive logs once the first (warm-up) step is done: training runs.
FIRST_STEP_DONE = "first step done"

def drive(run_steps: Callable, evaluate: Callable | None,
          save: Callable | None, config: TrainConfig, step: int,
          train_steps: int, writer) -> Outcome:
    """Trains from `step` to `train_steps`.

    Args:
      run_steps: (step, count) -> dict with "stats" (sums of examples, loss
        and correct predictions over the run) and, with backup workers,
        "dropped" (late gradients so far). Runs exactly `count` steps.
      evaluate: () -> dict with "accuracy" and "loss" on the test set, or
        None where this process does not evaluate.
      save: (step) -> None writes a checkpoint, or None.
      writer: a tf.compat.v1.summary.FileWriter, or None.
    """
    outcome = Outcome(history=[], train_secs=0.0, timed_steps=0, dropped=0)
    start_time = time.monotonic()
    warm_up = True
    interval = _Interval(time.monotonic())
    while step < train_steps:
        count = 1 if warm_up else steps_to_boundary(config, step, train_steps)
        run_start = time.monotonic()
        out = run_steps(step, count)
        step += count
        outcome.dropped = int(out.get("dropped", 0))
        if warm_up:
            logging.info(FIRST_STEP_DONE + " in %.1f s (waiting for the "
                         "workers, warming up)", time.monotonic() - run_start)
            warm_up = False
            interval = _Interval(time.monotonic())
        else:
            outcome.train_secs += time.monotonic() - run_start
            outcome.timed_steps += count
            outcome.timed_examples += float(out["stats"][0])
            interval.add(count, out["stats"])
        if interval.steps and (step % config.log_every == 0
                               or step == train_steps):
            _log(config, writer, step, train_steps, interval, outcome.dropped)
            interval = _Interval(time.monotonic())
        if evaluate and (step % config.eval_every == 0
                         or step == train_steps):
            outcome.history.append(_evaluate(evaluate, writer, step,
                                             outcome.train_secs))
        if save and (step % config.checkpoint_every == 0
                     or step == train_steps):
            save(step)
    if evaluate and (not outcome.history
                     or outcome.history[-1]["step"] != train_steps):
        outcome.history.append(_evaluate(evaluate, writer, train_steps,
                                         outcome.train_secs))
    outcome.wall_secs = time.monotonic() - start_time
    return outcome


def _log(config, writer, step, train_steps, interval, dropped) -> None:
    elapsed = max(time.monotonic() - interval.start_time, 1e-9)
    loss = interval.loss_sum / interval.examples
    accuracy = interval.correct / interval.examples
    images_per_sec = interval.examples / elapsed
    step_ms = 1000.0 * elapsed / interval.steps
    eta = (train_steps - step) * step_ms / 1000.0
    logging.info(
        "step %d/%d  loss %.4f  train accuracy %.2f%%  %.0f images/s  "
        "%.2f ms/step  dropped gradients %d  ETA %s", step, train_steps,
        loss, 100 * accuracy, images_per_sec, step_ms, dropped,
        format_secs(eta))
    write_scalars(writer, step, {
        "train/loss": loss,
        "train/accuracy": accuracy,
        "train/learning_rate": optim.learning_rate_at(config, step - 1,
                                                     train_steps),
        "perf/images_per_sec": images_per_sec,
        "perf/step_time_ms": step_ms,
        "sync/dropped_gradients": dropped,
    })


# The line _log writes; searched anywhere in a line, after absl's prefix
# and a launcher's `[worker0] `. Keep the two in step.
_PROGRESS_LINE = re.compile(
    r"step (\d+)/(\d+)  loss (\S+)  train accuracy (\S+)%  (\S+) images/s  "
    r"(\S+) ms/step  dropped gradients (\d+)  ETA (\d+:\d\d:\d\d)")


def parse_progress_line(line: str) -> dict | None:
    """The figures of a progress line written by _log, or None for any
    other line: step, train_steps, loss, train_accuracy (a fraction),
    images_per_sec, step_ms, dropped_gradients and eta ("H:MM:SS")."""
    match = _PROGRESS_LINE.search(line)
    if match is None:
        return None
    step, steps, loss, accuracy, images, ms, dropped, eta = match.groups()
    return {"step": int(step), "train_steps": int(steps),
            "loss": float(loss), "train_accuracy": float(accuracy) / 100,
            "images_per_sec": float(images), "step_ms": float(ms),
            "dropped_gradients": int(dropped), "eta": eta}


def _evaluate(evaluate, writer, step: int, train_secs: float) -> dict:
    start = time.monotonic()
    out = evaluate()
    result = {"step": step, "accuracy": float(out["accuracy"]),
              "loss": float(out["loss"]), "train_secs": round(train_secs, 3)}
    logging.info("step %d: test accuracy %.2f%%  test loss %.4f  (%.1f s)",
                 step, 100 * result["accuracy"], result["loss"],
                 time.monotonic() - start)
    write_scalars(writer, step, {"eval/accuracy": result["accuracy"],
                                 "eval/loss": result["loss"]})
    if writer:
        writer.flush()
    return result


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


def format_secs(secs: float) -> str:
    secs = int(round(secs))
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"
