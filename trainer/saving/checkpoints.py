"""Checkpoints: the logdir, what is saved, restoring with fallback, refusing
a misfit.

Checkpoints store each parameter under its own name and shape
(`model/conv1/kernel`, its optimizer slots under the slot's name:
`model/conv1/kernel/m` and `.../v` with Adam, `.../momentum` with
momentum, none with sgd), not the flat shard vectors, so a run can resume
with a different number of ps tasks, and a checkpoint of another model is
refused by name and shape (check_fit, which exports pass too).
TensorFlow writes a checkpoint under temporary names and only then records
it in `checkpoint`, so a crash while saving leaves the previous one usable.
"""

import os
import pathlib
from typing import Callable, Mapping

from absl import logging
import tensorflow as tf

from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.common.config import TrainConfig
from trainer.common.errors import UserError, edge
from trainer.common.tf_session import error_summary

CHECKPOINT_NAME = "model.ckpt"


def checkpoint_saver(flat: params_lib.FlatParams, transient: list,
                     optimizer, keep: int):
    """A Saver of the parameters, their slots and other global state.

    Returns (saver, {checkpoint key: shape} it writes).
    """
    slots = {name: (lambda v, name=name: optimizer.get_slot(v, name))
             for name in optimizer.get_slot_names()}
    saveables = flat.saveables(slots)
    # Everything else global: the step, the dropped count and optimizer
    # state that is not per parameter (Adam's beta powers). Compared by
    # name: variables' == builds a graph op.
    covered = {v.op.name for v in flat.variables + transient}
    covered |= {optimizer.get_slot(v, name).op.name for v in flat.variables
                for name in optimizer.get_slot_names()}
    plain = [v for v in tf.compat.v1.global_variables()
             if v.op.name not in covered]
    saver = tf.compat.v1.train.Saver(
        var_list=saveables + plain, max_to_keep=keep, sharded=False,
        save_relative_paths=True)
    shapes = flat.expected_checkpoint_shapes(optimizer.get_slot_names())
    for v in plain:
        shapes[v.op.name] = v.shape.as_list()
    return saver, shapes


def save(saver, session, logdir: pathlib.Path, step: int) -> None:
    path = saver.save(session, str(logdir / CHECKPOINT_NAME),
                      global_step=step, write_meta_graph=False)
    logging.info("saved checkpoint %s", path)


def restore_newest_readable(saver, session, logdir: pathlib.Path) -> str:
    """Restores the newest readable checkpoint; returns its path.

    A checkpoint that cannot be read (cut short by a crash or a full disk)
    is skipped, with a warning, for the one before it. If none can be read
    the run stops rather than start over on top of them.
    """
    state = tf.train.get_checkpoint_state(str(logdir))
    paths = list(state.all_model_checkpoint_paths)
    for path in reversed(paths):
        files = tf.io.gfile.glob(path + ".*")
        if not any(f.endswith(".index") for f in files) or not any(
                ".data-" in f for f in files):
            logging.warning("checkpoint %s has missing files; trying the "
                            "one before it", path)
            continue
        try:
            saver.restore(session, path)
            return path
        except (tf.errors.DataLossError, tf.errors.OutOfRangeError,
                tf.errors.InvalidArgumentError) as e:
            logging.warning("cannot restore %s (%s); trying the checkpoint "
                            "before it", path, error_summary(e))
    raise UserError(
        f"none of the {len(paths)} checkpoint(s) in {logdir} can be read; "
        "move them elsewhere to start over, or give another --logdir")


def prepare_logdir(logdir: str) -> None:
    """Creates the logdir and checks that this task can write there.

    Called before any server starts: a logdir that cannot be made or
    written (a file on its path, no permission, a read-only or virtual file
    system) is refused in one line instead of failing after the cluster is
    up.
    """
    path = pathlib.Path(logdir)
    with edge("--logdir", logdir, "give --logdir a folder this user can "
              "create and write"):
        path.mkdir(parents=True, exist_ok=True)
        check = path / f".write-check-{os.getpid()}"
        check.write_bytes(b"")
        check.unlink()


def check_logdir_fits_model(config: TrainConfig) -> None:
    """Refuses, before any server starts, a logdir of another model."""
    latest = tf.train.latest_checkpoint(config.logdir)
    if not latest:
        return
    specs = replica_lib.model_specs(config)
    check_matches(latest, {s.name: list(s.shape) for s in specs},
                  config.model, exact=True)


def check_matches(path: str, expected: dict, model: str,
                  exact: bool = False) -> None:
    """Refuses a checkpoint whose entries do not fit this model; with
    `exact`, also one with parameters this model does not have."""
    found = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    check_fit(found, expected, f"checkpoint {path}", f"--model={model}",
              "use a new --logdir, or the flags that wrote this checkpoint",
              _is_parameter if exact else None)


def _is_parameter(name: str) -> bool:
    """A parameter's key ("model/conv1/kernel"), not a slot's or other."""
    return name.startswith(params_lib.SCOPE + "/") and name.count("/") == 2


def check_fit(found: Mapping, expected: Mapping, source: str, target: str,
              fix: str, refuse: Callable[[str], bool] | None = None) -> None:
    """The one check that parameters fit a model (checkpoints, exports).

    Args:
      found: name -> shape of what was given: a checkpoint's entries or
        the values to export.
      expected: name -> shape that `target` needs, in model order.
      source, target: named in the message: "checkpoint <path>" does not
        fit "--model=mlp".
      fix: the end of the message: what to do instead.
      refuse: names of `found` beyond `expected` for which this is true are
        refused too; None: extra names are ignored.
    Raises:
      UserError: the first entry missing, of another shape, or refused.
    """
    problem = None
    for name, shape in expected.items():
        if name not in found:
            problem = f"no value for parameter '{name}' {list(shape)}"
        elif list(found[name]) != list(shape):
            problem = (f"parameter '{name}' is {list(found[name])} but "
                       f"{target} needs {list(shape)}")
        if problem:
            break
    extra = sorted(n for n in found if refuse and n not in expected
                   and refuse(n))
    if not problem and extra:
        problem = f"'{extra[0]}' is not a parameter of {target}"
    if problem:
        raise UserError(f"{source} does not fit {target}: {problem}; {fix}")

