"""The run's coordination on ps 0, beside the averaging protocol.

- Handshake: every worker builds the variable `sync/cluster_fingerprint`
  with its own description of the cluster and the run, but only the chief
  initializes it, last of all. A worker that sees it initialized knows the
  chief is ready and compares the chief's text with its own.
- Stop: the chief writes a reason into `sync/stop_reason` and hands every
  worker the STOP token (Averaging.stop_workers); a worker that draws STOP
  reads the reason and logs it.
- End-of-run reports: each worker puts (k, gradients it pushed) on
  `sync/finished`; the chief takes them for results.json.
- Shutdown: each ps task waits on its own queue `shutdown/ps_<i>`; the
  chief puts 0 there when training finished, 1 when the run failed.
"""

import tensorflow as tf

from trainer.sync import averaging
from trainer.sync import queues


def shutdown_queue(ps_index: int) -> tf.queue.FIFOQueue:
    """The queue ps task `ps_index` waits on before it exits.

    Build it under that ps task's device; the chief puts one element in it
    when the run is over: 0 if training finished, 1 if the run failed.
    """
    return queues.shared_queue(f"shutdown/ps_{ps_index}", [tf.int32], [[]])


class RunCoordination:
    """Handshake, stop, reports: the shared state on ps 0 that is not
    averaging. Every worker builds it alike, under ps 0's device."""

    def __init__(self, device: str, fingerprint: str):
        """
        Args:
          device: ps 0's device, which also holds the global step.
          fingerprint: text that describes the cluster and the run; every
            worker compares its own with the chief's before training.
        """
        self.device, self.fingerprint = device, fingerprint
        with tf.device(device):
            self.stop_reason = averaging.ps_variable(
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

    # --- Worker side ---

    def chief_ready(self) -> tf.Tensor:
        """bool []: the chief has initialized and marked the run ready."""
        with tf.device(self.device):
            return tf.raw_ops.VarIsInitializedOp(
                resource=self.cluster_fingerprint.handle)

    def chief_fingerprint(self) -> tf.Tensor:
        """string []: the chief's description (read once ready)."""
        with tf.device(self.device):
            return self.cluster_fingerprint.read_value()

    def read_stop_reason(self) -> tf.Tensor:
        with tf.device(self.device):
            return self.stop_reason.read_value()

    def report_finished(self, worker: int,
                        pushed: tf.Tensor) -> tf.Operation:
        """Tells the chief that `worker` ended after pushing `pushed`
        (int64 []) gradients."""
        with tf.device(self.device):
            return self.finished.enqueue((tf.constant(worker), pushed))

    # --- Chief side ---

    def clear_stop_op(self) -> tf.Operation:
        """Forgets the reason a previous chief stopped (see start_op)."""
        with tf.device(self.device):
            return self.stop_reason.assign("", read_value=False)

    def mark_ready_op(self) -> tf.Operation:
        return self.cluster_fingerprint.initializer

    def stop_op(self, reason: tf.Tensor,
                sync: averaging.Averaging) -> tf.Operation:
        """Tells every worker to stop, with a reason they will log."""
        with tf.device(self.device):
            return sync.stop_workers(
                [self.stop_reason.assign(reason, read_value=False)])

    def take_reports(self) -> tuple:
        """Dequeues the end-of-run reports queued so far, without waiting:
        (workers int32 [n], gradients int64 [n]). Never blocking, it needs
        no timeout, which could lose a report taken just as it expired."""
        with tf.device(self.device):
            return self.finished.dequeue_many(self.finished.size())

    def shutdown_ops(self, num_ps: int, ps_device, status: tf.Tensor) -> list:
        """One enqueue of `status` (int32 []) per ps task, each on its
        own device (ps_device(i)): tells it to exit."""
        ops = []
        for i in range(num_ps):
            with tf.device(ps_device(i)):
                ops.append(shutdown_queue(i).enqueue(status))
        return ops
