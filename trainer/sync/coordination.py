"""The run's coordination on ps 0, beside averaging: handshake, joins,
start, stop, end, end-of-run reports and the ps tasks' shutdown. Only the
chief initializes `sync/cluster_fingerprint`, last: a worker that sees it
initialized knows the chief is ready, and compares it with its own text."""

import tensorflow as tf

from trainer.sync import queues, state as state_lib
from trainer.sync.state import JOINED, REJOIN, STOP

NOT_HALTED = -1   # halt_op's answer to a deposed chief


def shutdown_queue(ps_index: int) -> tf.queue.FIFOQueue:
    """Built on ps `ps_index`: the queue it exits on (0: done, 1: failed)."""
    return queues.shared_queue(f"shutdown/ps_{ps_index}", [tf.int32], [[]])


class RunCoordination:
    """The state on ps 0 besides averaging's, built alike by every worker."""

    def __init__(self, shared: state_lib.SharedState, pull_turns,
                 fingerprint: str, chief: int = 0):
        """pull_turns: released on start and stop. fingerprint: this
        worker's text for the handshake. chief: the chief's worker index."""
        self.shared, self.pull_turns = shared, pull_turns
        self.chief, self.fingerprint = chief, fingerprint
        self.device = device = shared.shard_devices[0]
        with tf.device(device):
            self.stop_reason = state_lib.ps_variable(
                "sync/stop_reason", [], tf.string,
                tf.compat.v1.constant_initializer(""), transient=True)
            # In no collection: the chief initializes it last (handshake).
            self.cluster_fingerprint = tf.compat.v1.get_variable(
                "sync/cluster_fingerprint", [], tf.string,
                initializer=tf.compat.v1.constant_initializer(fingerprint),
                trainable=False, use_resource=True, collections=[])
            self.finished = queues.shared_queue(  # (worker, gradients)
                "sync/finished", [tf.int32, tf.int64], [[], []])
            # A random word the chief also writes into its --logdir: a
            # worker whose --logdir holds it shares the chief's storage.
            self.storage_word = tf.compat.v1.get_variable(
                "sync/storage_word", [], tf.string,
                initializer=tf.compat.v1.constant_initializer(""),
                trainable=False, use_resource=True, collections=[])
            self.storage_word_in = tf.compat.v1.placeholder(
                tf.string, [], "storage_word")
            self.set_storage_word = self.storage_word.assign(
                self.storage_word_in, read_value=False)
            self.read_storage_word = self.storage_word.read_value()

    def join_op(self, worker: int) -> tf.Operation:
        """Drops worker's stale tokens, then asks the chief in."""
        with tf.control_dependencies([self.shared.drain_tokens(worker)]):
            return self.shared.send_event(JOINED, worker)

    def report_finished(self, worker: int, pushed: tf.Tensor) -> tf.Operation:
        """Tells the chief `worker` ended having pushed `pushed` (int64 [])."""
        with tf.device(self.device):
            return self.finished.enqueue((tf.constant(worker), pushed))

    def start_op(self) -> tf.Operation:
        """The chief's, before marking ready: forgets a previous chief's
        events, stop and halt, records the ps it does without, is the only
        member, releases the pull turns, asks every worker to REJOIN."""
        s = self.shared
        with tf.device(self.device):
            alone = tf.one_hot(self.chief, s.num_workers, True, False)
            reset = [s.events.dequeue_many(s.events.size())[0].op,
                     self.stop_reason.assign("", read_value=False),
                     s.halt.assign(0, read_value=False),
                     s.ps_down.assign(s.ps_down_here, read_value=False),
                     s.roster.assign(alone, read_value=False),
                     *self.pull_turns.release_all()]
            return s.give_all(state_lib.token(REJOIN), self.chief, reset)

    def stop_op(self, reason: tf.Tensor) -> tf.Operation:
        """Tells every worker to stop, with a reason they will log."""
        with tf.device(self.device):
            told = [self.stop_reason.assign(reason, read_value=False),
                    *self.pull_turns.release_all()]
            return self.shared.give_all(state_lib.token(STOP), self.chief,
                                        told)

    def end_op(self) -> tf.Operation:
        """Hands every worker the final global step: training is over."""
        with tf.device(self.device):
            final = self.shared.global_step.read_value()
            return self.shared.give_all(state_lib.token(final), self.chief)

    def halt_op(self, guarded) -> tf.Tensor:
        """Ends the chief's loop at the next step boundary: the step, or
        NOT_HALTED (int64 []) if a newer chief holds the lock. guarded:
        Averaging.guarded, lest a deposed chief halt its successor's."""
        def write():
            halted = self.shared.halt.assign(1, read_value=False)
            with tf.control_dependencies([halted]):
                return self.shared.global_step.read_value()
        with tf.device(self.device):
            return guarded(write, lambda: tf.constant(NOT_HALTED, tf.int64))

    def take_reports(self) -> tuple:
        """The reports queued so far (workers int32 [n], gradients int64
        [n]), without a wait whose timeout could lose one taken then."""
        with tf.device(self.device):
            return self.finished.dequeue_many(self.finished.size())

    def shutdown_ops(self, ps_tasks: list[int], ps_device,
                     status: tf.Tensor) -> list:
        """(i, enqueue of `status` (int32 []) on ps_device(i)) per ps i."""
        ops = []
        for i in ps_tasks:
            with tf.device(ps_device(i)):
                ops.append((i, shutdown_queue(i).enqueue(status)))
        return ops
