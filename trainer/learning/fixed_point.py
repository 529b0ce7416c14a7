"""Gradient sums in fixed point: the same bits for any number of workers.

Float addition rounds after every add, so a sum depends on its order, and
the order depends on how the global batch was cut into slices and which
worker pushed first. Integer addition does not round: the same integers
give the same sum in any order. So (by default; --nodeterministic sums
floats) each micro-batch's gradient (float32, the same bits whoever
computes it: trainer/learning/replica.py) is converted once to int32 at
one scale shared by every task, the worker adds its micro-batches as
integers, the ps tasks add the workers' rows as integers, and the chief
converts the step's sum back to float32 once. The update then has the
same bits for any number of workers, any slicing and any fault.

The scheme (`Scheme`, fixed for a run by the global batch B and the
micro-batch m; M = ceil(B / m) micro-batches a step):

- cap_bits c = 31 - bit_length(M): each micro-batch's element is at most
  2^c in magnitude, so M of them, and so any partial sum of them in any
  order, stay below 2^31: int32 never overflows;
- scale_bits s = c - max(ROW_BITS + ceil(log2 m), CLIP_BITS): an element
  is round(g * 2^s) of the micro-batch's gradient sum g, clipped to
  +-2^(c - s), which is 2^ROW_BITS per row of the micro-batch or more,
  and 2^CLIP_BITS at least (one example's gradient can reach that of a
  few);
- so the mean gradient's resolution, 2^-s / B, is at most 2^-23, and
  between 2^-27 and 2^-25 from m = 8 up (docs/how-it-works.md gives a
  table).

A gradient element beyond the clip means the run has diverged or is
about to; its loss (the statistics travel as floats) says so. Clipping
is deterministic: it changes the update, never the agreement.

NaN has no integer: a NaN gradient element becomes some integer, but the
float32 loss sum is NaN too, and the logs show it.
"""

import dataclasses

import tensorflow as tf

DTYPE = tf.int32
SUM_BITS = 31          # int32's magnitude
ROW_BITS = 4           # the clip per row of a micro-batch, 2^ROW_BITS
CLIP_BITS = 7          # and per micro-batch, at least 2^CLIP_BITS


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One run's fixed point: scale_bits s and cap_bits c (above)."""

    scale_bits: int
    cap_bits: int

    def to_fixed(self, values: tf.Tensor) -> tf.Tensor:
        """float32 [...] -> int32 [...], round(clip(values) * 2^s).

        The clip bound and the scale are powers of two, exact in float32,
        and rounding to nearest even depends on the value alone."""
        limit = 2.0 ** (self.cap_bits - self.scale_bits)
        clipped = tf.clip_by_value(values, -limit, limit)
        return tf.cast(tf.round(clipped * 2.0 ** self.scale_bits), DTYPE)

    def mean(self, sums: tf.Tensor, examples: tf.Tensor) -> tf.Tensor:
        """int32 [n] sums over `examples` (float32 []) -> their float32
        [n] mean, through float64 (exact for every int32)."""
        return tf.cast(tf.cast(sums, tf.float64) * 2.0 ** -self.scale_bits
                       / tf.cast(examples, tf.float64), tf.float32)


def scheme(batch_size: int, micro_batch: int) -> Scheme:
    """The Scheme for a global batch of `batch_size` rows cut into
    micro-batches of `micro_batch` (the last may be shorter)."""
    count = -(-batch_size // micro_batch)
    cap = SUM_BITS - count.bit_length()
    scale = cap - max(ROW_BITS + (micro_batch - 1).bit_length(), CLIP_BITS)
    return Scheme(scale, cap)


def mean(sums: tf.Tensor, examples: tf.Tensor,
         fixed: Scheme | None) -> tf.Tensor:
    """A gradient sum over `examples` (float32 []) divided by them:
    float32 [n] from float32 [n] sums (fixed None) or int32 [n] ones."""
    if fixed is None:
        return sums / examples
    return fixed.mean(sums, examples)
