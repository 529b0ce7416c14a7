"""The synchronous protocol's shared state on the ps tasks, built alike by
every worker (variables match by name, queues by shared_name), all on ps 0
but the gradient rows, which sit with their shard. Queues: sync/tokens_<k>
(the chief's to worker k; a negative step is STOP or REJOIN), sync/events
(to the chief: send_event), sync/deadlines (to its deadline thread,
pace.py), sync/membership (roster changes, to the chief's Python side)."""

import tensorflow as tf

from trainer.learning import fixed_point
from trainer.learning.replica import NUM_STATS
from trainer.sync import queues

STOP = -1     # token step: the chief stopped the run (coordination.py)
REJOIN = -2   # token step: a (re)started chief asks for every worker
TOKEN_SIZE = 4
NO_PS_DOWN = -1   # sync/ps_down: every ps serves its own shards
# The error of a push from a graph serving the shards otherwise than the
# chief's: its worker builds the chief's way and joins again.
SERVING_CHANGED = "the chief serves the shards from other ps tasks now"

# Event kinds on sync/events and membership records (LATE: deadlines.py).
PUSHED, JOINED, LOST, LEAVING, LATE = 0, 1, 2, 3, 4
EVENT_NAMES = {JOINED: "joined", LOST: "left", LEAVING: "left"}

# Not in checkpoints: the chief initializes them after every restore.
TRANSIENT = "sync_transient_variables"


def ps_variable(name, shape, dtype, initializer, transient):
    """A global non-trainable resource variable; TRANSIENT if `transient`."""
    return tf.compat.v1.get_variable(
        name, shape, dtype, initializer=initializer, trainable=False,
        use_resource=True,
        collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES] + (
            [TRANSIENT] if transient else []))


def _zeros(name, shape, dtype, transient=True):
    return ps_variable(name, shape, dtype, tf.compat.v1.zeros_initializer(),
                       transient)


def set_at(variable, index, value) -> tf.Operation:
    """variable[index[0]] = value (index: int [1]; value: one row)."""
    return tf.raw_ops.ResourceScatterUpdate(
        resource=variable.handle, indices=index, updates=value[None])


def set_if(variable, worker, when, value) -> tf.Operation:
    """variable[worker] = value if `when` (worker: int32 []; when: bool [])."""
    return set_at(variable, worker[None], tf.where(
        when, value, variable.read_value()[worker]))


def count(flags: tf.Tensor) -> tf.Tensor:
    """How many of `flags` (bool [N]) are set: int32 []."""
    return tf.reduce_sum(tf.cast(flags, tf.int32))


def transient_variables() -> list:
    return tf.compat.v1.get_collection(TRANSIENT)


def token(step, round_=0, first=0, end=0) -> tf.Tensor:
    """int64 [TOKEN_SIZE] from its four parts (tensors or numbers)."""
    return tf.stack([tf.cast(v, tf.int64) for v in (step, round_, first, end)])


