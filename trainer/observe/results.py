"""A run's results file: what every trainer's results.json holds, and
writing it whole.

`Outcome` is what the step loop (progress.drive) measured; `results_fields`
adds the final accuracy, the flags, peak memory and the provenance
(provenance.py); `ChiefReport` and `ps_results` add what a ps run's chief
counted; `write_json` writes a file whole or not at all.
"""

import dataclasses
import json
import os
import pathlib
import resource

from absl import logging
import numpy as np

from trainer.cluster.spec import Cluster
from trainer.common.config import TrainConfig
from trainer.observe import provenance


RESULTS_FILE = "results.json"


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


@dataclasses.dataclass
class ChiefReport:
    """What a ps run's chief counted and timed in one launch."""

    steps_this_run: int
    counted: np.ndarray   # int64 [N, 2]: per worker, steps and examples
    pushed: dict          # worker -> gradients it says it pushed
    membership: list      # every roster change
    broken_steps: int     # steps not averaging the global batch once
    record_from: int      # the per-step record's first step (step_record)
    step_breakdown: dict | None = None   # traced step phases (tracing.py)


class Counted:
    """Each worker's averaged steps and examples, int64 [N, 2], over the
    steps from `since` on. ps 0 counts them (sync/contributions, from the
    last initialize or restore, whichever chief applied them); this adds
    what a restore by this chief set back (`before`)."""

    def __init__(self, num_workers: int):
        self._zeros = np.zeros([num_workers, 2], np.int64)
        self._at_save = {}     # step -> the counts at our checkpoint there
        self.before = None     # added to ps 0's counts
        self.since = None      # the first step counted
        self._ps0_from = None  # where ps 0's counts began, as last seen

    def initialized(self, step: int) -> None:
        self.before, self.since = self._zeros, step
        self._ps0_from = step

    def restored(self, step: int) -> None:
        """ps 0's counts start again at `step`: ours carry over a restore
        of a checkpoint of ours."""
        self.before = self._at_save.get(step, self._zeros)
        if step not in self._at_save:
            self.since = step
        self._ps0_from = step

    def kept(self, record_from: int) -> None:
        """Going on from the state on the ps tasks: ps 0's counts hold
        every step since record_from, our predecessors' too. If they
        began again since we last looked (ps 0 refilled from its copies),
        ours are lost with them, and the counts start there."""
        if self.before is None or record_from != self._ps0_from:
            self.before, self.since = self._zeros, record_from
        self._ps0_from = record_from

    def saved(self, step: int, on_ps0: np.ndarray) -> None:
        self._at_save[step] = self.total(on_ps0)

    def total(self, on_ps0: np.ndarray) -> np.ndarray:
        return self.before + on_ps0


def ps_results(outcome: Outcome, config: TrainConfig, train_steps: int,
               cluster: Cluster, counts: ChiefReport) -> dict:
    """The ps trainer's results.json. averaged_steps: the applied steps
    since this launch initialized or restored the model (steps_this_run
    of them), across connects and takeovers, whose average held each
    worker's gradient (ps-side, exact); averaged_examples: the examples of
    each worker's slices in them; pushed_gradients: what each worker says
    it pushed (stale, dropped and redone ones included); membership:
    every roster change in them."""
    return {
        **results_fields(outcome, config, train_steps),
        "global_step": train_steps,
        "steps_this_run": counts.steps_this_run,
        "record_from": counts.record_from,
        "num_workers": cluster.num_workers,
        "num_ps": cluster.num_ps,
        "replicas_to_aggregate": config.replicas_to_aggregate(
            cluster.num_workers),
        "backup_workers": config.backup_workers,
        "dropped_gradients": outcome.dropped,
        "min_workers": config.min_workers,
        "slices": config.slices,
        "averaged_steps": {str(k): int(n)
                           for k, n in enumerate(counts.counted[:, 0])},
        "averaged_examples": {str(k): int(n)
                              for k, n in enumerate(counts.counted[:, 1])},
        "pushed_gradients": {str(k): v for k, v in counts.pushed.items()},
        "membership": counts.membership,
        "steps_not_averaging_the_batch_once": counts.broken_steps,
        "cluster": cluster.as_dict(),
        **({"step_breakdown": counts.step_breakdown}
           if counts.step_breakdown else {}),
    }


def write_ps_results(logdir: pathlib.Path, outcome: Outcome,
                     config: TrainConfig, train_steps: int, cluster: Cluster,
                     report: ChiefReport) -> None:
    """<logdir>/results.json (ps_results), and the final line."""
    results = ps_results(outcome, config, train_steps, cluster, report)
    path = pathlib.Path(logdir) / RESULTS_FILE
    write_json(path, results)
    logging.info("final test accuracy %.2f%% after %d steps; wrote %s",
                 100 * results["final_test_accuracy"], train_steps, path)


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
