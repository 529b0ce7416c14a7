"""The per-step record `sync/averaged_by_step` on ps 0: per step (int32
[1 + N]), how many times it was applied with the admitted slices covering
the global batch exactly once (1; 0 if an example was missed or doubled, 2
if applied twice: invariants I1 and I7, docs/how-it-works.md), then each
worker's examples. The chief saves it to RECORD_FILE in --logdir; the
nemesis judges every step by it."""

import pathlib

from absl import logging
import numpy as np
import tensorflow as tf

from trainer.sync import state as state_lib

RECORD_FILE = "averaged_by_step.npy"


def record_step(s, global_batch: int, step, admitted, examples
                ) -> tf.Operation:
    """Adds 1 to by_step[step] of SharedState `s` if the admitted (bool
    [N]) slices cover the global batch once; sets examples (float32 [N])."""
    pushed = s.pushed_slices.read_value()
    rows = tf.range(global_batch, dtype=tf.int64)[None, :]
    covers = ((rows >= pushed[:, :1]) & (rows < pushed[:, 1:])
              & admitted[:, None])
    times = tf.reduce_sum(tf.cast(covers, tf.int32), axis=0)
    once = tf.cast(tf.reduce_all(tf.equal(times, 1)), tf.int32)
    index = tf.minimum(step, s.by_step.shape[0] - 1)
    # Added, not set: a step applied twice reads 2. A gather of the one
    # row: reading the whole record each step costs as the run is long.
    applied = s.by_step.sparse_read(index[None])[0, 0] + once
    return state_lib.set_at(s.by_step, index[None], tf.concat(
        [applied[None], tf.cast(tf.round(examples), tf.int32)], axis=0))


def steps_not_once(record: np.ndarray, batch: int, first: int,
                   end: int) -> list[int]:
    """The steps in [first, end) of a record (int32 [steps, 1 + N]) not
    applied once with the batch covered once, or whose examples miss it."""
    return [first + i for i, row in enumerate(record[first:end])
            if row[0] != 1 or row[1:].sum() != batch]


def save_and_check(logdir: pathlib.Path, record: np.ndarray, batch: int,
                   first: int, end: int, backup_workers: int) -> list[int]:
    """Saves the record (int32 [steps, 1 + N]) to RECORD_FILE in logdir;
    returns steps_not_once, logged unless --backup_workers (by design)."""
    np.save(logdir / RECORD_FILE, record)
    broken = steps_not_once(record, batch, first, end)
    if broken and not backup_workers:
        logging.error(
            "%d steps did not average the global batch exactly once, or "
            "were applied twice (first: %s); the run is not exact: please "
            "report it", len(broken), broken[:5])
    return broken
