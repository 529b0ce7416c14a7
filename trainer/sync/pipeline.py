"""The pipelined protocol (--chunk_kb): parameters and gradients cross in
chunks, each ps applies a chunk as soon as its gradients are in, and a
worker pulls a chunk as soon as it is applied, while it still pushes the
later ones. Both directions of every link are busy at once, so a step
bound by the links takes about one model's bytes over the link rate
(BytePS's bound) instead of two.

The chunks are the shards of trainer/learning/params.py, cut finer: the
model's floats in model order, cut into C chunks of at most --chunk_kb
KiB, C a multiple of the ps tasks, and chunk c on ps c mod P. So the
chunks that cross first (the first layer's, which the next forward pass
needs first) are spread over every ps link.

A round of step t, r (trainer/sync/averaging.py plans it as before):

1. Every member computes its slice's gradient with the parameters it
   pulled at the end of its last round, if that round was r - 1 of step
   t - 1; otherwise (it was not in, or a round was abandoned) it reads
   them afresh (`read_for`; in the chief's loop, `read_unless`).
2. It pushes chunk 0, 1, ... with a few of them on the way (TCP
   would otherwise share the link among all of them and every chunk
   would arrive last); each lands in the worker's row of that chunk and
   puts (t, r, worker) on the chunk's arrival queue, on its ps.
3. On each ps, the chief's loop resolves each chunk (chunk_apply.py): once
   every member of round r has arrived, it sums their rows in worker
   order, divides by the global batch and applies the optimizer to the
   chunk (trainer/learning/optim.ChunkUpdate), then tells every worker
   given a token "chunk done for round r" (+r on its ready queue).
4. A worker waits for +r on each chunk and pulls it: the parameters of
   step t + 1, which it carries into its next round.
5. The chief admits the round by its PUSHED events, as before; it plans
   the next round only once every chunk of this one is resolved, so no
   chunk is ever being applied while a round is planned.

Exact through leave, join and deadlines: if a member leaves (or is late)
before every chunk is in, the chief abandons the round, and puts
(t, r, ABORT) on every arrival queue; chunks not complete are not
applied, and their waiters get -r. Chunks already applied stay applied
(all of round r's members had pushed them, so they are the whole batch's
update), and the round is planned again: the new members compute step t
with `read_for(t)`, which reads an applied chunk's value from before the
update (`prev`), and only the chunks not yet applied for t are applied.
A chief's loop that must halt with a step half-applied first finishes it
(`partial`), so a checkpoint never holds a half-applied step.
"""

import math

import tensorflow as tf

from trainer.common.config import MIN_CHUNK_KB, TrainConfig
from trainer.common.errors import UserError
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.learning.replica import NUM_STATS
from trainer.sync import queues
from trainer.sync import state as state_lib
from trainer.sync import wire

# Chunks a worker has on the way (pushed, not yet landed) per ps task:
# chunk c is on ps c mod P, so every ps link carries one at a time. With
# two per ps, both went over the same gRPC connection side by side and
# both landed late: 8 chunks of 50 KiB took 91.8 ms a step against 59.1
# with one (mlp, 4 workers, 4 ps hosts at 100 Mbit/s; 16 chunks: 64.6
# both ways).
DEPTH_PER_PS = 1
ABORT = -1         # worker of an arrival entry: the round was abandoned
RELEASE = -(2**62)  # ready entry: let any waiter through, its pull invalid


def layout(config: TrainConfig, num_ps: int) -> list[list]:
    """The shards: one per ps, or with --chunk_kb, C chunks (C a multiple
    of num_ps) of at most chunk_kb KiB; shard c lives on ps c mod num_ps."""
    specs = replica_lib.model_specs(config)
    if not config.chunk_kb:
        return params_lib.plan_shards(specs, num_ps)
    total = sum(s.size for s in specs)
    per_chunk = config.chunk_kb * 1024 // 4
    count = num_ps * math.ceil(math.ceil(total / per_chunk) / num_ps)
    return params_lib.plan_shards(specs, count)


