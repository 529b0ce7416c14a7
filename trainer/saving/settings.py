"""The training settings a logdir's checkpoints belong to.

The chief keeps `<logdir>/settings.json`: the settings that decide what
the checkpoints hold (model, optimizer, learning rate and schedule, steps,
batch, seed, wire type, ...). Before its server starts it compares them
with this run's, so that a rerun with another setting in the same logdir
is refused in one line naming every difference, instead of resuming (or
only evaluating again) with settings it silently ignores.

    {"format": 1, "settings": {"model": "cnn", "learning_rate": 0.003,
                               "train_steps": 5616, ...}}

`train_steps` is the resolved number of global steps, so `--epochs=12`
and the `--train_steps` it comes to are the same setting. A logdir with
checkpoints but no settings file (written by an older version) is accepted
with a warning, and the file is written for the next run.
"""

import json
import os
import pathlib

from absl import logging
import tensorflow as tf

from trainer.common.config import (CHECKPOINT, TrainConfig, shared_names,
                                   shared_settings)
from trainer.common.errors import UserError, edge

SETTINGS_FILE = "settings.json"
FORMAT = 1
# The TrainConfig fields declared CHECKPOINT (trainer/common/config.py),
# compared in field order, recorded under their names. A name missing from
# a recorded file (an older version's) is skipped. Not --slices or the
# worker count: how the global batch is cut among the workers does not
# change the result (trainer/sync/averaging.py).
COMPARED = shared_names(CHECKPOINT)
# Settings a run may change and go on from the checkpoint with, given
# --continue_with_new_settings: more (or fewer) steps.
CONTINUABLE = ("train_steps",)
# A setting that only matters under another one's value.
_ONLY_WITH = {"hidden_units": ("model", "mlp"),
              "momentum": ("optimizer", "momentum")}
CONTINUE_FLAG = "--continue_with_new_settings"


def training_settings(config: TrainConfig, train_steps: int) -> dict:
    """The compared settings of `config`, with the resolved step count."""
    return shared_settings(config, CHECKPOINT, train_steps)


def differences(recorded: dict, current: dict) -> list[tuple[str, str]]:
    """(name, '--name=now (the checkpoints': then)') for each compared
    setting that differs; a setting missing from either side is skipped."""
    found = []
    for name in COMPARED:
        if name not in recorded or name not in current:
            continue
        key, value = _ONLY_WITH.get(name, (None, None))
        if key and current.get(key) != value:
            continue
        if recorded[name] != current[name]:
            flag = ("--train_steps (or --epochs) comes to "
                    if name == "train_steps" else f"--{name}=")
            found.append((name, f"{flag}{current[name]} (the checkpoints': "
                                f"{recorded[name]})"))
    return found


def read(logdir: pathlib.Path) -> dict | None:
    """The recorded settings, or None if there is no settings file."""
    path = logdir / SETTINGS_FILE
    if not path.exists():
        return None
    with edge("the settings file", path, "move it away to accept the "
              "checkpoints as they are, or give a new --logdir"):
        text = path.read_text()
    try:
        value = json.loads(text)
        return dict(value["settings"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path} is not a settings file this trainer "
                        "wrote; move it away to accept the checkpoints as "
                        "they are, or give a new --logdir") from None


def write(logdir: pathlib.Path, settings: dict) -> None:
    with edge("the settings file", logdir / SETTINGS_FILE,
              "give --logdir a folder this user can write"):
        logdir.mkdir(parents=True, exist_ok=True)
        tmp = logdir / f".{SETTINGS_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"format": FORMAT, "settings": settings},
                                  indent=2) + "\n")
        os.replace(tmp, logdir / SETTINGS_FILE)  # whole or not at all


def check_logdir_settings(config: TrainConfig, train_steps: int) -> None:
    """Refuses (UserError) a logdir whose checkpoints were trained with
    other settings, else records this run's; called by the chief before
    its server starts. Logs one line when the newest checkpoint is
    already at `train_steps`: the run only evaluates again."""
    logdir = pathlib.Path(config.logdir)
    current = training_settings(config, train_steps)
    latest = tf.train.latest_checkpoint(str(logdir))
    if not latest:
        write(logdir, current)
        return
    recorded = read(logdir)
    if recorded is None:
        logging.warning("%s has checkpoints but no %s (written by an older "
                        "version): resuming without checking the training "
                        "settings", logdir, SETTINGS_FILE)
    else:
        _refuse_or_accept(logdir, recorded, current, config)
    write(logdir, current)
    step = checkpoint_step(latest)
    if step is not None and step >= train_steps:
        logging.info(
            "%s holds a finished run (global step %d of %d) with these "
            "settings: nothing to train, evaluating it again; give a new "
            "--logdir to train from scratch, or more --train_steps with %s "
            "to train on", logdir, step, train_steps, CONTINUE_FLAG)


def _refuse_or_accept(logdir: pathlib.Path, recorded: dict, current: dict,
                      config: TrainConfig) -> None:
    found = differences(recorded, current)
    if not found:
        return
    continuable = {name for name, _ in found} <= set(CONTINUABLE)
    said = "; ".join(text for _, text in found)
    if continuable and getattr(config, "continue_with_new_settings", False):
        logging.warning("%s: continuing from the checkpoints with new "
                        "settings (%s): %s", logdir, CONTINUE_FLAG, said)
        return
    fix = "give a new --logdir to train with them from scratch"
    if continuable:
        fix += f", or pass {CONTINUE_FLAG} to go on from the checkpoints"
    else:
        fix += ", or the flags of the run that wrote the checkpoints"
    raise UserError(f"--logdir={logdir} holds checkpoints trained with other "
                    f"settings: {said}; {fix}")


def checkpoint_step(path: str) -> int | None:
    """The global step stored in checkpoint `path`, or None if it has
    none (looked up by name: a key 'global_step' or '.../global_step')."""
    reader = tf.train.load_checkpoint(path)
    for name in reader.get_variable_to_shape_map():
        if name == "global_step" or name.endswith("/global_step"):
            return int(reader.get_tensor(name))
    return None
