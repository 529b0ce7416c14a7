"""Runs one task of the cluster: `python -m trainer.main --job_name=... ...`.

Flags are defined in trainer/flags.py; this module turns them into a
TrainConfig and a Task and calls trainer.roles.run.run. Bad input ends the process with one
line and status 2, a run that cannot go on with status 1.
"""

import atexit
import os
import signal
import threading
import time

# TensorFlow's C++ runtime logs a spurious "failed call to cuInit" error on
# CPU-only machines and much else; its real errors reach us as exceptions.
# TF_CPP_MIN_LOG_LEVEL=0 shows them all.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app  # noqa: E402
from absl import logging  # noqa: E402

from trainer import flags as trainer_flags  # noqa: E402
from trainer.cluster import kubernetes  # noqa: E402
from trainer.common import processes  # noqa: E402
from trainer.common.config import validate  # noqa: E402
from trainer.common.errors import RunFailed, UserError  # noqa: E402

FLAGS = trainer_flags.FLAGS


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    signal.signal(signal.SIGTERM,
                  lambda *_: processes.exit_now("terminated", 143))
    try:
        task = trainer_flags.task_from_flags()
        config = trainer_flags.config_from_flags()
        validate(config, task.cluster.num_workers, task.cluster.num_ps)
        if FLAGS.firewall:
            _install_firewall(task)
    except UserError as e:
        return _fail(e, 2)
    # TensorFlow is imported here, after the flag checks.
    from trainer.roles import run as train
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

    # From here on, SIGTERM (Slurm, Kubernetes, spot instances) is a
    # request to leave: a worker tells the chief and exits; the chief saves
    # at the next step boundary and stops every task first
    # (trainer/roles/run.py).
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    thread = threading.Thread(target=train_to_the_end, name="train",
                              daemon=True)
    thread.start()
    _wait_for(thread, terminated, train.terminate)
    if terminated:
        if "error" in outcome:
            logging.error("%s", outcome["error"])
        processes.exit_now("terminated", 143)
    error = outcome.get("error")
    if error is None:
        if FLAGS.cluster == "kubernetes" and FLAGS.kubernetes_hold_after_end:
            kubernetes.hold_after_end()
        return _leave(task, 0)
    if isinstance(error, UserError):
        return _leave(task, _fail(error, 2))
    if isinstance(error, RunFailed):
        return _leave(task, _fail(error, 1))
    raise error


def _wait_for(thread, terminated: list, terminate) -> None:
    """Waits for the training thread; on SIGTERM (`terminated` non-empty)
    calls `terminate()` once for a grace period in seconds (0: exit now)
    and exits if the thread outlives it. Ctrl-C exits at once."""
    deadline = None
    try:
        while thread.is_alive():
            thread.join(0.2)
            if terminated and deadline is None:
                grace = terminate()
                if not grace:
                    processes.exit_now("terminated", 143)
                deadline = time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                processes.exit_now(
                    "terminated; the chief did not stop in time", 143)
    except KeyboardInterrupt:
        processes.exit_now("interrupted", 130)


def _install_firewall(task) -> None:
    """--firewall: this task's nftables table, in before the server binds.
    Its guard deletes it once this process has exited, however it ends
    (trainer/cluster/table_guard.py); wall.at_exit (run at any exit:
    atexit, and processes.exit_now's AT_EXIT) deletes it only where no guard
    watches."""
    from trainer.cluster import firewall
    wall = firewall.Firewall(task)
    processes.AT_EXIT.append(wall.at_exit)
    atexit.register(wall.at_exit)
    wall.install(task)


def _fail(error: Exception, status: int) -> int:
    if FLAGS.debug:
        raise error
    logging.error("%s", error)
    return status


def _leave(task, status: int) -> int:
    """Ends a trained task with `status`: a worker (the chief too) with
    os._exit once its output is flushed, a ps by returning.

    Returning to the interpreter lets Python finalize while daemon threads
    (a membership read, a round deadline's take, gRPC's own) may still be
    inside a TensorFlow call against a ps that has just exited; such a
    thread, returning into a finalizing interpreter, is unwound by force
    through C++ frames that catch everything, and the process aborts
    ("FATAL: exception not rethrown", status -6) after training succeeded.
    Everything worth keeping is written by now: checkpoints, results.json,
    the summaries (their writers are closed) and the export.

    A ps returns normally: its gRPC server keeps answering while the
    interpreter winds down, so the chief's last messages to it (the end of
    training) get their replies. Leaving at once there left the chief's
    session.close() waiting forever on such a reply."""
    if task.job_name == "ps":
        return status
    processes.exit_now(None, status)


def run_main():
    """Console-script entry point."""
    trainer_flags.run_command(main)


if __name__ == "__main__":
    run_main()