def check_chunk_size(config: TrainConfig) -> None:
    """Raises UserError if --chunk_kb is more than the whole model."""
    if not config.chunk_kb:
        return
    total_kb = sum(s.size for s in replica_lib.model_specs(config)) * 4 / 1024
    if config.chunk_kb > total_kb:
        raise UserError(
            f"--chunk_kb={config.chunk_kb} is more than the whole "
            f"{config.model} model ({total_kb:.0f} KiB of float32); use "
            f"{MIN_CHUNK_KB} to {int(total_kb)}, or 0 to send whole shards")


def group_by_device(ops: list, devices: list[str]) -> list:
    """One group per device of the ops on it, built there: a later
    control edge to another device then crosses once per device."""
    by_device = {}
    for op, device in zip(ops, devices):
        by_device.setdefault(device, []).append(op)
    groups = []
    for device, group in by_device.items():
        with tf.device(device):
            groups.append(tf.group(group))
    return groups


class Pipeline:
    """Per chunk c, on its ps: `applied_for` (int64 [], the step last
    applied, -1 none since the chief started), `prev` (float32 [n_c], the
    value before that apply), the arrival queue and one ready queue per
    worker. Every worker builds it alike; found by name."""

    def __init__(self, shared: state_lib.SharedState, flat, wire_dtype):
        self.shared, self.flat = shared, flat
        self.wire_dtype = wire.wire_dtype(wire_dtype)
        self.devices = shared.shard_devices
        n = shared.num_workers
        self.applied_for, self.prev, self.arrivals, self.ready = [], [], [], []
        for c, (device, size) in enumerate(zip(self.devices,
                                               shared.shard_sizes)):
            with tf.device(device):
                self.applied_for.append(state_lib.ps_variable(
                    f"sync/applied_for_{c}", [], tf.int64,
                    tf.compat.v1.constant_initializer(-1), transient=True))
                self.prev.append(state_lib.ps_variable(
                    f"sync/prev_{c}", [size], tf.float32,
                    tf.compat.v1.zeros_initializer(), transient=True))
                self.arrivals.append(queues.shared_queue(
                    f"sync/arrivals_{c}", [tf.int64, tf.int64, tf.int32],
                    [[], [], []]))
                self.ready.append([queues.step_queue(f"sync/ready_{c}_{k}")
                                   for k in range(n)])
        with tf.device(self.devices[0]):
            # 1 while a step is half applied (a round abandoned after some
            # chunks were applied): the chief's loop must not end there.
            self.partial = state_lib.ps_variable(
                "sync/partial", [], tf.int64,
                tf.compat.v1.zeros_initializer(), transient=True)

    # --- A member's piece ---

    def read_for(self, step: tf.Tensor) -> list:
        """Every chunk's value before global step `step` (int64 []) was
        applied, on the current (worker) device: float32 [n_c] each."""
        values = []
        for c, device in enumerate(self.devices):
            with tf.device(device):
                before = tf.where(tf.equal(self.applied_for[c].read_value(),
                                           step),
                                  self.prev[c].read_value(),
                                  self.flat.variables[c].read_value())
                sent = wire.to_wire(before, self.wire_dtype)
            # An op here, even for float32 (where from_wire is none): a
            # loop variable's machinery sits where its first value was
            # made, so a worker's carried chunk started on its ps would
            # cross to the ps and back every step.
            values.append(tf.identity(wire.from_wire(sent)))
        return values

    def read_unless(self, have: tf.Tensor, steps: list) -> list:
        """read_for, but only where `have` (bool [] on the worker) is
        False: then each chunk's value before steps[c] (int64 [] on chunk
        c's ps) was applied, float32 [n_c]; else float32 [0] each. The
        chief's loop reads afresh only after an abandoned round; a tf.cond
        around read_for cost every ps its predicate, a pivot and dead
        tensors each round, while this sends a flag and an empty tensor
        (pick between the two on the worker: pipelined_step._either)."""
        values = []
        for c, device in enumerate(self.devices):
            with tf.device(device):
                count = self.shared.shard_sizes[c] * (
                    1 - tf.cast(have, tf.int32))
                # Read once `have` is known, so after this round's plan:
                # the lowered loop would otherwise run the reads early,
                # before the chunks of the round before are applied.
                # Sliced before the select: no copy of the chunk on the
                # ps in the rounds (nearly all) that read nothing.
                with tf.control_dependencies([count]):
                    before = tf.where(
                        tf.equal(self.applied_for[c].read_value(), steps[c]),
                        tf.slice(self.prev[c].read_value(), [0], [count]),
                        tf.slice(self.flat.variables[c].read_value(), [0],
                                 [count]))
                sent = wire.to_wire(before, self.wire_dtype)
            values.append(tf.identity(wire.from_wire(sent)))
        return values

    def exchange(self, worker: int, token: tf.Tensor, grads: list,
                 stats: tf.Tensor) -> tuple:
        """Pushes worker's gradient chunks in order and pulls each back once
        applied; puts (PUSHED, worker, step, round) on sync/events once
        every chunk has landed.

        Chunk c leaves the worker once chunk c - depth has landed (a
        control edge from that ps: a few bytes), so about `depth` chunks
        are on the way at any time, spread over every ps link. (Gated on
        chunk c - depth's pull instead, the loop deadlocked.)

        Args:
          token: int64 [4] on the worker, the round's token.
          grads: float32 [n_c] per chunk, on the worker.
          stats: float32 [3], this piece's (examples, loss sum, correct).
        Returns:
          (the event op, float32 [n_c] per chunk on the worker: step + 1's
          parameters, bool []: every chunk was applied, so they are valid).
        """
        depth = DEPTH_PER_PS * len(set(self.devices))
        landed, values, valid, tokens = [], [], [], []
        for c, grad in enumerate(grads):
            (step_here, round_here), arrived = self._push_chunk(
                c, worker, token, grad, stats if c == 0 else None,
                after=landed[c - depth:c - depth + 1] if c >= depth else [])
            landed.append(arrived)
            tokens.append((step_here, round_here))
            value, done = self._pull_chunk(c, worker, round_here)
            values.append(value)
            valid.append(done)
        # Chunk c - depth had landed before chunk c left, so once the last
        # `depth` chunks have landed, every chunk has. The event rides on
        # chunk 0's copy of the token, on ps 0.
        with tf.control_dependencies(group_by_device(
                landed[-depth:], self.devices[-depth:])):
            event = self.shared.send_event(state_lib.PUSHED, worker,
                                           tokens[0][0], tokens[0][1])
        return event, values, tf.reduce_all(tf.stack(valid))

    def _push_chunk(self, c: int, worker: int, token, grad, stats,
                    after: list) -> tuple:
        """Chunk c (and the token, and stats if given) into worker's row on
        its ps once `after` (worker ops) ran, then (step, round, worker) on
        its arrivals. Returns ((step, round), int64 [] each on that ps, so
        that no slice of them is computed on, and sent back by, the worker;
        the arrival op)."""
        dtype = self.wire_dtype
        parts = [wire.to_wire(grad, dtype), wire.bits_to_wire(token, dtype)]
        sizes = [self.shared.shard_sizes[c],
                 wire.exact_size(tf.int64, state_lib.TOKEN_SIZE, dtype)]
        if stats is not None:
            parts.append(wire.bits_to_wire(stats, dtype))
            sizes.append(wire.exact_size(tf.float32, NUM_STATS, dtype))
        with tf.control_dependencies(after):
            packed = tf.concat(parts, axis=0)
        row = tf.constant([worker])
        with tf.device(self.devices[c]):
            pieces = _split(packed, sizes)
            token_here = wire.bits_from_wire(pieces[1], tf.int64,
                                             [state_lib.TOKEN_SIZE])
            writes = [state_lib.set_at(self.shared.grads[c], row,
                                       wire.from_wire(pieces[0]))]
            if stats is not None:
                writes.append(state_lib.set_at(
                    self.shared.stats, row, wire.bits_from_wire(
                        pieces[2], tf.float32, [NUM_STATS])))
            step_here, round_here = token_here[0], token_here[1]
            with tf.control_dependencies(writes):
                arrived = self.arrivals[c].enqueue(
                    (step_here, round_here, tf.constant(worker)))
        return (step_here, round_here), arrived

    def _pull_chunk(self, c: int, worker: int, round_) -> tuple:
        """Waits until chunk c is resolved for `round_` (int64 [] on its
        ps) and reads it. Returns (float32 [n_c] on the worker; bool []:
        applied, so valid). The flag rides as one more element."""
        with tf.device(self.devices[c]):
            done = self._wait_done(c, worker, round_)
            with tf.control_dependencies([done]):
                value = self.flat.variables[c].read_value()
            sent = wire.to_wire(tf.concat(
                [value, tf.cast(done, tf.float32)[None]], 0), self.wire_dtype)
        size = self.shared.shard_sizes[c]
        received = wire.from_wire(sent)
        return received[:size], received[size] > 0.5

    def _wait_done(self, c: int, worker: int, round_: tf.Tensor):
        """bool [] on chunk c's ps: chunk c is final for `round_` (its
        entry is +round_); False for -round_ or RELEASE.

        Rounds only grow, and every round before `round_` was resolved
        before its token was handed out, so when this runs every entry of
        an earlier round (a worker restarted, a token it skipped, a loop
        that ended before pulling) is already queued. It takes all of
        them, and if the newest is of an earlier round, exactly one more:
        this round's. No cond or loop: on the ps inside the worker's loop
        those cost control messages to the worker for every chunk.
        """
        queue = self.ready[c][worker]
        # Not before this round's push: the loop's next iteration would
        # otherwise take this one's entry (the dequeue has no input).
        with tf.control_dependencies([round_]):
            queued = queue.dequeue_many(tf.maximum(queue.size(), 1))
        stale = tf.abs(queued[-1]) < round_
        newest = tf.concat([queued, queue.dequeue_many(
            tf.cast(stale, tf.int32))], axis=0)[-1]
        return tf.equal(newest, round_)

    # --- The chief's side (the applies: trainer/sync/chunk_apply.py) ---

    def set_partial(self, value: int) -> tf.Operation:
        with tf.device(self.devices[0]):
            return self.partial.assign(value, read_value=False)

    def release_all(self) -> list:
        """At a chief's (re)start and stop: forgets every arrival (only the
        chief's loop, stopped now, takes them) and puts RELEASE in every
        ready queue, which lets a waiter through with an invalid pull.
        Ready queues are not drained: a worker may be taking from them
        (a drain could then block for good); the entries left are of
        earlier rounds, which every wait skips (`_wait_done`)."""
        ops = []
        for c, device in enumerate(self.devices):
            with tf.device(device):
                queue = self.arrivals[c]
                ops.append(queue.dequeue_many(queue.size())[0].op)
                ops += [ready.enqueue(tf.constant(RELEASE, tf.int64))
                        for ready in self.ready[c]]
        return ops

    def new_rounds(self) -> tf.Operation:
        """At a chief's (re)start: round numbers go on from the clock (in
        microseconds) rather than from 1, so that an entry a worker left
        before the restart is always of an earlier round than any new
        one, never taken for this round's."""
        s = self.shared
        with tf.device(self.devices[0]):
            now = tf.cast(tf.timestamp() * 1e6, tf.int64)
            return s.round.assign(tf.maximum(s.round.read_value(), now),
                                  read_value=False)


def _split(packed: tf.Tensor, sizes: list[int]) -> list[tf.Tensor]:
    pieces, start = [], 0
    for size in sizes:
        pieces.append(tf.slice(packed, [start], [size]))
        start += size
    return pieces


def put_if(queue, when: tf.Tensor, value: tf.Tensor) -> tf.Operation:
    """Enqueues `value` (int64 []) if `when` (bool []), without a cond."""
    return queue.enqueue_many(tf.fill([tf.cast(when, tf.int32)], value))
