"""Driving a step loop to the end: log lines, summaries, evaluations.

The chief of the ps cluster and the benchmark's baselines all train the
same way: runs of steps that end at the next log, evaluation or checkpoint
boundary; a line (progress_line.py) and TensorBoard scalars every
`log_every` steps; a test-set evaluation every `eval_every` steps and at
the end. Training time counts the step runs only, not evaluation or
checkpoint pauses, and not the first step, which waits for every worker to
start and warms up the graph; images per second and time-to-accuracy are
measured on it. What it measured comes back as a results.Outcome.
"""

import dataclasses
import time
from typing import Callable

from absl import logging

from trainer.learning import optim
from trainer.common.config import TrainConfig
from trainer.observe import progress_line
from trainer.observe.results import Outcome
from trainer.observe.summaries import write_scalars


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


def drive(run_steps: Callable, evaluate: Callable | None,
          save: Callable | None, config: TrainConfig, step: int,
          train_steps: int, writer,
          slices: Callable[[], list] | None = None) -> Outcome:
    """Trains from `step` to `train_steps`.

    Args:
      run_steps: (step, count) -> dict with "stats" (sums of examples, loss
        and correct predictions over the run) and, with backup workers,
        "dropped" (late gradients so far). Runs exactly `count` steps.
      evaluate: () -> dict with "accuracy" and "loss" on the test set, or
        None where this process does not evaluate.
      save: (step) -> None writes a checkpoint, or None.
      writer: a tf.compat.v1.summary.FileWriter, or None.
      slices: () -> each worker's examples in the latest round, for the
        progress line, or None.
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
            logging.info("%s in %.1f s (waiting for the workers, warming "
                         "up)", progress_line.FIRST_STEP_DONE,
                         time.monotonic() - run_start)
            warm_up = False
            interval = _Interval(time.monotonic())
        else:
            outcome.train_secs += time.monotonic() - run_start
            outcome.timed_steps += count
            outcome.timed_examples += float(out["stats"][0])
            interval.add(count, out["stats"])
        if interval.steps and (step % config.log_every == 0
                               or step == train_steps):
            _log(config, writer, step, train_steps, interval, outcome.dropped,
                 slices() if slices else None)
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


def _log(config, writer, step, train_steps, interval, dropped,
         slices) -> None:
    elapsed = max(time.monotonic() - interval.start_time, 1e-9)
    loss = interval.loss_sum / interval.examples
    accuracy = interval.correct / interval.examples
    images_per_sec = interval.examples / elapsed
    step_ms = 1000.0 * elapsed / interval.steps
    logging.info("%s", progress_line.format_line(
        step, train_steps, loss, accuracy, images_per_sec, step_ms, dropped,
        slices))
    write_scalars(writer, step, {
        "train/loss": loss,
        "train/accuracy": accuracy,
        "train/learning_rate": optim.learning_rate_at(config, step - 1,
                                                     train_steps),
        "perf/images_per_sec": images_per_sec,
        "perf/step_time_ms": step_ms,
        "sync/dropped_gradients": dropped,
    })


def _evaluate(evaluate, writer, step: int, train_secs: float) -> dict:
    start = time.monotonic()
    out = evaluate()
    result = {"step": step, "accuracy": float(out["accuracy"]),
              "loss": float(out["loss"]), "train_secs": round(train_secs, 3)}
    logging.info("%s", progress_line.format_eval_line(
        step, result["accuracy"], result["loss"], time.monotonic() - start))
    write_scalars(writer, step, {"eval/accuracy": result["accuracy"],
                                 "eval/loss": result["loss"]})
    if writer:
        writer.flush()
    return result
