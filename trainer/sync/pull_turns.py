"""Ordered pulls (--ordered_pulls; docs/how-it-works.md, "Ordered pulls"):
shard s serves the workers in the order s, s + 1, ... (mod N), so that no
worker's link takes two shards at once. Worker k reads shard s for step t
once it takes a turn >= t (earlier ones are stale) from
`sync/pull_turn_<s>_<k>` on that shard's ps, put there by its predecessor
once its own copy arrived. A lost turn stalls no one: a round's plan gives
the turn to each member whose predecessor is out, and a (re)started or
stopping chief puts RELEASE (any step passes) in every queue; one nobody
waited for lets a later pull through early, costing only the order: the
gradient of a pull released early counts only if its step is still the
one the chief applies, else it is stale and dropped."""

import tensorflow as tf

from trainer.sync import queues

RELEASE = 2**63 - 1


class PullTurns:
    """The turn queues on the shards' ps tasks; none unless `ordered`."""

    def __init__(self, num_workers: int, shard_devices: list[str],
                 ordered: bool):
        self.num_workers, self.devices = num_workers, shard_devices
        self.queues = {}  # (shard, worker) -> steps; the first never waits
        for s, device in enumerate(shard_devices if ordered else []):
            with tf.device(device):
                for k in range(num_workers):
                    if k != s % num_workers:
                        self.queues[s, k] = queues.shared_queue(
                            f"sync/pull_turn_{s}_{k}", [tf.int64], [[]])

    def wait(self, worker: int, step: tf.Tensor) -> list:
        """Per shard s, `step` (int64 []) once `worker` may read s for it."""
        ready = [step] * len(self.devices)
        for (s, k), queue in self.queues.items():
            if k != worker:
                continue
            with tf.device(self.devices[s]):
                (turn,) = tf.while_loop(
                    lambda turn: turn < step, lambda turn: [queue.dequeue()],
                    [tf.constant(-1, tf.int64)], parallel_iterations=1)
                with tf.control_dependencies([turn]):
                    ready[s] = tf.identity(step)
        return ready

    def pass_on(self, worker: int, step: tf.Tensor, received: list) -> list:
        """Ops giving the next worker of each shard's order its turn for
        `step` once `received[s]` (worker's copy of shard s) is there."""
        passes = []
        for (s, k), queue in self.queues.items():
            if k == (worker + 1) % self.num_workers:
                # A control edge from the worker to the ps: a few bytes.
                with tf.device(self.devices[s]), \
                        tf.control_dependencies([received[s]]):
                    passes.append(queue.enqueue(step))
        return passes

    def cover_absent(self, step: tf.Tensor, members: tf.Tensor) -> list:
        """Ops giving `step`'s turn to each member (members: bool [N]) whose
        predecessor in a shard's order is out."""
        ops = []
        for (s, k), queue in self.queues.items():
            absent = members[k] & ~members[(k - 1) % self.num_workers]
            with tf.device(self.devices[s]):
                ops.append(queues.put_if(queue, absent, [step]))
        return ops

    def release_all(self) -> list:
        """Ops that let every waiting worker through (module docstring)."""
        ops = []
        for (s, _), queue in self.queues.items():
            with tf.device(self.devices[s]):
                ops.append(queue.enqueue(tf.constant(RELEASE, tf.int64)))
        return ops
