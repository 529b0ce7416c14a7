"""The end of a run, on the chief: the workers' reports, and telling every
ps task to exit. (The chief's side is trainer/roles/chief.py.)"""

import time

from absl import logging
import tensorflow as tf

from trainer.common.tf_session import error_summary
from trainer.roles import takeover
from trainer.roles import timing
from trainer.roles.states import Event, Kind
from trainer.sync import coordination



def collect_reports(session, ops, cluster, chief: int) -> dict:
    """worker -> the gradients it says it pushed, reported as the workers
    finish; waits (at most timing.FINISH_WAIT_SECS) only for those still in the
    roster. ops: the ChiefOps; chief: our own worker index."""
    roster = session.run(ops.roster)
    expected = {k for k in range(len(roster)) if roster[k] and k != chief}
    reports = {}
    deadline = time.monotonic() + timing.FINISH_WAIT_SECS
    while not expected <= reports.keys() and time.monotonic() < deadline:
        workers, steps = session.run(ops.take_finished)
        reports.update(zip(workers.tolist(), steps.tolist()))
        if not expected <= reports.keys():
            time.sleep(timing.POLL_SECS)
    missing = sorted(expected - reports.keys())
    if missing:
        logging.warning("no end-of-training report from %s", ", ".join(
            cluster.describe("worker", k) for k in missing))
    return reports


def shut_down_ps(chief, failed: bool = False) -> None:
    """Tells every ps task to exit (with status 1 if the run failed)."""
    ops, cluster = chief.g.chief, chief.task.cluster
    for i, op in ops.shutdown_ops:
        try:
            chief.session.run(op, {ops.shutdown_status: int(failed)},
                              options=_bounded())
        except tf.errors.OpError as e:
            logging.warning("could not tell %s to exit: %s",
                            cluster.describe("ps", i), error_summary(e))


def end_failed_run(chief, reason: str) -> None:
    """The run failed with `reason` where the chief decides it cannot go
    on (the chief raises it next): fewer than --min_workers joined. The
    chief is connected and beating, so every ps answers; still, a chief
    deposed meanwhile must not end its successor's run, so it sends STOP
    to the workers and tells every ps task to exit only once ps 0 says
    the lock still holds its generation. Each message is bounded by
    timing.END_SECS. Failures where the ps tasks do not answer cannot
    tell them anything; a worker that takes over may still save such a
    run."""
    ops = chief.g.chief
    try:
        if takeover.deposed_by(chief.session, chief.g.lock, chief.generation,
                               _bounded()) is not None:
            return
        chief.session.run(ops.stop_op, {ops.stop_reason_in: reason},
                          options=_bounded())
    except tf.errors.OpError as e:
        logging.warning("could not tell the workers that the run failed "
                        "(%s); the ps tasks are left serving",
                        error_summary(e))
        return
    shut_down_ps(chief, failed=True)


def _bounded() -> tf.compat.v1.RunOptions:
    return tf.compat.v1.RunOptions(
        timeout_in_ms=int(timing.END_SECS * 1000))


def end_late_joiners(session, end_op, absorb, cluster, seen: set) -> None:
    """Declared workers that never joined (a short run can end before
    they are up) get up to timing.FINISH_WAIT_SECS to join, and are then
    handed the end at once, so that they exit like the others.

    absorb: () -> the roster after the queued joins (bool [N]); seen: the
    workers that joined, ourselves and the chief we took over from."""
    never = set(range(cluster.num_workers)) - seen
    deadline = time.monotonic() + timing.FINISH_WAIT_SECS
    while never and time.monotonic() < deadline:
        roster = absorb()
        came = {k for k in never if roster[k]}
        if came:
            session.run(end_op)
            never -= came
        else:
            time.sleep(timing.POLL_SECS)
    if never:
        logging.warning("never joined: %s", ", ".join(
            cluster.describe("worker", k) for k in never))


def on_ps0_silent(chief, step: int | None, who: str) -> None:
    """ps 0 has not answered for --worker_timeout_secs: nothing can be
    saved or sent through it, so the last checkpoint stands. Runs on
    the membership watch's thread (the chief: trainer/roles/chief.py)."""
    timeout = f"{chief.config.worker_timeout_secs:.0f} s"
    at = "" if step is None else f" at step {step}"
    # With other workers, this chief waits as they do: its blocked
    # run fails once the connection gives up (cluster/devices.py), and
    # it reconnects when ps 0 answers, going on as the chief unless a
    # worker that could reach ps 0 took over meanwhile (then it exits
    # with one line: Chief._check_still_chief).
    if chief.task.cluster.num_workers > 1:
        logging.warning("%s for %s (--worker_timeout_secs)%s; waiting "
                        "for it", who, timeout, at)
        return
    # Alone, nothing can go on without this chief: even when the stop
    # cannot be sent, the ps tasks must exit.
    shut_down_ps(chief, failed=True)
    chief.machine.post(Event(Kind.STALLED, (
        f"{who} for {timeout} (--worker_timeout_secs){at}; stopped; start "
        "every task again with the same flags to continue from the last "
        "checkpoint")))


def halt_loop(chief, session, reason: str | None = None) -> None:
    """Sets the halt: the chief's loop ends at the next step boundary
    (Chief.halt, or a posted PS_UP; any thread). Refused where another
    worker claimed the role since this chief's claim (chief_lock.py):
    the halt is shared, and a chief deposed while out of reach must not
    end its successor's loop. The lock may be lost: the wait is bounded.
    reason: what to log, or None to log nothing."""
    ops = chief.g.chief
    if chief.generation is None:   # not claimed yet: the loop has not begun
        if reason:
            logging.warning("%s before training began: stopping", reason)
        return
    try:
        at = int(session.run(ops.halt_op, {ops.generation: chief.generation},
                             options=tf.compat.v1.RunOptions(timeout_in_ms=(
                                 int(chief.config.worker_timeout_secs
                                     * 1000)))))
    except Exception as e:  # noqa: BLE001 (the run has failed: it ends)
        if reason:
            logging.warning("could not halt the training loop: %s",
                            error_summary(e))
        return
    if reason and at == coordination.NOT_HALTED:
        logging.warning("%s, but another worker is the chief now: its "
                        "training goes on", reason)
    elif reason:
        logging.warning("%s at global step %d: stopping at the next step "
                        "boundary", reason, at)
