"""The end of a run, on the chief: the workers' reports, the ps tasks' exit."""

import time

from absl import logging
import tensorflow as tf

from trainer.common.tf_session import error_summary
from trainer.roles import takeover, timing
from trainer.roles.states import Event, Kind
from trainer.sync import coordination


def collect_reports(session, ops, cluster, chief: int) -> dict:
    """worker -> gradients it says it pushed, waiting (timing.FINISH_WAIT_SECS
    at most) for those in the roster. ops: ChiefOps; chief: our index."""
    roster = session.run(ops.roster)
    expected = {k for k in range(len(roster)) if roster[k] and k != chief}
    reports, deadline = {}, time.monotonic() + timing.FINISH_WAIT_SECS
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
                              options=_bounded(timing.END_SECS))
        except tf.errors.OpError as e:
            logging.warning("could not tell %s to exit: %s",
                            cluster.describe("ps", i), error_summary(e))


def end_failed_run(chief, reason: str) -> None:
    """Ends a run the chief cannot go on with (it raises `reason` next):
    STOP, then every ps told to exit (each within timing.END_SECS), unless
    a successor holds the lock (its run is not ours to end)."""
    ops, options = chief.g.chief, _bounded(timing.END_SECS)
    try:
        if takeover.deposed_by(chief.session, chief.g.lock, chief.generation,
                               options) is not None:
            return
        chief.session.run(ops.stop_op, {ops.stop_reason_in: reason},
                          options=options)
    except tf.errors.OpError as e:
        logging.warning("could not tell the workers that the run failed "
                        "(%s); the ps tasks are left serving",
                        error_summary(e))
        return
    shut_down_ps(chief, failed=True)


def _bounded(secs: float) -> tf.compat.v1.RunOptions:
    return tf.compat.v1.RunOptions(timeout_in_ms=int(secs * 1000))


def end_late_joiners(session, end_op, absorb, cluster, seen: set) -> None:
    """Hands the end to workers that join within timing.FINISH_WAIT_SECS
    (a short run can end before they are up). absorb: () -> the roster
    after the queued joins (bool [N]); seen: the workers already known."""
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
    """ps 0 silent for --worker_timeout_secs (on the membership watch's
    thread). Alone, the chief ends the run at the last checkpoint."""
    at = "" if step is None else f" at step {step}"
    what = (f"{who} for {chief.config.worker_timeout_secs:.0f} s "
            f"(--worker_timeout_secs){at}")
    # With other workers, wait as they do: we reconnect when ps 0 answers,
    # still the chief unless a worker took over meanwhile.
    if chief.task.cluster.num_workers > 1:
        logging.warning("%s; waiting for it", what)
        return
    shut_down_ps(chief, failed=True)
    chief.machine.post(Event(Kind.STALLED, (
        f"{what}; stopped; start every task again with the same flags to "
        "continue from the last checkpoint")))


def halt_loop(chief, session, reason: str | None = None) -> None:
    """Sets the halt: the chief's loop ends at the next step boundary (any
    thread). Shared, so refused if another worker claimed the role since
    our claim; bounded, as the lock may be lost. reason: what to log."""
    ops, options = chief.g.chief, _bounded(chief.config.worker_timeout_secs)
    if chief.generation is None:   # not claimed yet: the loop has not begun
        if reason:
            logging.warning("%s before training began: stopping", reason)
        return
    try:
        at = int(session.run(ops.halt_op, {ops.generation: chief.generation},
                             options=options))
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
