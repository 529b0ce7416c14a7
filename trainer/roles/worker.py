"""Workers other than the chief: wait for the chief, then compute and push
a gradient for every step the chief hands out, to the end.

Each step is `WorkerStep` in trainer/roles/step.py; connecting and coming
back after a lost ps is trainer/roles/lifecycle.py.
"""

import time

from absl import logging

from trainer.common.errors import RunFailed
from trainer.observe import tracing
from trainer.roles.lifecycle import POLL_SECS, PROGRESS_LOG_SECS, WorkerRole
from trainer.sync import averaging


class Worker(WorkerRole):

    def run_connected(self) -> None:
        """Trains from the global step to the end (or the chief's STOP)."""
        h = self.g.handles
        self._wait_for_chief()
        # After a (re)start: stale tokens dropped, this step's turn taken.
        step = int(self.session.run(h.resync_step))
        loop = self.loop_callable()
        logging.info("worker %d starts at global step %d", self.k, step)
        # The chief gives up on a missing worker after --worker_timeout_secs
        # and tells us why; we wait twice that long for it to do so.
        timeout = 2 * self.config.worker_timeout_secs
        with self.watchdog(timeout, lambda at, who: self.give_up(
                f"global step {step if at is None else at} did not move "
                f"for {timeout:.0f} s "
                f"(2 x --worker_timeout_secs), waiting for {who}; is the "
                f"chief, {self.task.cluster.describe('worker', 0)}, "
                "running?"), timeout_flag="2 x --worker_timeout_secs") as dog:
            while 0 <= step < self.train_steps:
                with dog.busy():
                    out = loop(step, self.config.log_every)
                self.last_progress = time.monotonic()
                self.local_steps += int(out["steps_done"])
                step = int(out["next_step"])
                logging.info("worker %d: global step %d, %d local steps",
                             self.k, max(step, 0), self.local_steps)
        if step == averaging.STOP:
            reason = self.session.run(h.stop_reason).decode()
            raise RunFailed(f"the chief stopped the run: {reason}")
        tracing.write_traces(self.traces, self.config.logdir, self.k, False)
        self.session.run(h.finish_op, {h.local_steps_in: self.local_steps})
        logging.info("worker %d finished: %d local steps", self.k,
                     self.local_steps)
        self.close_session()

    def _wait_for_chief(self) -> None:
        """The handshake (trainer/sync/coordination.py): wait until the
        chief marks the run ready, then compare its settings with ours."""
        chief = self.task.cluster.describe("worker", 0)
        start = time.monotonic()
        next_log = start + PROGRESS_LOG_SECS
        while not self.session.run(self.g.handles.ready):
            now = time.monotonic()
            if now - start > self.config.startup_timeout_secs:
                raise RunFailed(
                    f"the chief, {chief}, did not initialize the variables "
                    f"within {self.config.startup_timeout_secs:.0f} s "
                    "(--startup_timeout_secs); start it or check "
                    "--worker_hosts")
            if now >= next_log:
                logging.info("waiting for the chief, %s, to initialize the "
                             "variables: %.0f s", chief, now - start)
                next_log = now + PROGRESS_LOG_SECS
            time.sleep(POLL_SECS)
        chiefs = self.session.run(self.g.handles.chief_fingerprint).decode()
        ours = self.g.coord.fingerprint
        if chiefs != ours:
            chief_value, our_value = _first_difference(chiefs, ours)
            raise RunFailed(
                f"this worker's settings differ from the chief's: chief has "
                f"'{chief_value}', this worker has '{our_value}'; start every "
                "task with the same cluster and training flags")


def _first_difference(a: str, b: str) -> tuple[str, str]:
    """The first differing words of a and b (or a and b themselves)."""
    for x, y in zip(a.split(), b.split()):
        if x != y:
            return x, y
    return a, b
