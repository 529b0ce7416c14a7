"""Runs one task of the cluster: `python -m trainer.main --job_name=... ...`.

This module alone defines flags; it turns them into a TrainConfig and a
Task and calls trainer.train.run. Bad input ends the process with one
line and status 2, a run that cannot go on with status 1.
"""

import os
import signal
import sys
import threading

# TensorFlow's C++ runtime logs a spurious "failed call to cuInit" error on
# CPU-only machines and much else; its real errors reach us as exceptions.
# TF_CPP_MIN_LOG_LEVEL=0 shows them all.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402

from trainer import cluster as cluster_lib  # noqa: E402
from trainer.config import (  # noqa: E402
    LR_SCHEDULES, MODELS, OPTIMIZERS, TrainConfig, validate)
from trainer.errors import RunFailed, UserError  # noqa: E402

# --- Cluster (or set TF_CONFIG; these flags win over it) ---
flags.DEFINE_enum("job_name", None, ["ps", "worker"],
                  "This task's job. Worker 0 is the chief.")
flags.DEFINE_integer("task_index", None, "This task's index in its job.")
flags.DEFINE_string("ps_hosts", None,
                    "Comma-separated host:port of the ps tasks.")
flags.DEFINE_string("worker_hosts", None,
                    "Comma-separated host:port of the workers, chief first.")

# --- Model and optimisation ---
flags.DEFINE_enum("model", "cnn", list(MODELS), "Model to train.")
flags.DEFINE_integer("hidden_units", 128, "Width of the mlp's hidden layer.")
flags.DEFINE_integer("batch_size", 128,
                     "Global batch: images per step over all workers.")
flags.DEFINE_enum("optimizer", "adam", list(OPTIMIZERS), "Update rule.")
flags.DEFINE_float("learning_rate", 3e-3, "Initial learning rate.")
flags.DEFINE_enum("lr_schedule", "cosine", list(LR_SCHEDULES),
                  "cosine: decay to 0 over the run; constant: no decay.")
flags.DEFINE_float("momentum", 0.9, "Momentum of --optimizer=momentum.")
flags.DEFINE_integer("train_steps", None,
                     "Global steps to train (default: --epochs).")
flags.DEFINE_float("epochs", None,
                   "Epochs to train if --train_steps is not given "
                   "(default 12).")
flags.DEFINE_integer("seed", 0, "Seed of initialisation, shuffling, dropout.")
flags.DEFINE_integer("backup_workers", 0,
                     "Workers beyond the ones averaged per step; each step "
                     "uses the first N - b gradients and drops late ones.")

# --- Data ---
flags.DEFINE_string("data_dir", None,
                    "Folder with the four MNIST .gz files (default: "
                    "$MNIST_DATA_DIR, else the project's data/ folder).")
flags.DEFINE_boolean("download", True,
                     "Download missing MNIST files from a mirror.")
flags.DEFINE_string("data_url", None,
                    "Base URL of a mirror with the four MNIST .gz files "
                    "(default: public mirrors of the original files).")

# --- Logs, evaluation, checkpoints ---
flags.DEFINE_string("logdir", None,
                    "Checkpoints, TensorBoard logs and results.json "
                    "(default: runs/<model>). The chief resumes from the "
                    "latest checkpoint here.")
flags.DEFINE_integer("log_every", 100, "Log and summarize every N steps.")
flags.DEFINE_integer("eval_every", 500,
                     "Evaluate on the test set every N steps.")
flags.DEFINE_integer("checkpoint_every", 500, "Checkpoint every N steps.")
flags.DEFINE_integer("keep_checkpoints", 5, "Checkpoints to keep.")

# --- Runtime ---
flags.DEFINE_integer("intra_op_threads", 0,
                     "Threads per op in this process (0: one per core). "
                     "The local launcher gives each worker its share of "
                     "the cores.")
flags.DEFINE_integer("inter_op_threads", 0,
                     "Ops run at once in this process (0: one per core).")
flags.DEFINE_float("startup_timeout_secs", 120,
                   "How long to wait for the ps tasks and the chief, at "
                   "start and after losing a ps.")
flags.DEFINE_float("worker_timeout_secs", 120,
                   "How long the chief waits for a missing worker's "
                   "gradient before it checkpoints and stops the run.")
flags.DEFINE_boolean("debug", False, "Show tracebacks of errors.")

FLAGS = flags.FLAGS


def trainer_flag_names() -> list[str]:
    """The flags above (the local launcher passes them on to each task)."""
    return [f.name for f in FLAGS.get_flags_for_module(__name__)]


def config_from_flags() -> TrainConfig:
    return TrainConfig(
        logdir=FLAGS.logdir or os.path.join("runs", FLAGS.model),
        model=FLAGS.model, hidden_units=FLAGS.hidden_units,
        batch_size=FLAGS.batch_size, optimizer=FLAGS.optimizer,
        learning_rate=FLAGS.learning_rate, lr_schedule=FLAGS.lr_schedule,
        momentum=FLAGS.momentum,
        train_steps=FLAGS.train_steps, epochs=FLAGS.epochs, seed=FLAGS.seed,
        data_dir=FLAGS.data_dir, download=FLAGS.download,
        data_url=FLAGS.data_url,
        log_every=FLAGS.log_every, eval_every=FLAGS.eval_every,
        checkpoint_every=FLAGS.checkpoint_every,
        keep_checkpoints=FLAGS.keep_checkpoints,
        backup_workers=FLAGS.backup_workers,
        intra_op_threads=FLAGS.intra_op_threads,
        inter_op_threads=FLAGS.inter_op_threads,
        startup_timeout_secs=FLAGS.startup_timeout_secs,
        worker_timeout_secs=FLAGS.worker_timeout_secs)


def task_from_flags() -> cluster_lib.Task:
    task = cluster_lib.resolve(
        FLAGS.job_name, FLAGS.task_index, FLAGS.ps_hosts, FLAGS.worker_hosts,
        os.environ.get("TF_CONFIG"))
    logging.info(
        "cluster from %s: %d ps, %d worker(s); this task is %s", task.source,
        task.cluster.num_ps, task.cluster.num_workers, task.describe())
    return task


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        task = task_from_flags()
        config = config_from_flags()
        validate(config, task.cluster.num_workers)
    except UserError as e:
        return _fail(e, 2)
    from trainer import train  # imports TensorFlow: after the flag checks
    train.tf.get_logger().setLevel("ERROR")  # deprecation chatter of tf.v1

    # Training runs in a thread of its own so that this (main) thread, where
    # Python delivers signals, can act on Ctrl-C or SIGTERM at once even
    # while a session.run blocks for minutes in C++.
    outcome = {}

    def train_to_the_end():
        try:
            train.run(config, task)
        except BaseException as e:  # handed to the main thread
            outcome["error"] = e

    signal.signal(signal.SIGTERM, lambda *_: _exit_now("terminated", 143))
    thread = threading.Thread(target=train_to_the_end, name="train",
                              daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    except KeyboardInterrupt:
        _exit_now("interrupted", 130)
    error = outcome.get("error")
    if error is None:
        return 0
    if isinstance(error, UserError):
        return _fail(error, 2)
    if isinstance(error, RunFailed):
        return _fail(error, 1)
    raise error


def _fail(error: Exception, status: int) -> int:
    if FLAGS.debug:
        raise error
    logging.error("%s", error)
    return status


def _exit_now(why: str, status: int) -> None:
    """Ends the process now. Checkpoints are safe: TensorFlow only points
    `checkpoint` at a new one after it is fully written."""
    logging.error("%s; exiting", why)
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_main():
    """Console-script entry point."""
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
    run_main()
