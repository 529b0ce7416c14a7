"""The format parameters and gradients have on the ps <-> worker links.

The ps tasks keep, accumulate and apply everything in float32. On a link
whose bandwidth bounds the step (every step moves every parameter ps ->
worker and every gradient worker -> ps), the values can cross in 16 bits
instead, which halves the bytes:

- `bfloat16` (recommended): float32's 8-bit exponent, so its range (to
  3.4e38), with 8 significant bits: a relative error of at most 2^-8.
- `float16`: 11 significant bits (error at most 2^-11), but a range of
  only +-65504; values below 6e-5 lose precision and below 3e-8 become 0.
  A worker's gradient SUM can pass 65504 and cross as inf; the update and
  every later loss are then inf or NaN. Only for models whose gradient
  sums are known to be small, and never faster than bfloat16.
- `float32` (default): no cast at all; the graph is what it was before the
  wire format existed.

The ps rounds its shard to the wire dtype before sending it and turns the
gradient rows back into float32 on arrival; the worker does the opposite
(trainer/sync/transport.py). The update is the float32 mean of the
wire-rounded gradient sums, computed on wire-rounded parameters.

Fixed-point gradient sums (--deterministic, trainer/learning/fixed_point.py)
are int32 and cross as they are, float32's bytes; they do not mix with a
16-bit wire (trainer/common/config.py refuses it).

Values that must stay exact (the int64 step, the float32 statistics) ride
in the same tensors as the rounded values, their bits reinterpreted as
16-bit elements by `tf.bitcast`: concat and slice copy bits unchanged, so
they arrive exact even when a chunk happens to read as a 16-bit NaN.
"""

import tensorflow as tf

from trainer.common.config import WIRE_DTYPES
from trainer.common.errors import UserError

DTYPES = {"float32": tf.float32, "bfloat16": tf.bfloat16,
          "float16": tf.float16}
assert tuple(DTYPES) == WIRE_DTYPES


def wire_dtype(value) -> tf.DType:
    """The wire dtype named by `value` (a tf.DType or its name); raises
    UserError for anything but float32, bfloat16 or float16."""
    try:
        dtype = tf.as_dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.name not in DTYPES:
        raise UserError(f"wire dtype {value!r} is not supported; use one of "
                        f"{', '.join(DTYPES)} (bfloat16 halves the traffic "
                        f"with float32's range)")
    return dtype


def to_wire(values: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """float32 [n] -> dtype [n], rounded to nearest even; no op for float32.
    Build it on the sending device, so that the narrow tensor crosses."""
    return values if dtype == tf.float32 else tf.cast(values, dtype)


def from_wire(values: tf.Tensor) -> tf.Tensor:
    """dtype [n] -> float32 [n] (exact); no op for float32. Build it on the
    receiving device."""
    return values if values.dtype == tf.float32 else tf.cast(values,
                                                              tf.float32)


def exact_size(dtype: tf.DType, num_elements: int, wire: tf.DType) -> int:
    """Wire elements that carry the bits of `num_elements` of `dtype`."""
    return num_elements * dtype.size // wire.size


def bits_to_wire(value: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    """The bits of `value` (int64 [] or [n], float32 [n]) as a wire [m]
    vector, m = exact_size(value.dtype, elements, wire); `bits_from_wire`
    restores `value` bit for bit."""
    if value.dtype == wire:
        return value
    bits = tf.bitcast(value, wire)  # adds a last axis of size m / elements
    return bits if value.shape.rank == 0 else tf.reshape(bits, [-1])


def bits_from_wire(bits: tf.Tensor, dtype: tf.DType,
                   shape: list[int]) -> tf.Tensor:
    """Inverse of bits_to_wire: wire [m] -> `dtype` of `shape` ([] or [n])."""
    if bits.dtype == dtype:
        return bits
    if shape and dtype.size > bits.dtype.size:
        # bitcast to a wider type takes a last axis of the ratio
        bits = tf.reshape(bits, list(shape) + [dtype.size // bits.dtype.size])
    return tf.bitcast(bits, dtype)
