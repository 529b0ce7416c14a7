"""Exactly one chief: its generation, and the lock every write of the rule
takes.

The chief's work can move to another worker (trainer/roles/takeover.py).
Two chiefs must never both act. A chief cut off from the cluster is not
gone: its training loop runs on ps 0 (trainer/roles/step.py), blocked, and
would plan, admit or apply as soon as its link returns. So:

- `sync/chief_lock`, a queue of capacity 1 on ps 0, holds the current
  generation. Each write the rule makes to the protocol's state (a plan, acting
  on an event, a step's update and advance) takes the generation out of the
  lock, writes only if it is the generation of the loop doing it, and puts it
  back. Between the take and the put nobody else can take it.
- A chief's start claims the lock: it takes the generation out (waiting for a
  write in flight to end) and puts back generation + 1. From then on every
  write of an older chief's loop is refused, whatever its link does, and
  its loop ends at its next check. Two claims at once are ordered by the
  queue: the later wins; the earlier chief's first write is refused.
- `sync/chief` (int64 [3]: generation, the chief's worker index, beats) is what
  the others read: who the chief is, and whether it is alive (its beat
  thread adds a beat twice a second, and its loop one per round planned).
- A lock lost: a chief killed between a take and its put leaves the queue
  empty, and that write may be half done across the ps tasks. A claim that
  waits --worker_timeout_secs in vain concludes that, and the new chief
  restores the newest checkpoint, as a restarted chief does.
- With --ps_mirrors, `ps_mirror/chief_generation` on ps 1 keeps the last
  claimed generation. A ps 0 started again has no record, and a claim
  there goes on from that copy: a generation is never given out twice, so
  a chief deposed before ps 0 died stays deposed.
"""

import tensorflow as tf

GENERATION, INDEX, BEATS = 0, 1, 2   # the fields of sync/chief


class ChiefLock:
    """The lock and the chief's record, on ps 0 (`device`). Every worker
    builds it alike; the queue is matched by shared_name, the variable by
    name. Neither is checkpointed nor initialized with the others: the
    record is written by the first claim, and outlives restores."""

    def __init__(self, device: str, copy_device: str | None = None):
        """copy_device: where the last claimed generation has a copy (ps 1,
        with --ps_mirrors), or None."""
        self.device = device
        with tf.device(device):
            self.queue = tf.queue.FIFOQueue(
                1, [tf.int64], shapes=[[]], shared_name="sync/chief_lock",
                name="sync_chief_lock")
            self.record = _unsaved("sync/chief", [3])
        self.generation_copy = None
        if copy_device is not None:
            with tf.device(copy_device):
                self.generation_copy = _unsaved(
                    "ps_mirror/chief_generation", [])
        with tf.device(device):
            # int64 [] feed: the generation of the loop that writes (-1: none).
            self.loop_generation = tf.compat.v1.placeholder_with_default(
                tf.constant(-1, tf.int64), [], "chief_generation")
            self._claiming_ops()

    def guarded(self, generation: tf.Tensor, write, refused, after=()):
        """write() if the lock holds `generation` (int64 []), else refused();
        both return the same structure of tensors, which is returned once
        the lock is back. The lock is taken only after `after` (tensors):
        a take has no input, so it would run at once, and a run aborted
        while it waits (a ps lost) would lose the lock. Build it on ps 0."""
        with tf.device(self.device), tf.control_dependencies(after):
            held = self.queue.dequeue()
            out = tf.cond(tf.equal(held, generation), write, refused)
            flat = tf.nest.flatten(out)
            with tf.control_dependencies(flat):
                put = self.queue.enqueue(held)
            with tf.control_dependencies([put]):
                return tf.nest.pack_sequence_as(
                    out, [tf.identity(t) for t in flat])

    def current(self, generation: tf.Tensor) -> tf.Tensor:
        """bool []: `generation` is the recorded chief's (a cheap read, for a
        loop's condition; the writes' own check is `guarded`)."""
        with tf.device(self.device):
            return tf.equal(self.record.read_value()[GENERATION], generation)

    def _claiming_ops(self) -> None:
        """What the chief's Python side runs (built once, on ps 0):
        take (int64 []: the generation, out of the lock; waits while it is
        out), put (records (generation_in, index_in, 0 beats), then puts
        generation_in in the lock), recorded (int64 [3]; fails before the
        first claim), is_recorded (bool []), size (int32 []: 1 while
        the lock is in), beat, and last_generation (int64 []: the copy's
        generation, 0 without one)."""
        self.take = self.queue.dequeue()
        self.size = self.queue.size()
        self.generation_in = tf.compat.v1.placeholder(tf.int64, [],
                                                      "generation_in")
        self.index_in = tf.compat.v1.placeholder(tf.int64, [], "index_in")
        recorded = [self.record.assign(
            tf.stack([self.generation_in, self.index_in,
                      tf.constant(0, tf.int64)]), read_value=False)]
        self.last_generation = tf.constant(0, tf.int64)
        if self.generation_copy is not None:
            copy = self.generation_copy
            with tf.device(copy.device):
                recorded.append(copy.assign(self.generation_in,
                                            read_value=False))
                # int64 []: the copy, 0 before the first claim wrote it.
                self.last_generation = tf.cond(
                    tf.raw_ops.VarIsInitializedOp(resource=copy.handle),
                    copy.read_value, lambda: tf.constant(0, tf.int64))
        with tf.control_dependencies(recorded):
            self.put = self.queue.enqueue(self.generation_in)
        self.recorded = self.record.read_value()
        self.is_recorded = tf.raw_ops.VarIsInitializedOp(
            resource=self.record.handle)
        self.beat = self.beat_op()

    def beat_in(self, generation: tf.Tensor) -> tf.Tensor:
        """bool []: adds a beat to the record if it is `generation`'s (int64
        []), and says whether it did."""
        def beat():
            with tf.control_dependencies([self.beat_op()]):
                return tf.constant(True)
        with tf.device(self.device):
            return tf.cond(self.current(generation), beat,
                           lambda: tf.constant(False))

    def beat_op(self) -> tf.Operation:
        """Adds a beat to the record (a new op: one inside a loop's body
        runs at every iteration)."""
        with tf.device(self.device):
            return tf.raw_ops.ResourceScatterAdd(
                resource=self.record.handle, indices=[BEATS],
                updates=tf.constant([1], tf.int64))


def _unsaved(name: str, shape: list) -> tf.Variable:
    """An int64 variable of zeros outside every collection: not
    checkpointed, not initialized with the others."""
    return tf.compat.v1.get_variable(
        name, shape, tf.int64, initializer=tf.compat.v1.zeros_initializer(),
        trainable=False, use_resource=True, collections=[])
