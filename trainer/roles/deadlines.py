"""The chief's deadline thread: the timer behind a round's LATE event.

The rule runs inside the graph, where an event queue's dequeue cannot
time out, so a round would wait for a member far behind. For each round
planned with a deadline (trainer/sync/pace.py puts (step, round, seconds)
on sync/deadlines), this thread waits that long, then sends LATE for the
round, on which the rule may plan the step again without it (Pace.late).
Rounds are planned faster than deadlines pass, so the thread takes every
queued request and times only the newest from when it takes it: a
round's deadline falls at least its seconds after its plan, later when
the thread was still sleeping on an earlier round.
"""

from absl import logging
import tensorflow as tf

from trainer.common.tf_session import error_summary
from trainer.roles.background import BackgroundThread

TAKE_TIMEOUT_MS = 500   # how long one take waits, so that stop is seen


class RoundDeadlines(BackgroundThread):
    """A thread beside the chief's training runs (a context manager)."""

    def __init__(self, session, take: tf.Tensor, late_op: tf.Operation,
                 step_in: tf.Tensor, round_in: tf.Tensor):
        """session: the chief's, used concurrently (as the membership
        watch does). take: every queued request, waiting for at least one:
        (steps int64 [n], rounds int64 [n], seconds float32 [n]). late_op:
        sends LATE for (step_in, round_in)."""
        # No period: each take waits up to TAKE_TIMEOUT_MS by itself.
        super().__init__("round-deadlines", 0.0,
                         TAKE_TIMEOUT_MS / 1000 * 4)
        self._session, self._take, self._late = session, take, late_op
        self._step_in, self._round_in = step_in, round_in
        self._options = tf.compat.v1.RunOptions(
            timeout_in_ms=TAKE_TIMEOUT_MS)
        self._complained = False

    def run_once(self) -> bool | None:
        """Takes the queued requests, waits the newest one's seconds and
        sends its LATE; False if stopped meanwhile."""
        try:
            # A request taken just as the take times out is lost: that
            # round then waits for its members, as without a deadline.
            steps, rounds, secs = self._session.run(self._take,
                                                    options=self._options)
            if self.wait(float(secs[-1])):
                return False
            self._session.run(self._late, {self._step_in: steps[-1],
                                           self._round_in: rounds[-1]},
                              options=self._options)
        except tf.errors.DeadlineExceededError:
            pass
        except (tf.errors.OpError, RuntimeError) as e:  # closed session
            if not self._complained and not self.stopping:
                logging.warning("round deadlines paused: %s",
                                error_summary(e))
            self._complained = True
            self.wait(TAKE_TIMEOUT_MS / 1000)
        return None
