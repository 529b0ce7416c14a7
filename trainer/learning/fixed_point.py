"""Gradient sums in fixed point, for --deterministic.

Float addition rounds after every add, so a sum depends on its order, and
the order depends on how the global batch was cut into slices and which
worker pushed first. Integer addition does not round: the same integers
give the same sum in any order. So with --deterministic each
micro-batch's gradient (float32, the same bits whoever computes it:
trainer/learning/replica.py) is converted once to int64 at one scale
shared by every task, the worker adds its micro-batches as integers, the
ps tasks add the workers' rows as integers, and the chief converts the
step's sum back to float32 once. The update then has the same bits for
any number of workers, any slicing and any fault.

The scheme, one scale for every parameter:

- value = round(g * 2^SCALE_BITS), an int64; a resolution of 2^-32
  (2.3e-10) on a micro-batch's gradient sum, finer than float32's own
  rounding for any element above about 2e-3;
- an element beyond +-LIMIT (2^20) in one micro-batch is clipped there: a
  gradient that large means the run has diverged, and the loss it
  reports says so;
- a step sums at most MAX_MICRO_BATCHES micro-batches, so its sum stays
  below 2^(20 + 32 + 10) = 2^62 and int64 cannot overflow
  (validated in trainer/common/config.py).

NaN has no integer: a NaN gradient element turns into some integer, but
the float32 loss sum (the statistics travel as floats) is NaN too, and
the logs show it.
"""

import tensorflow as tf

from trainer.common.config import MAX_MICRO_BATCHES

SCALE_BITS = 32
LIMIT_BITS = 20
LIMIT = 2.0 ** LIMIT_BITS
# The largest step sum, 2^(LIMIT_BITS + SCALE_BITS) per micro-batch, fits.
assert LIMIT_BITS + SCALE_BITS + (MAX_MICRO_BATCHES - 1).bit_length() < 63
DTYPE = tf.int64


def to_fixed(values: tf.Tensor) -> tf.Tensor:
    """float32 [...] -> int64 [...], round(clip(values) * 2^SCALE_BITS).

    Multiplying by a power of two is exact in float32, and rounding to
    nearest even depends on the value alone.
    """
    clipped = tf.clip_by_value(values, -LIMIT, LIMIT)
    return tf.cast(tf.round(clipped * 2.0 ** SCALE_BITS), DTYPE)


def mean(sums: tf.Tensor, examples: tf.Tensor) -> tf.Tensor:
    """A gradient sum over `examples` (float32 []) divided by them.

    sums: float32 [n] (plain float sums) or int64 [n] (fixed point).
    Returns float32 [n].
    """
    if sums.dtype == DTYPE:
        return tf.cast(tf.cast(sums, tf.float64) * 2.0 ** -SCALE_BITS
                       / tf.cast(examples, tf.float64), tf.float32)
    return sums / examples
