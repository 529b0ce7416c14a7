"""The synchronous protocol's shared state on the ps tasks.

Every worker builds this alike; TensorFlow matches variables by name and
queues by shared_name, so every graph addresses the same resources. All
of it is on ps 0 except the gradient rows, which sit with their shard.

What crosses between the chief and the workers:
- a token, int64 [4] = (step, round, first example, end example), in
  worker k's queue `sync/tokens_<k>`: "compute rows [first, end) of the
  global batch of `step` for round `round`". Only the chief fills them.
  A negative step is not work: STOP (the chief ended the run) or REJOIN
  (a restarted chief asks every worker to join again).
- an event, (kind, worker, step, round, time), on `sync/events`: a gradient
  pushed, a worker joining, a worker lost (from the chief's membership
  watch) or leaving on SIGTERM. Only the chief takes them.
- a membership record, (step, kind, worker, members after), on
  `sync/membership`, put by the chief's graph whenever the roster changes,
  taken by the chief's Python side for its log and results.json.
"""

import tensorflow as tf

from trainer.learning import fixed_point
from trainer.learning.replica import NUM_STATS
from trainer.sync import queues

STOP = -1     # token step: the chief stopped the run (coordination.py)
REJOIN = -2   # token step: a (re)started chief asks for every worker
TOKEN_SIZE = 4
NO_PS_DOWN = -1   # sync/ps_down: every ps serves its own shards
# In the error of a push from a graph that serves the shards otherwise
# than the chief's: its worker builds the chief's way and joins again.
SERVING_CHANGED = "the chief serves the shards from other ps tasks now"

# Event kinds on sync/events (and membership records).
# LATE: a round's deadline passed (trainer/roles/deadlines.py).
PUSHED, JOINED, LOST, LEAVING, LATE = 0, 1, 2, 3, 4
EVENT_NAMES = {JOINED: "joined", LOST: "left", LEAVING: "left"}

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


def _transient_zeros(name, shape, dtype):
    """A ps_variable in TRANSIENT that starts at zeros."""
    return ps_variable(name, shape, dtype, tf.compat.v1.zeros_initializer(),
                       transient=True)


def set_at(variable, index, value) -> tf.Operation:
    """variable[index[0]] = value (index: int [1]; value: one row)."""
    return tf.raw_ops.ResourceScatterUpdate(
        resource=variable.handle, indices=index, updates=value[None])


def set_if(variable, worker, when, value) -> tf.Operation:
    """variable[worker] = value if `when` (bool []), else unchanged
    (worker: int32 []; value: a scalar)."""
    return set_at(variable, worker[None], tf.where(
        when, value, variable.read_value()[worker]))


def count(flags: tf.Tensor) -> tf.Tensor:
    """How many of `flags` (bool [N]) are set: int32 []."""
    return tf.reduce_sum(tf.cast(flags, tf.int32))


def transient_variables() -> list:
    return tf.compat.v1.get_collection(TRANSIENT)


def token(step, round_=0, first=0, end=0) -> tf.Tensor:
    """int64 [TOKEN_SIZE] from its four parts (tensors or numbers)."""
    return tf.stack([tf.cast(v, tf.int64) for v in (step, round_, first,
                                                     end)])


