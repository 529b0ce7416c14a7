"""A run's results file: what every trainer's results.json holds, and
writing it whole.

`Outcome` is what the step loop (progress.drive) measured; `results_fields`
adds the final accuracy, the flags, peak memory and the provenance
(provenance.py); `write_json` writes a file whole or not at all.
"""

import dataclasses
import json
import os
import pathlib
import resource

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
