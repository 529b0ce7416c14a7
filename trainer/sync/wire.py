"""The format of parameters and gradients on the ps <-> worker links
(--wire_dtype); the ps tasks keep, sum and apply float32. `bfloat16` has
float32's range and 8 significant bits; `float16` 11 bits but a range of
+-65504 (below 6e-5 it loses precision, below 3e-8 it is 0), so a
worker's gradient SUM can cross as inf (then every later loss is inf or
NaN); it is never faster than bfloat16. Fixed-point (int32) sums cross as
they are. The int64 token and float32 stats ride in the same tensors
(`tf.bitcast`): concat and slice copy bits, so they arrive exact even
where a chunk reads as a 16-bit NaN."""

import tensorflow as tf

from trainer.common.config import WIRE_DTYPES
from trainer.common.errors import UserError

DTYPES = {"float32": tf.float32, "bfloat16": tf.bfloat16,
          "float16": tf.float16}
assert tuple(DTYPES) == WIRE_DTYPES


def wire_dtype(value) -> tf.DType:
    """The DTYPES dtype `value` (a tf.DType or a name) names, or UserError."""
    try:
        if (dtype := tf.as_dtype(value)).name in DTYPES:
            return dtype
    except (TypeError, ValueError):
        pass
    raise UserError(f"wire dtype {value!r} is not supported; use one of "
                    f"{', '.join(DTYPES)} (bfloat16 halves the traffic "
                    f"with float32's range)")


def exact_size(dtype: tf.DType, num_elements: int, wire: tf.DType) -> int:
    """Wire elements that carry the bits of `num_elements` of `dtype`."""
    return num_elements * dtype.size // wire.size


def bits_to_wire(value: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    """The bits of `value` (int64 [] or [n], float32 [n]) as a wire [m]
    vector, m = exact_size(value.dtype, elements, wire)."""
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