class SharedState:
    """The protocol's variables and queues (shapes in the comments)."""

    def __init__(self, num_workers: int, shard_sizes: list[int],
                 shard_devices: list[str], train_steps: int = 1,
                 fixed: fixed_point.Scheme | None = None,
                 ps_down: int | None = None):
        # fixed: the fixed point of the gradient rows (int32 sums,
        # --deterministic), or None (float32 sums).
        # ps_down: the ps this graph does without (its shards are served
        # by their copies, shard_devices says where), or None.
        self.num_workers, self.fixed = num_workers, fixed
        self.grad_dtype = fixed_point.DTYPE if fixed else tf.float32
        self.shard_sizes, self.shard_devices = shard_sizes, shard_devices
        self.ps_down_here = NO_PS_DOWN if ps_down is None else ps_down
        zeros = tf.compat.v1.zeros_initializer()
        n = [num_workers]
        with tf.device(shard_devices[0]):
            self.global_step = ps_variable("global_step", [], tf.int64, zeros,
                                           transient=False)
            # The ps the chief's graph does without (NO_PS_DOWN: none),
            # set at its every start: a push from a graph that differs is
            # refused (trainer/sync/transport.py).
            self.ps_down = ps_variable(
                "sync/ps_down", [], tf.int64,
                tf.compat.v1.constant_initializer(NO_PS_DOWN), transient=True)
            self.dropped = ps_variable("sync/dropped_gradients", [], tf.int64,
                                       zeros, transient=False)
            # Who is in (bool [N]); the chief is always in.
            self.roster = ps_variable(
                "sync/roster", n, tf.bool, tf.compat.v1.constant_initializer(
                    [True] + [False] * (num_workers - 1)), transient=True)
            # The current round: its number, who was planned into it, who
            # has pushed for it (bool [N] each), each planned slice.
            self.round = _transient_zeros("sync/round", [], tf.int64)
            self.planned = _transient_zeros("sync/planned", n, tf.bool)
            self.admitted = _transient_zeros("sync/admitted", n, tf.bool)
            self.slices = _transient_zeros(  # [first, end) per worker
                "sync/slices", n + [2], tf.int64)
            self._timing_variables(n)
            self._record_variables(n, train_steps)
            # Set by the chief's Python side: end the loop at the next step
            # boundary (SIGTERM, too few workers).
            self.halt = _transient_zeros("sync/halt", [], tf.int64)
            self.events = queues.shared_queue(  # see send_event
                "sync/events",
                [tf.int32, tf.int32, tf.int64, tf.int64, tf.float64],
                [[], [], [], [], []])
            # (step, round, seconds): when to send a round's LATE event
            # (trainer/sync/pace.py); only the chief's thread takes them.
            self.deadlines = queues.shared_queue(
                "sync/deadlines", [tf.int64, tf.int64, tf.float32],
                [[], [], []])
            self.membership = queues.shared_queue(
                "sync/membership", [tf.int64, tf.int32, tf.int32, tf.int32],
                [[], [], [], []])
            self.tokens = [queues.shared_queue(f"sync/tokens_{k}", [tf.int64],
                                               [[TOKEN_SIZE]])
                           for k in range(num_workers)]
        self.grads = [self._gradient_rows(s) for s in range(len(shard_sizes))]

    def _record_variables(self, n: list, train_steps: int) -> None:
        """What the pushes and the averages held (on ps 0, the device)."""
        # Per worker: [steps whose average held its gradient, the
        # examples it contributed to them] (int64 [N, 2]).
        self.contributions = _transient_zeros("sync/contributions", n + [2],
                                              tf.int64)
        self.stats = _transient_zeros("sync/stats", n + [NUM_STATS],
                                      tf.float32)
        # [first, end) of each worker's latest push, as it computed it.
        self.pushed_slices = _transient_zeros("sync/pushed_slices", n + [2],
                                              tf.int64)
        # What each global step's average held (step_record.py), from
        # record_from (int64 []) on: where the chief last initialized or
        # restored (earlier steps read 0). A chief that takes over goes on
        # with the record as it is.
        self.record_from = _transient_zeros("sync/record_from", [], tf.int64)
        self.by_step = _transient_zeros(
            "sync/averaged_by_step", [max(train_steps, 1), 1 + n[0]], tf.int32)
        # The roster changes from record_from on, as results.json lists
        # them (JSON, string []): kept here, not in the chief's process,
        # so that a chief that connects again or takes over has them all.
        self.membership_log = tf.compat.v1.get_variable(
            "sync/membership_log", dtype=tf.string,
            initializer=tf.constant("[]"), trainable=False,
            use_resource=True,
            collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, TRANSIENT])

    def _timing_variables(self, n: list) -> None:
        """Per worker (on ps 0, the device): its speed, how long its
        slices take, and what it was issued and answered last."""
        # Examples per second of each worker, averaged over its recent
        # rounds; 0 until measured. Balanced slices follow it.
        self.speed = _transient_zeros("sync/speed", n, tf.float32)
        # The examples of each worker's recent slices, averaged alike: its
        # speed is this over slice_secs (a ratio of averages, not an
        # average of ratios, which a few unthrottled slices would skew).
        self.slice_examples = _transient_zeros("sync/slice_examples", n,
                                               tf.float32)
        # Seconds from token to push of its recent slices; when (ps 0's
        # clock) and in which round its last token was issued; the last
        # round it answered.
        self.slice_secs = _transient_zeros("sync/slice_secs", n, tf.float32)
        self.issued_at = _transient_zeros("sync/issued_at", n, tf.float64)
        self.issued_round = _transient_zeros("sync/issued_round", n, tf.int64)
        self.answered = _transient_zeros("sync/answered", n, tf.int64)
        # How often each worker was benched since it joined:
        # its probes come PROBE_SECS x 2^(times - 1) apart (pace.py).
        self.benched = _transient_zeros("sync/benched", n, tf.int64)
        # The round of each worker's latest push, stale or not: the
        # membership watch hears from a worker by it.
        self.last_push = _transient_zeros("sync/last_push", n, tf.int64)

    def _gradient_rows(self, shard: int):
        """grad_dtype [N, n_s] on shard s's ps: row k is worker k's
        gradient sum of its latest slice."""
        with tf.device(self.shard_devices[shard]):
            return _transient_zeros(
                f"sync/grads_{shard}",
                [self.num_workers, self.shard_sizes[shard]], self.grad_dtype)

    def send_event(self, kind: int, worker, step=-1, round_=-1
                   ) -> tf.Operation:
        """Puts (kind, worker, step, round, time) on sync/events (worker:
        int or int32 []). The time is ps 0's clock as the event arrives,
        the clock the plan's time is read from, so the rule can time a
        worker's round without waiting for its turn to be admitted."""
        with tf.device(self.shard_devices[0]):
            return self.events.enqueue((
                tf.cast(kind, tf.int32), tf.cast(worker, tf.int32),
                tf.cast(step, tf.int64), tf.cast(round_, tf.int64),
                tf.timestamp()))

    def next_token(self, worker: int) -> tf.Tensor:
        """Waits for worker's next token (int64 [TOKEN_SIZE]). Tokens
        queued while the worker was busy are for rounds that are over (a
        round re-planned after a worker left): it takes them all and goes
        on with the newest."""
        queue = self.tokens[worker]
        with tf.device(self.shard_devices[0]):
            available = tf.maximum(queue.size(), 1)
            return queue.dequeue_many(available)[-1]

    def drain_tokens(self, worker: int) -> tf.Operation:
        """Drops whatever is in worker's token queue (before it joins)."""
        queue = self.tokens[worker]
        with tf.device(self.shard_devices[0]):
            return queue.dequeue_many(queue.size())[0].op

    def give_all(self, value: tf.Tensor, chief: int, after=()
                 ) -> tf.Operation:
        """After `after`, puts token `value` in the queue of every worker
        but the chief."""
        with tf.device(self.shard_devices[0]), \
                tf.control_dependencies(list(after)):
            return tf.group([q.enqueue(value) for k, q in
                             enumerate(self.tokens) if k != chief])

    def take_deadlines(self) -> tuple:
        """Every queued deadline request, waiting for one: (steps int64
        [n], rounds int64 [n], seconds float32 [n])."""
        with tf.device(self.shard_devices[0]):
            return self.deadlines.dequeue_many(
                tf.maximum(self.deadlines.size(), 1))

    def take_membership(self) -> tuple:
        """Membership records so far, without waiting: (step int64 [n],
        kind int32 [n], worker int32 [n], members int32 [n])."""
        with tf.device(self.shard_devices[0]):
            return self.membership.dequeue_many(self.membership.size())