class SharedState:
    """The protocol's variables and queues (shapes in the comments)."""

    def __init__(self, num_workers: int, shard_sizes: list[int],
                 shard_devices: list[str], train_steps: int = 1,
                 fixed: fixed_point.Scheme | None = None,
                 ps_down: int | None = None):
        # fixed: the rows' fixed point (int32 sums, exact in any order:
        # --deterministic), or None (float32). ps_down: the ps this graph
        # does without (shard_devices name its shards' copies), or None.
        self.num_workers, self.fixed = num_workers, fixed
        self.grad_dtype = fixed_point.DTYPE if fixed else tf.float32
        self.shard_sizes, self.shard_devices = shard_sizes, shard_devices
        self.ps_down_here = NO_PS_DOWN if ps_down is None else ps_down
        n = [num_workers]
        with tf.device(shard_devices[0]):
            self.global_step = _zeros("global_step", [], tf.int64,
                                      transient=False)
            # The ps the chief's graph does without, set at its every start:
            # a push from a graph that differs is refused (transport.py).
            self.ps_down = ps_variable(
                "sync/ps_down", [], tf.int64,
                tf.compat.v1.constant_initializer(NO_PS_DOWN), transient=True)
            self.dropped = _zeros("sync/dropped_gradients", [], tf.int64,
                                  transient=False)
            # Who is in (bool [N]); the chief is always in.
            self.roster = ps_variable(
                "sync/roster", n, tf.bool, tf.compat.v1.constant_initializer(
                    [True] + [False] * (num_workers - 1)), transient=True)
            # The current round: its number, who is planned into it and
            # who has pushed for it (bool [N]), [first, end) per worker.
            self.round = _zeros("sync/round", [], tf.int64)
            self.planned = _zeros("sync/planned", n, tf.bool)
            self.admitted = _zeros("sync/admitted", n, tf.bool)
            self.slices = _zeros("sync/slices", n + [2], tf.int64)
            self._worker_variables(n, train_steps)
            # Set by the chief's Python side: end the loop at the next step
            # boundary (SIGTERM, too few workers).
            self.halt = _zeros("sync/halt", [], tf.int64)
            self.events = queues.shared_queue("sync/events", [
                tf.int32, tf.int32, tf.int64, tf.int64, tf.float64], [[]] * 5)
            self.deadlines = queues.shared_queue(
                "sync/deadlines", [tf.int64, tf.int64, tf.float32], [[]] * 3)
            self.membership = queues.shared_queue("sync/membership", [
                tf.int64, tf.int32, tf.int32, tf.int32], [[]] * 4)
            self.tokens = [queues.shared_queue(f"sync/tokens_{k}", [tf.int64],
                                               [[TOKEN_SIZE]])
                           for k in range(num_workers)]
        # grads[s]: grad_dtype [N, n_s] on shard s's ps; row k: worker k's
        # gradient sum over its latest slice.
        self.grads = []
        for shard, size in enumerate(shard_sizes):
            with tf.device(shard_devices[shard]):
                self.grads.append(_zeros(f"sync/grads_{shard}",
                                         [num_workers, size], self.grad_dtype))

    def _worker_variables(self, n: list, train_steps: int) -> None:
        # Examples per second (0: unmeasured), which balanced slices
        # follow: averaged slice_examples over averaged slice_secs, which
        # a few unthrottled slices skew less than an average of rates.
        self.speed = _zeros("sync/speed", n, tf.float32)
        self.slice_examples = _zeros("sync/slice_examples", n, tf.float32)
        # Seconds from token to push; when (ps 0's clock) and in which
        # round its last token was issued; the last round it answered.
        self.slice_secs = _zeros("sync/slice_secs", n, tf.float32)
        self.issued_at = _zeros("sync/issued_at", n, tf.float64)
        self.issued_round = _zeros("sync/issued_round", n, tf.int64)
        self.answered = _zeros("sync/answered", n, tf.int64)
        # Times benched since it joined (its probes' backoff, pace.py).
        self.benched = _zeros("sync/benched", n, tf.int64)
        # Its latest push's round, stale or not (the membership watch's).
        self.last_push = _zeros("sync/last_push", n, tf.int64)
        # [steps whose average held its gradient, examples it gave them];
        # its stats; [first, end) of its latest push.
        self.contributions = _zeros("sync/contributions", n + [2], tf.int64)
        self.stats = _zeros("sync/stats", n + [NUM_STATS], tf.float32)
        self.pushed_slices = _zeros("sync/pushed_slices", n + [2], tf.int64)
        # What each global step's average held (step_record.py), from
        # record_from on (where the chief last initialized or restored;
        # earlier steps read 0). A chief taking over goes on with it.
        self.record_from = _zeros("sync/record_from", [], tf.int64)
        self.by_step = _zeros(
            "sync/averaged_by_step", [max(train_steps, 1), 1 + n[0]], tf.int32)
        # The roster changes from record_from on (JSON, as in results.json),
        # here so that a chief that reconnects or takes over has them all.
        self.membership_log = ps_variable(
            "sync/membership_log", None, tf.string, tf.constant("[]"),
            transient=True)

    def send_event(self, kind: int, worker, step=-1, round_=-1
                   ) -> tf.Operation:
        """Puts (kind, worker, step, round, time) on sync/events (worker:
        int or int32 []). The time is ps 0's clock on arrival, as the
        plan's, so the rule times a round before its push is admitted."""
        with tf.device(self.shard_devices[0]):
            return self.events.enqueue((
                tf.cast(kind, tf.int32), tf.cast(worker, tf.int32),
                tf.cast(step, tf.int64), tf.cast(round_, tf.int64),
                tf.timestamp()))

    def _take_all(self, queue, wait: bool):
        with tf.device(self.shard_devices[0]):
            size = queue.size()
            return queue.dequeue_many(tf.maximum(size, 1) if wait else size)

    def next_token(self, worker: int) -> tf.Tensor:
        """Waits for worker's next token (int64 [TOKEN_SIZE]): the newest
        queued, the older ones being for rounds re-planned since."""
        return self._take_all(self.tokens[worker], True)[-1]

    def drain_tokens(self, worker: int) -> tf.Operation:
        """Drops whatever is in worker's token queue (before it joins)."""
        return self._take_all(self.tokens[worker], False)[0].op

    def give_all(self, value: tf.Tensor, chief: int, after=()) -> tf.Operation:
        """After `after`, puts token `value` in every queue but the chief's."""
        with tf.device(self.shard_devices[0]), tf.control_dependencies(after):
            return tf.group([q.enqueue(value) for k, q in
                             enumerate(self.tokens) if k != chief])

    def take_deadlines(self) -> tuple:
        """Queued deadline requests, waiting for one: (step, round int64
        [n], seconds float32 [n])."""
        return self._take_all(self.deadlines, True)

    def take_membership(self) -> tuple:
        """Membership records so far, without waiting: (step int64 [n],
        kind int32 [n], worker int32 [n], members int32 [n])."""
        return self._take_all(self.membership, False)
