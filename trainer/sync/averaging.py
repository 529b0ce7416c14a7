"""Synchronous gradient averaging: exactly one gradient per replica per step.

Why not plain `SyncReplicasOptimizer`: its workers all take their "go"
tokens from one shared queue, so a fast worker can take a slow worker's
token and contribute twice to a step while the slow one contributes
nothing. Here every worker has its own token queue and its own gradient
slot, and the chief admits each worker at most once per step.

The protocol for global step `t`, with N workers of which R are aggregated
(N = R + backup workers):

1. Pull: worker k learns `t`: the chief from its own loop, every other worker
   from its token queue `sync/tokens_<k>` (on ps 0), which only the chief
   fills. The parameters are read after the token, so they already hold
   step t-1's update (with ordered pulls, by worker k > 0 only after
   worker k - 1: trainer/sync/pull_turns.py).
2. Push: worker k writes the sum of its per-example gradients into row k of the
   gradient slot variable of every ps shard, and (examples, loss sum,
   correct predictions) into row k of `sync/stats`. Then it enqueues the
   arrival (k, t) on `sync/arrivals`.
3. Admit: the chief takes arrivals until R distinct workers have arrived
   for step t. An arrival for another step is stale: it is dropped and counted. A
   second arrival from an already admitted worker (a restarted worker
   redoing its step) is ignored. Admission is recorded in the variable
   `sync/admitted`, so a step cancelled halfway can be retried.
4. Average: the chief sums the admitted rows and divides by their example
   count, which is the gradient of the union of their slices (the whole
   global batch when R = N). It applies the mean (trainer/roles/step.py),
   then counts: adds the admitted workers to `sync/contributions`, sets
   global_step = t + 1 and puts t + 1 in every worker's token queue.

A worker receives token t + 1 only after step t is applied, so it never
runs ahead; it writes only its own row and is admitted once, so no step
averages two of its gradients.

The wire dtype (trainer/sync/wire.py) is the format of the parameters (step
1's read) and the gradient sums (step 2's write) on the ps links; the ps
keeps, sums and applies float32, and the step and statistics cross
bit-exact, so the workers' rounding is the only approximation.

The run's coordination around this protocol (start-up handshake, stop
broadcast, end-of-run reports, ps shutdown) is trainer/sync/coordination.py.
"""

import tensorflow as tf

from trainer.learning.replica import NUM_STATS
from trainer.sync import pull_turns
from trainer.sync import queues
from trainer.sync import wire

# Token that tells workers the chief has stopped the run
# (trainer/sync/coordination.py says why).
STOP = -1
# Variables a checkpoint does not hold: the chief initializes them afresh
# after every restore.
TRANSIENT = "sync_transient_variables"


def ps_variable(name, shape, dtype, initializer, transient):
    """A non-trainable resource variable on the current (ps) device,
    global, and in TRANSIENT if `transient`."""
    return tf.compat.v1.get_variable(
        name, shape, dtype, initializer=initializer, trainable=False,
        use_resource=True,
        collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES] + (
            [TRANSIENT] if transient else []))


def transient_variables() -> list:
    return tf.compat.v1.get_collection(TRANSIENT)


