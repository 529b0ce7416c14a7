"""A logdir's training settings (trainer/saving/settings.py): a rerun with
other settings is refused naming each difference, more steps go on only
when asked, an older logdir without the file is accepted."""

import json
import pathlib

import pytest
import tensorflow as tf

from trainer.common.config import TrainConfig
from trainer.common.errors import UserError
from trainer.saving import settings


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


def test_a_foreign_settings_file_is_one_line(tmp_path):
    config = first_run(tmp_path)
    (tmp_path / "run" / settings.SETTINGS_FILE).write_text("[1, 2]")
    with pytest.raises(UserError, match="not a settings file"):
        settings.check_logdir_settings(config, 100)
