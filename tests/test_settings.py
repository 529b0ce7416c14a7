"""A logdir's training settings (trainer/saving/settings.py): a rerun with
other settings is refused naming each difference, more steps go on only
when asked, an older logdir without the file is accepted. And the settings
every worker must share (TrainConfig's WORKERS fields): a worker with
another value is told the first that differs."""

import dataclasses
import json
import pathlib

import pytest
import tensorflow as tf

from trainer.cluster.spec import Cluster, Task
from trainer.common import config as config_lib
from trainer.common.config import TrainConfig
from trainer.common.errors import UserError
from trainer.roles import graph
from trainer.roles import worker
from trainer.saving import settings

# The names settings.json has recorded since its format 1: older logdirs
# are compared by them, so no CHECKPOINT field may lose or change its name.
RECORDED_BY_OLDER_VERSIONS = ("model", "hidden_units", "optimizer",
                              "learning_rate", "lr_schedule", "momentum",
                              "train_steps", "batch_size", "seed",
                              "wire_dtype")


def write_checkpoint(logdir, step: int) -> None:
    """A checkpoint holding only the global step, as the chief names it."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.get_variable("sync/global_step", [], tf.int64,
                                  initializer=tf.compat.v1.constant_initializer(
                                      step))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            saver.save(session, str(logdir / "model.ckpt"), global_step=step)


def first_run(tmp_path, steps: int = 100, **fields) -> TrainConfig:
    """A logdir as a finished run leaves it: settings file, checkpoint."""
    config = TrainConfig(logdir=str(tmp_path / "run"), **fields)
    settings.check_logdir_settings(config, steps)
    write_checkpoint(tmp_path / "run", steps)
    return config


def recorded(config: TrainConfig) -> dict:
    path = pathlib.Path(config.logdir) / settings.SETTINGS_FILE
    return json.loads(path.read_text())["settings"]


def test_first_run_records_its_settings(tmp_path):
    config = first_run(tmp_path, learning_rate=0.01)
    assert recorded(config)["learning_rate"] == 0.01
    assert recorded(config)["train_steps"] == 100
    assert set(recorded(config)) <= set(settings.COMPARED)


def test_other_settings_are_refused_naming_each(tmp_path):
    config = first_run(tmp_path)
    other = TrainConfig(logdir=config.logdir, learning_rate=0.01, seed=3,
                        batch_size=64)
    with pytest.raises(UserError) as error:
        settings.check_logdir_settings(other, 100)
    message = str(error.value)
    assert "\n" not in message
    for phrase in ("--learning_rate=0.01 (the checkpoints': 0.003)",
                   "--seed=3 (the checkpoints': 0)",
                   "--batch_size=64 (the checkpoints': 128)",
                   "give a new --logdir"):
        assert phrase in message, message
    assert settings.CONTINUE_FLAG not in message


def test_same_settings_evaluate_again_and_say_so(tmp_path, caplog):
    config = first_run(tmp_path)
    with caplog.at_level("INFO"):
        settings.check_logdir_settings(config, 100)
    assert "holds a finished run (global step 100 of 100)" in caplog.text


def test_more_steps_go_on_only_when_asked(tmp_path):
    config = first_run(tmp_path)
    longer = TrainConfig(logdir=config.logdir, train_steps=150)
    with pytest.raises(UserError) as error:
        settings.check_logdir_settings(longer, 150)
    assert "comes to 150 (the checkpoints': 100)" in str(error.value)
    assert settings.CONTINUE_FLAG in str(error.value)
    asked = TrainConfig(logdir=config.logdir, train_steps=150,
                        continue_with_new_settings=True)
    settings.check_logdir_settings(asked, 150)
    assert recorded(asked)["train_steps"] == 150
    # The flag does not cover another learning rate.
    with pytest.raises(UserError, match="--learning_rate"):
        settings.check_logdir_settings(
            TrainConfig(logdir=config.logdir, learning_rate=0.5,
                        continue_with_new_settings=True), 150)


def test_settings_that_do_not_apply_are_not_compared(tmp_path):
    config = first_run(tmp_path, model="cnn", optimizer="adam")
    settings.check_logdir_settings(
        TrainConfig(logdir=config.logdir, hidden_units=7, momentum=0.5), 100)


def test_fields_missing_on_either_side_are_skipped():
    assert settings.differences({"model": "cnn", "slices": "equal"},
                                {"model": "cnn"}) == []
    assert [n for n, _ in settings.differences(
        {"model": "cnn"}, {"model": "mlp", "slices": "equal"})] == ["model"]


def test_older_logdir_without_the_file_is_accepted(tmp_path, caplog):
    (tmp_path / "run").mkdir()
    write_checkpoint(tmp_path / "run", 40)
    config = TrainConfig(logdir=str(tmp_path / "run"), learning_rate=0.5)
    with caplog.at_level("WARNING"):
        settings.check_logdir_settings(config, 100)
    assert "no settings.json" in caplog.text
    assert recorded(config)["learning_rate"] == 0.5


def test_older_logdirs_names_are_still_recorded_and_compared(tmp_path):
    config = first_run(tmp_path)
    assert set(RECORDED_BY_OLDER_VERSIONS) <= set(recorded(config))
    assert set(recorded(config)) == set(settings.COMPARED)
    older = {name: recorded(config)[name]
             for name in RECORDED_BY_OLDER_VERSIONS}
    assert settings.differences(older, recorded(config)) == []


def test_the_handshake_names_the_worker_setting_that_differs():
    """Every WORKERS field (and the resolved train_steps) is in the
    fingerprint, and a worker whose value differs is told which; other
    settings (the chief's alone) are not compared."""
    task = Task(Cluster(("a:1",), ("b:1", "c:1")), "worker", 1, "flags")
    base = TrainConfig(logdir="x")
    chiefs = graph.fingerprint(base, task, 100)
    for name in config_lib.shared_names(config_lib.WORKERS):
        if name == "train_steps":
            ours, was, now = graph.fingerprint(base, task, 150), 100, 150
        else:
            was = getattr(base, name)
            now = (not was if isinstance(was, bool) else was + 1
                   if isinstance(was, int) else
                   {"cnn": "mlp", "float32": "bfloat16"}[was])
            ours = graph.fingerprint(
                dataclasses.replace(base, **{name: now}), task, 100)
        assert worker._first_difference(chiefs, ours) == (  # noqa: SLF001
            f"{name}={was}", f"{name}={now}")
    assert chiefs.startswith("ps=a:1 workers=b:1,c:1 ")
    assert graph.fingerprint(dataclasses.replace(
        base, learning_rate=0.5, slices="equal"), task, 100) == chiefs


def test_a_foreign_settings_file_is_one_line(tmp_path):
    config = first_run(tmp_path)
    (tmp_path / "run" / settings.SETTINGS_FILE).write_text("[1, 2]")
    with pytest.raises(UserError, match="not a settings file"):
        settings.check_logdir_settings(config, 100)
