"""A step's data between a worker and the ps tasks: one tensor per shard
each way, cast to the wire dtype (wire.py) on the sending device, so that
the narrow tensor crosses (rounded to nearest even, widened exactly)."""

import tensorflow as tf

from trainer.learning.replica import NUM_STATS
from trainer.sync import state as state_lib, wire
from trainer.sync.state import TOKEN_SIZE, set_at


def _unpack(packed: tf.Tensor, sizes: list[int]) -> list[tf.Tensor]:
    # Not tf.split: an aligned slice shares the buffer, a split copies it.
    pieces, start = [], 0
    for size in sizes:
        pieces.append(tf.slice(packed, [start], [size]))
        start += size
    return pieces


class Transport:
    """Pull and push over a SharedState's devices."""

    def __init__(self, shared: state_lib.SharedState, wire_dtype):
        """wire_dtype: one of wire.DTYPES or its name, else UserError."""
        self.shared, self.wire_dtype = shared, wire.wire_dtype(wire_dtype)

    def pull(self, token: tf.Tensor, shard_variables: list,
             ready: list) -> tuple:
        """Reads each shard s once `token` (int64 [4], on ps 0, which rides
        in shard 0's tensor) and `ready[s]` (PullTurns.wait) are there.
        Returns the token and the shards (float32 [n_s]) on this device."""
        dtype, devices = self.wire_dtype, self.shared.shard_devices
        with tf.device(devices[0]), tf.control_dependencies([token, ready[0]]):
            packed = tf.concat(
                [tf.cast(shard_variables[0].read_value(), dtype),
                 wire.bits_to_wire(token, dtype)], axis=0)
        sent = []
        for variable, device, after in zip(shard_variables[1:], devices[1:],
                                           ready[1:]):
            with tf.device(device), tf.control_dependencies([token, after]):
                sent.append(tf.cast(variable.read_value(), dtype))
        value0, token_bits = _unpack(packed, [
            self.shared.shard_sizes[0],
            wire.exact_size(tf.int64, TOKEN_SIZE, dtype)])
        values = [tf.cast(v, tf.float32) for v in [value0] + sent]
        return wire.bits_from_wire(token_bits, tf.int64, [TOKEN_SIZE]), values

    def push(self, worker: int, token: tf.Tensor, shard_grads: list,
             stats: tf.Tensor) -> tf.Operation:
        """Writes worker's gradient sums (float32 [n_s] per shard, or int32)
        and stats (float32 [3]: examples, loss sum, correct) into row
        `worker`, then puts (PUSHED, worker, step, round) on sync/events.
        token: int64 [4], the gradients' own."""
        shared, kept = self.shared, self.shared.grad_dtype
        # Shard 0's gradient, the stats and the token cross as one tensor
        # of the wire dtype; int32 sums carry them in int32.
        carrier = tf.int32 if shared.fixed is not None else self.wire_dtype
        sent = [tf.cast(grads, carrier) for grads in shard_grads]
        packed = tf.concat([sent[0], wire.bits_to_wire(stats, carrier),
                            wire.bits_to_wire(token, carrier)], axis=0)
        row = tf.constant([worker])
        with tf.device(shared.shard_devices[0]):
            grad0, stats_bits, token_bits = _unpack(packed, [
                shared.shard_sizes[0],
                wire.exact_size(tf.float32, NUM_STATS, carrier),
                wire.exact_size(tf.int64, TOKEN_SIZE, carrier)])
            token_ps = wire.bits_from_wire(token_bits, tf.int64, [TOKEN_SIZE])
            writes = [set_at(shared.grads[0], row, tf.cast(grad0, kept)),
                      set_at(shared.stats, row, wire.bits_from_wire(
                          stats_bits, tf.float32, [NUM_STATS])),
                      set_at(shared.pushed_slices, row, token_ps[2:])]
            step, round_ = token_ps[0], token_ps[1]
        for s in range(1, len(shared.grads)):
            with tf.device(shared.shard_devices[s]):
                writes.append(set_at(shared.grads[s], row,
                                     tf.cast(sent[s], kept)))
        # Announced only while the chief's graph reads the rows where this
        # one put them (no ps went down, or came back, since it was built).
        with tf.device(shared.shard_devices[0]), \
                tf.control_dependencies(writes):
            same = tf.debugging.assert_equal(
                shared.ps_down.read_value(),
                tf.constant(shared.ps_down_here, tf.int64),
                message=state_lib.SERVING_CHANGED)
        with tf.control_dependencies([same]):
            return shared.send_event(state_lib.PUSHED, worker, step, round_)
