"""The per-step record: what each global step's average held.

The chief's graph writes one row per step as it applies it (int32 [1 + N]:
how many times the step was applied with the admitted slices covering the
global batch exactly once, then each worker's examples), into
`sync/averaged_by_step` on ps 0. A step must read 1: 0 if its average
missed or doubled an example, 2 if two chiefs (or one, twice) applied it
(invariants I1 and I7, trainer/sync/averaging.py). The chief saves the
record to RECORD_FILE in --logdir and logs any step that is not 1; the
nemesis judges every step by it.
"""

import pathlib

from absl import logging
import numpy as np
import tensorflow as tf

from trainer.sync import state as state_lib

RECORD_FILE = "averaged_by_step.npy"


def record_step(s, global_batch: int, step, admitted, examples
                ) -> tf.Operation:
    """by_step[step] of SharedState `s` = [what it held before, plus 1
    if the admitted workers' pushed slices cover rows [0, global batch)
    exactly once; then each one's examples] (admitted: bool [N],
    examples: float32 [N] from their stats rows)."""
    pushed = s.pushed_slices.read_value()
    rows = tf.range(global_batch, dtype=tf.int64)
    covers = tf.logical_and(rows[None, :] >= pushed[:, :1],
                            rows[None, :] < pushed[:, 1:])
    times = tf.reduce_sum(tf.cast(tf.logical_and(
        covers, admitted[:, None]), tf.int32), axis=0)
    once = tf.reduce_all(tf.equal(times, 1))
    index = tf.minimum(step, s.by_step.shape[0] - 1)
    # Added, not set: a step applied twice reads 2. (A gather of the one
    # row: the record has a row per step of the run, and a read of all of
    # it each step is as slow as the run is long.)
    applied = s.by_step.sparse_read(index[None])[0, 0] + tf.cast(
        once, tf.int32)
    row = tf.concat([applied[None],
                     tf.cast(tf.round(examples), tf.int32)], axis=0)
    return state_lib.set_at(s.by_step, index[None], row)


def steps_not_once(record: np.ndarray, batch: int, first: int,
                   end: int) -> list[int]:
    """The steps in [first, end) of a record (int32 [steps, 1 + N],
    record_step's) not applied exactly once with the global batch covered
    exactly once, or whose examples do not sum to it."""
    return [first + i for i, row in enumerate(record[first:end])
            if row[0] != 1 or row[1:].sum() != batch]


def save_and_check(logdir: pathlib.Path, record: np.ndarray, batch: int,
                   first: int, end: int, backup_workers: int) -> list[int]:
    """Writes the record (int32 [steps, 1 + N]) to RECORD_FILE in logdir
    and returns the steps in [first, end) that did not average the batch
    exactly once, logging them unless --backup_workers (then by design)."""
    np.save(logdir / RECORD_FILE, record)
    broken = steps_not_once(record, batch, first, end)
    if broken and not backup_workers:
        logging.error(
            "%d steps did not average the global batch exactly once, or "
            "were applied twice (first: %s); the run is not exact: please "
            "report it",
            len(broken), broken[:5])
    return broken
