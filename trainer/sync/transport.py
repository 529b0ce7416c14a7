"""Moving a step's data between a worker and the ps tasks: one tensor per
shard each way, with the token and statistics riding bit-exact.

The parameters (pull) and the gradient sums (push) cross in the wire dtype
(trainer/sync/wire.py); the ps keeps, sums and applies float32, so the
workers' rounding is the only approximation.
"""

import tensorflow as tf

from trainer.learning import fixed_point
from trainer.learning.replica import NUM_STATS
from trainer.sync import state as state_lib
from trainer.sync import wire
from trainer.sync.state import set_at


def _unpack(packed: tf.Tensor, sizes: list[int]) -> list[tf.Tensor]:
    """tf.split by slices: a slice at an aligned offset shares the buffer
    instead of copying it, so the big first piece costs nothing."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(tf.slice(packed, [start], [size]))
        start += size
    return pieces


class Transport:
    """Pull and push over a SharedState's devices."""

    def __init__(self, shared: state_lib.SharedState, wire_dtype):
        """wire_dtype: tf.float32, tf.bfloat16 or tf.float16 (or the name);
        raises UserError for any other."""
        self.shared = shared
        self.wire_dtype = wire.wire_dtype(wire_dtype)

    def pull(self, token: tf.Tensor, shard_variables: list,
             ready: list) -> tuple:
        """Reads every shard s once `token` and `ready[s]` (its pull turn,
        PullTurns.wait) are there. The token (int64 [4], on ps 0) rides
        exact inside shard 0's tensor, which its ps, like every ps its
        shard, rounds to the wire dtype: one transfer per shard. Returns
        the token (int64 [4]) and the shard values (float32 [n_s] each) on
        the current (worker) device."""
        dtype, devices = self.wire_dtype, self.shared.shard_devices
        with tf.device(devices[0]), \
                tf.control_dependencies([token, ready[0]]):
            packed = tf.concat(
                [wire.to_wire(shard_variables[0].read_value(), dtype),
                 wire.bits_to_wire(token, dtype)], axis=0)
        sent = []
        for variable, device, after in zip(shard_variables[1:], devices[1:],
                                           ready[1:]):
            with tf.device(device), tf.control_dependencies([token, after]):
                sent.append(wire.to_wire(variable.read_value(), dtype))
        value0, token_bits = _unpack(packed, [
            self.shared.shard_sizes[0],
            wire.exact_size(tf.int64, state_lib.TOKEN_SIZE, dtype)])
        values = [wire.from_wire(v) for v in [value0] + sent]
        return (wire.bits_from_wire(token_bits, tf.int64,
                                    [state_lib.TOKEN_SIZE]), values)

    def push(self, worker: int, token: tf.Tensor, shard_grads: list,
             stats: tf.Tensor) -> tf.Operation:
        """Writes worker's gradient sums and stats into row `worker`, then
        puts the event (PUSHED, worker, step, round) on sync/events.
        token: int64 [4], the one the gradients were computed for.
        shard_grads: per shard, the sum over the slice's examples of the
        per-example loss gradient: float32 [n_s], or int32 [n_s] in fixed
        point (--deterministic), which crosses as it is. stats: float32
        [3], (examples, loss sum, correct predictions)."""
        shared, dtype = self.shared, self.wire_dtype
        fixed = shared.fixed is not None
        sent = (shard_grads if fixed else
                [wire.to_wire(grads, dtype) for grads in shard_grads])
        # Shard 0's gradient, the stats and the token cross as one tensor
        # of the wire dtype; with int32 sums, of int32 (the bits as they
        # are).
        carrier = tf.int32 if fixed else dtype
        packed = tf.concat([wire.bits_to_wire(sent[0], carrier),
                            wire.bits_to_wire(stats, carrier),
                            wire.bits_to_wire(token, carrier)], axis=0)
        row = tf.constant([worker])
        with tf.device(shared.shard_devices[0]):
            grad0, stats_bits, token_bits = _unpack(packed, [
                wire.exact_size(sent[0].dtype, shared.shard_sizes[0],
                                carrier),
                wire.exact_size(tf.float32, NUM_STATS, carrier),
                wire.exact_size(tf.int64, state_lib.TOKEN_SIZE, carrier)])
            grad0 = (wire.bits_from_wire(grad0, fixed_point.DTYPE,
                                         [shared.shard_sizes[0]])
                     if fixed else wire.from_wire(grad0))
            stats_ps = wire.bits_from_wire(stats_bits, tf.float32,
                                           [NUM_STATS])
            token_ps = wire.bits_from_wire(token_bits, tf.int64,
                                           [state_lib.TOKEN_SIZE])
            writes = [set_at(shared.grads[0], row, grad0),
                      set_at(shared.stats, row, stats_ps),
                      set_at(shared.pushed_slices, row, token_ps[2:])]
            step_ps, round_ps = token_ps[0], token_ps[1]
        for s in range(1, len(shared.grads)):
            with tf.device(shared.shard_devices[s]):
                writes.append(set_at(
                    shared.grads[s], row,
                    sent[s] if fixed else wire.from_wire(sent[s])))
        # The rows are where this graph put them: announced only while
        # the chief's graph reads them there too (no ps went down, or came
        # back, since this worker built its graph).
        with tf.device(shared.shard_devices[0]), \
                tf.control_dependencies(writes):
            same = tf.debugging.assert_equal(
                shared.ps_down.read_value(),
                tf.constant(shared.ps_down_here, tf.int64),
                message=state_lib.SERVING_CHANGED)
        with tf.control_dependencies([same]):
            return shared.send_event(state_lib.PUSHED, worker, step_ps,
                                     round_ps)
