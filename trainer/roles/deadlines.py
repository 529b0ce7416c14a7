"""The chief's timer behind a round's LATE (Pace.late): an in-graph dequeue
cannot time out. It takes every queued request (rounds are planned faster
than deadlines pass) and times the newest from its take: none falls early."""

from absl import logging
import tensorflow as tf

from trainer.common.tf_session import error_summary
from trainer.roles.background import BackgroundThread

TAKE_TIMEOUT_MS = 500  # each take's wait (the only period): stop is seen


class RoundDeadlines(BackgroundThread):
    """A context manager. session: the chief's, shared. take: waits for,
    then takes, every queued request: (steps int64 [n], rounds int64 [n],
    seconds float32 [n]). late_op: LATE for (step_in, round_in)."""

    def __init__(self, session, take: tf.Tensor, late_op: tf.Operation,
                 step_in: tf.Tensor, round_in: tf.Tensor):
        super().__init__("round-deadlines", 0.0, TAKE_TIMEOUT_MS / 1000 * 4)
        self._run, self._take, self._late = session.run, take, late_op
        self._step_in, self._round_in = step_in, round_in
        self._options = tf.compat.v1.RunOptions(timeout_in_ms=TAKE_TIMEOUT_MS)
        self._complained = False

    def run_once(self) -> bool | None:
        """Waits the newest request's seconds, then sends its LATE."""
        try:
            # A request taken just as the take times out is lost: that
            # round then waits for its members, as without a deadline.
            steps, rounds, secs = self._run(self._take, options=self._options)
            if self.wait(float(secs[-1])):
                return False
            self._run(self._late, {self._step_in: steps[-1],
                                   self._round_in: rounds[-1]},
                      options=self._options)
        except tf.errors.DeadlineExceededError:
            pass
        except (tf.errors.OpError, RuntimeError) as e:  # closed session
            if not self._complained and not self._stop.is_set():
                logging.warning("round deadlines paused: %s", error_summary(e))
            self._complained = True
            self.wait(TAKE_TIMEOUT_MS / 1000)
        return None