def _unpack(packed: tf.Tensor, sizes: list[int]) -> list[tf.Tensor]:
    """tf.split by slices: a slice at an aligned offset shares the buffer
    instead of copying it, so the big first piece costs nothing."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(tf.slice(packed, [start], [size]))
        start += size
    return pieces


def _write_row(variable, row: tf.Tensor, value: tf.Tensor) -> tf.Operation:
    """variable[row[0]] = value, as an op (no read of the result)."""
    return tf.raw_ops.ResourceScatterUpdate(
        resource=variable.handle, indices=row, updates=value[None])


class Averaging:
    """The averaging protocol's shared state and its steps, built alike by
    every worker.

    TensorFlow matches variables by name and queues by shared_name on the
    ps devices, so every worker's graph addresses the same resources.
    Worker side: pull, push, next_token, resync_step. Chief side: admit,
    average, count_and_advance, start_op, stop_workers.
    """

    def __init__(self, num_workers: int, replicas_to_aggregate: int,
                 shard_sizes: list[int], shard_devices: list[str],
                 wire_dtype=tf.float32, ordered_pulls: bool = False):
        """
        Args:
          num_workers: N, every worker that computes gradients.
          replicas_to_aggregate: R <= N, gradients averaged per step.
          shard_sizes: floats in each parameter shard.
          shard_devices: the ps device of each shard; shard 0 is on the
            device that also holds the step, the queues and the statistics.
          wire_dtype: tf.float32, tf.bfloat16 or tf.float16 (or the name):
            the format of parameters and gradients between ps and workers
            (trainer/sync/wire.py). Raises UserError for any other.
          ordered_pulls: workers read each shard in turn
            (trainer/sync/pull_turns.py).
        """
        self.wire_dtype = wire.wire_dtype(wire_dtype)
        self.num_workers = num_workers
        self.replicas = replicas_to_aggregate
        self.shard_sizes = shard_sizes
        self.shard_devices = shard_devices
        self.pull_turns = pull_turns.PullTurns(num_workers, shard_devices,
                                               ordered_pulls)
        zeros = tf.compat.v1.zeros_initializer()
        with tf.device(shard_devices[0]):
            self.global_step = ps_variable("global_step", [], tf.int64, zeros,
                                           transient=False)
            self.dropped = ps_variable("sync/dropped_gradients", [], tf.int64,
                                       zeros, transient=False)
            self.admitted = ps_variable("sync/admitted", [num_workers],
                                        tf.float32, zeros, transient=True)
            self.contributions = ps_variable(  # see count_and_advance
                "sync/contributions", [num_workers], tf.int64, zeros, True)
            self.stats = ps_variable("sync/stats", [num_workers, NUM_STATS],
                                     tf.float32, zeros, transient=True)
            self.arrivals = queues.shared_queue(  # (worker, step)
                "sync/arrivals", [tf.int32, tf.int64], [[], []])
            self.tokens = [queues.step_queue(f"sync/tokens_{k}")
                           for k in range(num_workers)]
        self.grads = []
        for s, (size, device) in enumerate(zip(shard_sizes, shard_devices)):
            with tf.device(device):
                self.grads.append(ps_variable(f"sync/grads_{s}",
                                              [num_workers, size], tf.float32,
                                              zeros, transient=True))

    # --- Worker side ---

    def pull(self, step: tf.Tensor, shard_variables: list,
             ready: list | None = None) -> tuple:
        """Reads every shard s after `step` and `ready[s]` (its pull turn,
        PullTurns.wait) are known; returns (step, values).

        `step` (int64, on ps 0) rides exact inside shard 0's tensor, which
        its ps, like every ps its shard, rounds to the wire dtype: one
        transfer per shard. Returns the step (int64 []) and the shard
        values (float32 [n_s] each) on the current (worker) device.
        """
        dtype = self.wire_dtype
        ready = ready or [step] * len(shard_variables)
        with tf.device(self.shard_devices[0]), \
                tf.control_dependencies([step, ready[0]]):
            packed = tf.concat(
                [wire.to_wire(shard_variables[0].read_value(), dtype),
                 wire.bits_to_wire(tf.cast(step, tf.int64), dtype)], axis=0)
        sent = []
        for variable, device, after in zip(shard_variables[1:],
                                           self.shard_devices[1:], ready[1:]):
            with tf.device(device), tf.control_dependencies([step, after]):
                sent.append(wire.to_wire(variable.read_value(), dtype))
        value0, step_bits = _unpack(
            packed, [self.shard_sizes[0], wire.exact_size(tf.int64, 1, dtype)])
        values = [wire.from_wire(v) for v in [value0] + sent]
        return wire.bits_from_wire(step_bits, tf.int64, []), values

    def push(self, worker: int, step: tf.Tensor, shard_grads: list,
             stats: tf.Tensor) -> tf.Operation:
        """Writes worker's gradient sums and stats, then announces arrival.

        The gradients are rounded to the wire dtype here (on the worker)
        and turned back into float32 on their ps; the stats and the step
        ride bit-exact with shard 0's gradient.

        Args:
          worker: this worker's index k.
          step: int64 scalar, the step the gradients belong to.
          shard_grads: float32 [n_s] per shard, the sum over this worker's
            examples of the per-example loss gradient.
          stats: float32 [3], (examples, loss sum, correct predictions).
        """
        dtype = self.wire_dtype
        sent = [wire.to_wire(grads, dtype) for grads in shard_grads]
        packed = tf.concat([sent[0], wire.bits_to_wire(stats, dtype),
                            wire.bits_to_wire(tf.cast(step, tf.int64), dtype)],
                           axis=0)
        row = tf.constant([worker])
        with tf.device(self.shard_devices[0]):
            grad0, stats_bits, step_bits = _unpack(packed, [
                self.shard_sizes[0],
                wire.exact_size(tf.float32, NUM_STATS, dtype),
                wire.exact_size(tf.int64, 1, dtype)])
            stats_ps = wire.bits_from_wire(stats_bits, tf.float32,
                                           [NUM_STATS])
            writes = [_write_row(self.grads[0], row, wire.from_wire(grad0)),
                      _write_row(self.stats, row, stats_ps)]
            step_ps = wire.bits_from_wire(step_bits, tf.int64, [])
        for s in range(1, len(self.grads)):
            with tf.device(self.shard_devices[s]):
                writes.append(_write_row(self.grads[s], row,
                                         wire.from_wire(sent[s])))
        with tf.device(self.shard_devices[0]), \
                tf.control_dependencies(writes):
            return self.arrivals.enqueue((tf.constant(worker), step_ps))

    def next_token(self, worker: int) -> tf.Tensor:
        """Waits for the next step number from the chief (int64 scalar).

        A backup worker that fell behind finds several tokens queued; it
        takes them all and goes on with the newest, so it does not work
        through steps that are already over.
        """
        queue = self.tokens[worker]
        with tf.device(self.shard_devices[0]):
            available = tf.maximum(queue.size(), 1)
            return queue.dequeue_many(available)[-1]

    def resync_step(self, worker: int) -> tf.Tensor:
        """The step to work on after a (re)start: drop stale tokens, then
        read the global step (int64 scalar); with ordered pulls, also take
        the turn for it (PullTurns.take_own)."""
        queue = self.tokens[worker]
        with tf.device(self.shard_devices[0]):
            drained = queue.dequeue_many(queue.size())
            with tf.control_dependencies([drained]):
                step = self.global_step.read_value()
            with tf.control_dependencies(
                    self.pull_turns.take_own(worker, step)):
                return tf.identity(step)

    # --- Chief side ---

    def admit(self, step: tf.Tensor) -> tf.Tensor:
        """Takes arrivals until R distinct workers have arrived for `step`.

        Returns the admitted rows (int64 [R]). A stale arrival (another
        step) is dropped and counted; a second one from an admitted worker
        (a restarted worker redoing its step) is ignored.
        """
        with tf.device(self.shard_devices[0]):
            with tf.control_dependencies([step]):
                admitted0 = tf.cast(
                    tf.reduce_sum(self.admitted.read_value()), tf.int32)

            def wait_for_more(count):
                return count < self.replicas

            def admit_one(count):
                worker, arrived_for = self.arrivals.dequeue()
                seen = tf.gather(self.admitted.read_value(), worker) > 0.5
                fresh = tf.logical_and(tf.equal(arrived_for, step),
                                       tf.logical_not(seen))
                stale = tf.not_equal(arrived_for, step)
                mark = tf.raw_ops.ResourceScatterMax(
                    resource=self.admitted.handle, indices=worker[None],
                    updates=tf.cast(fresh, tf.float32)[None])
                count_drop = self.dropped.assign_add(
                    tf.cast(stale, tf.int64), read_value=False)
                with tf.control_dependencies([mark, count_drop]):
                    return count + tf.cast(fresh, tf.int32)

            (admitted,) = tf.while_loop(wait_for_more, admit_one, [admitted0],
                                        parallel_iterations=1)
            with tf.control_dependencies([admitted]):
                return tf.where(self.admitted.read_value() > 0.5)[:, 0]

    def average(self, rows: tf.Tensor) -> tuple[list, tf.Tensor]:
        """The example-weighted mean of the gradients in `rows` (admit).

        Returns:
          mean_grads: float32 [n_s] per shard, each on its ps.
          stats: float32 [3], summed over the admitted workers.
        """
        with tf.device(self.shard_devices[0]):
            stats = tf.reduce_sum(self.stats.sparse_read(rows), axis=0)
        mean_grads = []
        for grads, device in zip(self.grads, self.shard_devices):
            with tf.device(device):
                mean_grads.append(
                    tf.reduce_sum(grads.sparse_read(rows), axis=0) / stats[0])
        return mean_grads, stats

    def count_and_advance(self, step: tf.Tensor, after: list) -> tf.Tensor:
        """After `after` (the update), counts the admitted gradients,
        advances the step and wakes the other workers.

        Returns step + 1 (int64 scalar on ps 0), available only once every
        worker's token for it is queued.
        """
        with tf.device(self.shard_devices[0]):
            next_step = step + 1
            # Counted on the ps with the step itself: exact even when a
            # worker's session broke after pushing (it lost its own count).
            with tf.control_dependencies(after):
                counted = self.contributions.assign_add(tf.cast(
                    self.admitted.read_value() > 0.5, tf.int64),
                    read_value=False)
            with tf.control_dependencies([counted]):
                advance = [
                    self.global_step.assign(next_step, read_value=False),
                    self.admitted.assign(tf.zeros([self.num_workers]),
                                         read_value=False)]
            with tf.control_dependencies(advance):
                wake = [queue.enqueue(next_step) for queue in self.tokens[1:]]
            with tf.control_dependencies(advance + wake):
                return tf.identity(next_step)

    def start_op(self, after: list = ()) -> tf.Operation:
        """Run by the chief after init or restore, before marking ready.

        Forgets admissions and arrivals of an interrupted step, then (after
        `after` too) hands every worker the current step, which also
        releases workers that were waiting for a step a previous chief
        never finished (and, with ordered pulls, for a turn it never
        passed).
        """
        with tf.device(self.shard_devices[0]):
            reset = [
                self.admitted.assign(tf.zeros([self.num_workers]),
                                     read_value=False),
                self.arrivals.dequeue_many(self.arrivals.size())[0].op,
                *self.pull_turns.release_all(), *after]
            with tf.control_dependencies(reset):
                step = self.global_step.read_value()
                return tf.group([queue.enqueue(step)
                                 for queue in self.tokens[1:]])

    def stop_workers(self, after: list) -> tf.Operation:
        """After `after`, hands every other worker the STOP token (and
        lets through any that waits for a pull turn)."""
        with tf.device(self.shard_devices[0]):
            with tf.control_dependencies([*after,
                                          *self.pull_turns.release_all()]):
                return tf.group([queue.enqueue(tf.constant(STOP, tf.int64))
                                 for queue in self.tokens[1:]])
