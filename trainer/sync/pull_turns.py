"""Ordered pulls: workers read the parameters one at a time, in order.

Why: TCP shares a ps link fairly among the workers' pulls, so without an
order every worker has its parameters only when all of them have, about
N x (parameter bytes) / (link rate) into the step, and then all N
gradients queue for the ps link together: a step bound by the ps link
takes up to 2N transfer times. In turn, worker 0 computes and pushes
while worker 1 pulls, and so on: about N + 1 transfer times, the ps-link
bound (derived in trainer/bench/simhosts/bound.py). On a link that does
not bound the step the order only adds a small message per worker (see
the README's figures).

How: per ps shard s and worker k, a queue of step numbers,
`sync/pull_turn_<s>_<k>` on that shard's ps. Shard s serves the workers
in the order s, s + 1, ..., s + N - 1 (mod N): with several ps tasks, no
worker's link has to take two shards at once while the others idle. A
worker reads shard s for step t only after taking a turn >= t from its
queue (turns for earlier steps are stale: skipped); its predecessor in
that order puts t there once its own copy of shard s for step t has
arrived. The first worker of each order never waits.

A turn lost with a process, or never passed by a worker that is not in
the round, must not hold up the workers after it:
  * when the chief plans a round, it gives the turn itself to every member
    whose predecessor in an order is not a member (`cover_absent`);
  * a (re)started chief, and a chief that stops the run, put RELEASE in
    every queue, which lets a waiting worker through whatever step it
    waits for. Its gradient counts if the new chief resumed at that very
    step, and is otherwise stale and dropped (trainer/sync/averaging.py);
    either way only its pull was out of order. A RELEASE nobody waited
    for lets one later pull through out of order, which costs nothing.

A round planned again for the same step (a member left) passes the turns
again; a turn left over from the first round lets a pull through early,
which costs only the order.

Backup workers and ordered pulls do not mix (trainer/common/config.py
refuses it): a late worker would hold back the pulls of every worker
after it.
"""

import tensorflow as tf

from trainer.sync import queues

RELEASE = 2**63 - 1


class PullTurns:
    """The turn queues, each on its shard's ps device, or, unless
    `ordered`, none: then every method lets the pulls go as they come.
    Every worker builds it alike; the queues are matched by shared_name."""

    def __init__(self, num_workers: int, shard_devices: list[str],
                 ordered: bool):
        self.num_workers, self.devices = num_workers, shard_devices
        self.ordered = ordered
        self.queues = {}  # (shard, worker) -> queue of step numbers
        for s, device in enumerate(shard_devices if ordered else []):
            with tf.device(device):
                for k in range(num_workers):
                    self.queues[s, k] = queues.shared_queue(
                        f"sync/pull_turn_{s}_{k}", [tf.int64], [[]])

    def _first(self, shard: int) -> int:
        return shard % self.num_workers

    def wait(self, worker: int, step: tf.Tensor) -> list:
        """Per shard, `step` (int64 [], on the shard's ps), available once
        `worker` may read that shard for it."""
        ready = []
        for s, device in enumerate(self.devices):
            if not self.ordered or worker == self._first(s):
                ready.append(step)
                continue
            queue = self.queues[s, worker]
            with tf.device(device):
                (turn,) = tf.while_loop(
                    lambda turn: turn < step, lambda turn: [queue.dequeue()],
                    [tf.constant(-1, tf.int64)], parallel_iterations=1)
                with tf.control_dependencies([turn]):
                    ready.append(tf.identity(step))
        return ready

    def pass_on(self, worker: int, step: tf.Tensor, received: list) -> list:
        """Ops giving the next worker of each shard's order its turn for
        `step` once `received[s]` (worker's copy of shard s, on the
        worker) is there; none from the last of an order."""
        if not self.ordered:
            return []
        passes = []
        following = (worker + 1) % self.num_workers
        for s, device in enumerate(self.devices):
            if following == self._first(s):
                continue
            # A control edge from the worker to the ps: a few bytes.
            with tf.device(device), tf.control_dependencies([received[s]]):
                passes.append(self.queues[s, following].enqueue(step))
        return passes

    def cover_absent(self, step: tf.Tensor, members: tf.Tensor) -> list:
        """Ops giving each member (members: bool [N], who is in the round)
        whose predecessor in a shard's order is out its turn for `step`:
        an enqueue of 0 or 1 turns each, so no cond per worker."""
        ops = []
        for (s, k), queue in self.queues.items():
            if k == self._first(s):
                continue
            before = (k - 1) % self.num_workers
            absent = tf.logical_and(members[k],
                                    tf.logical_not(members[before]))
            with tf.device(self.devices[s]):
                ops.append(queues.put_if(queue, absent, [step]))
        return ops

    def release_all(self) -> list:
        """Ops that let every waiting worker through (module docstring)."""
        ops = []
        for (s, k), queue in self.queues.items():
            if k != self._first(s):
                with tf.device(self.devices[s]):
                    ops.append(queue.enqueue(tf.constant(RELEASE, tf.int64)))
        return ops
