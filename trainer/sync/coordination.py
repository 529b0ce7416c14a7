"""The run's coordination on ps 0, beside the averaging protocol.

- Handshake: every worker builds the variable `sync/cluster_fingerprint`
  with its own description of the cluster and the run, but only the chief
  initializes it, last of all. A worker that sees it initialized knows the
  chief is ready and compares the chief's text with its own.
- Membership: a worker joins by putting JOINED on `sync/events` (after
  dropping tokens left from before), and leaves on SIGTERM with LEAVING;
  the chief's membership watch reports a lost one with LOST
  (trainer/roles/membership.py). The rule acts on them
  (trainer/sync/averaging.py).
- Start: a (re)started chief hands every worker REJOIN, so that the
  workers still running join its run again.
- Stop: the chief writes a reason into `sync/stop_reason` and hands every
  worker the STOP token; a worker that draws STOP reads the reason and
  logs it. At the normal end it hands every worker the final step.
- End-of-run reports: each worker puts (k, gradients it pushed) on
  `sync/finished`; the chief takes them for results.json.
- Shutdown: each ps task waits on its own queue `shutdown/ps_<i>`; the
  chief puts 0 there when training finished, 1 when the run failed.
"""

import tensorflow as tf

from trainer.sync import queues
from trainer.sync import state as state_lib
from trainer.sync.state import JOINED, REJOIN, STOP

NOT_HALTED = -1   # halt_op's answer to a deposed chief


def shutdown_queue(ps_index: int) -> tf.queue.FIFOQueue:
    """The queue ps task `ps_index` waits on before it exits (Shutdown,
    above); build it under that ps task's device."""
    return queues.shared_queue(f"shutdown/ps_{ps_index}", [tf.int32], [[]])


class RunCoordination:
    """Handshake, stop, reports: the shared state on ps 0 that is not
    averaging. Every worker builds it alike."""

    def __init__(self, shared: state_lib.SharedState, pull_turns,
                 fingerprint: str, chief: int = 0):
        """pull_turns: released on start and stop. fingerprint: this
        worker's description of the cluster and the run (the handshake's).
        chief: the worker whose graph runs the chief's side (worker 0, or
        one that took over the chief's work)."""
        self.shared, self.pull_turns = shared, pull_turns
        self.chief = chief
        self.device = device = shared.shard_devices[0]
        self.fingerprint = fingerprint
        with tf.device(device):
            self.stop_reason = state_lib.ps_variable(
                "sync/stop_reason", [], tf.string,
                tf.compat.v1.constant_initializer(""), transient=True)
            # Not a global variable: the chief initializes it last, so a
            # worker that sees it initialized knows the chief is done.
            self.cluster_fingerprint = tf.compat.v1.get_variable(
                "sync/cluster_fingerprint", [], tf.string,
                initializer=tf.compat.v1.constant_initializer(fingerprint),
                trainable=False, use_resource=True, collections=[])
            self.finished = queues.shared_queue(  # (worker, gradients)
                "sync/finished", [tf.int32, tf.int64], [[], []])
            # A random word each chief writes into its --logdir and here:
            # a worker whose --logdir holds the same word shares the
            # chief's storage (trainer/roles/worker.py says if not).
            self.storage_word = tf.compat.v1.get_variable(
                "sync/storage_word", [], tf.string,
                initializer=tf.compat.v1.constant_initializer(""),
                trainable=False, use_resource=True, collections=[])
            self.storage_word_in = tf.compat.v1.placeholder(
                tf.string, [], "storage_word")
            self.set_storage_word = self.storage_word.assign(
                self.storage_word_in, read_value=False)
            self.read_storage_word = self.storage_word.read_value()

    # --- Worker side ---

    def join_op(self, worker: int) -> tf.Operation:
        """Drops worker's stale tokens, then asks the chief in."""
        drained = self.shared.drain_tokens(worker)
        with tf.control_dependencies([drained]):
            return self.shared.send_event(JOINED, worker)

    def report_finished(self, worker: int,
                        pushed: tf.Tensor) -> tf.Operation:
        """Tells the chief that `worker` ended after pushing `pushed`
        (int64 []) gradients."""
        with tf.device(self.device):
            return self.finished.enqueue((tf.constant(worker), pushed))

    # --- Chief side ---

    def start_op(self) -> tf.Operation:
        """Run by the chief after init, restore or taking over, before
        marking ready: forgets the events, the stop and the halt of a
        previous chief, says which ps its graph does without, makes
        itself the only one in the roster, lets through any pull that
        waits for a turn, and asks every worker still running to join
        again (REJOIN)."""
        with tf.device(self.device):
            s = self.shared
            reset = [s.events.dequeue_many(s.events.size())[0].op,
                     self.stop_reason.assign("", read_value=False),
                     s.halt.assign(0, read_value=False),
                     s.ps_down.assign(s.ps_down_here, read_value=False),
                     s.roster.assign(tf.one_hot(self.chief, s.num_workers,
                                                True, False),
                                     read_value=False),
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
        """Ends the chief's training loop at the next step boundary;
        returns the global step when it was set, or NOT_HALTED where a
        newer chief holds the lock (int64 []).

        guarded(write, refused): the rule's (Averaging.guarded). A chief
        deposed while it was out of reach may call its halt when it comes
        back (a ps it did without answers again, SIGTERM); the halt is
        shared, so unguarded it would end the new chief's loop."""
        def write():
            halted = self.shared.halt.assign(1, read_value=False)
            with tf.control_dependencies([halted]):
                return self.shared.global_step.read_value()

        with tf.device(self.device):
            return guarded(write, lambda: tf.constant(NOT_HALTED, tf.int64))

    def take_reports(self) -> tuple:
        """The end-of-run reports queued so far, without waiting: (workers
        int32 [n], gradients int64 [n]). Never blocking, it needs no
        timeout, which could lose a report taken just as it expired."""
        with tf.device(self.device):
            return self.finished.dequeue_many(self.finished.size())

    def shutdown_ops(self, ps_tasks: list[int], ps_device,
                     status: tf.Tensor) -> list:
        """(i, an enqueue of `status` (int32 [])) per ps task i of
        `ps_tasks`, each on its own device (ps_device(i)): tells it to
        exit."""
        ops = []
        for i in ps_tasks:
            with tf.device(ps_device(i)):
                ops.append((i, shutdown_queue(i).enqueue(status)))
        return ops
