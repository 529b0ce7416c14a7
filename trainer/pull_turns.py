"""Ordered pulls: workers read the parameters one at a time, in order.

Why: TCP shares a ps link fairly among the workers' pulls, so without an
order every worker has its parameters only when all of them have, about
N x (parameter bytes) / (link rate) into the step, and then all N
gradients queue for the ps link together: a step bound by the ps link
takes up to 2N transfer times. In turn, worker 0 has its parameters after
one transfer time and computes and pushes while worker 1 pulls, and so on,
so the step takes about N + 1 transfer times: the ps-link bound of
trainer/bench/simulated.py. On a link that does not bound the step the
order only adds a small message per worker (see the README's figures).

How: a queue of step numbers per worker, `sync/pull_turn_<k>` on ps 0.
Worker k > 0 reads the parameters for step t only after taking a turn
>= t from its queue (turns for earlier steps are stale: taken and
skipped); worker k - 1 puts t there once its own parameters for step t
have arrived. Worker 0 (the chief) never waits.

A turn lost with a process must not hold up the workers after it:
  * a (re)started worker gives itself the turn for its first step;
  * a (re)started chief, and a chief that stops the run, put RELEASE in
    every queue, which lets a waiting worker through whatever step it
    waits for. Its gradient is then for a step that is over and is
    dropped like any stale one (trainer/sync.py); a RELEASE nobody waited
    for lets one later pull through out of order, which costs nothing.

Backup workers and ordered pulls do not mix (trainer/config.py refuses
it): a late worker would hold back the pulls of every worker after it.
"""

import tensorflow as tf

RELEASE = 2**63 - 1
_QUEUE_CAPACITY = 1 << 30


class PullTurns:
    """The turn queues on `device` (ps 0's), or, unless `ordered`, none:
    then every method lets the pulls go as they come. Every worker builds
    it alike; the queues are matched by shared_name."""

    def __init__(self, num_workers: int, device: str, ordered: bool):
        self.num_workers, self.device = num_workers, device
        self.ordered = ordered
        with tf.device(device):
            self.queues = [
                tf.queue.FIFOQueue(_QUEUE_CAPACITY, [tf.int64], shapes=[[]],
                                   shared_name=f"sync/pull_turn_{k}",
                                   name=f"sync_pull_turn_{k}")
                for k in range(num_workers if ordered else 0)]

    def wait(self, worker: int, step: tf.Tensor) -> tf.Tensor:
        """`step` (int64 [], on ps 0), available once `worker` may read
        the parameters for it."""
        if not self.ordered or worker == 0:
            return step
        queue = self.queues[worker]
        with tf.device(self.device):
            (turn,) = tf.while_loop(
                lambda turn: turn < step, lambda turn: [queue.dequeue()],
                [tf.constant(-1, tf.int64)], parallel_iterations=1)
            with tf.control_dependencies([turn]):
                return tf.identity(step)

    def pass_on(self, worker: int, step: tf.Tensor, received: list) -> list:
        """Ops giving worker + 1 its turn for `step` once `received`
        (worker's parameters, on the worker) are there; [] for the last."""
        if not self.ordered or worker + 1 == self.num_workers:
            return []
        # A control edge from the worker to ps 0: a few bytes cross back.
        with tf.device(self.device), tf.control_dependencies(received):
            return [self.queues[worker + 1].enqueue(step)]

    def take_own(self, worker: int, step: tf.Tensor) -> list:
        """Ops giving `worker` itself the turn for `step`, after a
        (re)start: the one its predecessor passed may have gone to the
        process it replaces."""
        if not self.ordered:
            return []
        with tf.device(self.device):
            return [self.queues[worker].enqueue(step)]

    def release_all(self) -> list:
        """Ops that let every waiting worker through (module docstring)."""
        if not self.ordered:
            return []
        with tf.device(self.device):
            release = tf.constant(RELEASE, tf.int64)
            return [queue.enqueue(release) for queue in self.queues[1:]]
