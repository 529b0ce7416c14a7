"""Exactly one chief: its generation, and the lock every write of the rule
takes (docs/how-it-works.md, "Exactly one chief", tells the whole story).

A chief cut off still has its loop on ps 0, which writes once its link
returns. So `sync/chief_lock`, a queue of capacity 1 on ps 0, holds the
current generation: each write of the rule takes it out, writes only if
it is its loop's own, and puts it back. A claim takes it (waiting for a
write in flight) and puts back generation + 1, refusing every later write
of an older chief. A chief killed between a take and its put leaves the
lock empty: a claim waiting in vain (takeover.claim_wait) restores.
`ps_mirror/chief_generation` on ps 1 (--ps_mirrors) keeps the last
claimed generation: a ps 0 started again gives out none twice."""

import tensorflow as tf

GENERATION, INDEX, BEATS = 0, 1, 2   # the fields of sync/chief


class ChiefLock:
    """The lock and `sync/chief` (int64 [3]: generation, worker index,
    beats) on ps 0, built alike by every worker; it outlives restores."""

    def __init__(self, device: str, copy_device: str | None = None):
        """copy_device: where the last claimed generation is copied (ps 1
        with --ps_mirrors), or None. A claim's ops (takeover.py): take
        (waits while the lock is out), put (records generation_in, index_in,
        0 beats, then fills the lock), recorded (int64 [3]; fails before the
        first claim), size (1 while the lock is in), last_generation."""
        self.device = device
        with tf.device(device):
            self.queue = tf.queue.FIFOQueue(
                1, [tf.int64], shapes=[[]], shared_name="sync/chief_lock",
                name="sync_chief_lock")
            self.record = _unsaved("sync/chief", [3])
            # int64 [] feed: the generation of the loop that writes (-1: none).
            self.loop_generation = tf.compat.v1.placeholder_with_default(
                tf.constant(-1, tf.int64), [], "chief_generation")
            self.take = self.queue.dequeue()
            self.size = self.queue.size()
            self.generation_in = tf.compat.v1.placeholder(tf.int64, [],
                                                          "generation_in")
            self.index_in = tf.compat.v1.placeholder(tf.int64, [], "index_in")
            recorded = [self.record.assign(
                tf.stack([self.generation_in, self.index_in,
                          tf.constant(0, tf.int64)]), read_value=False)]
            self.last_generation = tf.constant(0, tf.int64)
            if copy_device is not None:
                with tf.device(copy_device):
                    copy = _unsaved("ps_mirror/chief_generation", [])
                    recorded.append(copy.assign(self.generation_in,
                                                read_value=False))
                    self.last_generation = tf.cond(
                        copy.is_initialized(), copy.read_value,
                        lambda: tf.constant(0, tf.int64))
            with tf.control_dependencies(recorded):
                self.put = self.queue.enqueue(self.generation_in)
            self.recorded = self.record.read_value()
            self.is_recorded = self.record.is_initialized()
            self.beat = self.beat_op()

    def guarded(self, generation: tf.Tensor, write, refused, after=()):
        """write() if the lock holds `generation` (int64 []), else refused()
        (alike structures of tensors), once the lock is back. The take waits
        for `after`: with no input it would run at once, and a run aborted
        while it waits (a ps lost) would lose the lock."""
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
        """bool []: `generation` is recorded (a cheap read; see guarded)."""
        with tf.device(self.device):
            return tf.equal(self.record.read_value()[GENERATION], generation)

    def beat_in(self, generation: tf.Tensor) -> tf.Tensor:
        """bool []: it added a beat, as it does if `generation` (int64 [])
        is recorded."""
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
    return tf.compat.v1.get_variable(
        name, shape, tf.int64, initializer=tf.compat.v1.zeros_initializer(),
        trainable=False, use_resource=True, collections=[])
