"""How the chief cuts a global batch among the workers that are in: a
contiguous slice of at least one example each, in worker order, covering
the batch once. Sizes are equal (to one) or, `--slices=balanced`, follow
the measured speeds where that predicts clearly shorter rounds. Who
computes which example never changes the average (learning/replica.py)."""

import numpy as np
import tensorflow as tf

BALANCED, EQUAL = "balanced", "equal"


def weights(speed: tf.Tensor, members: tf.Tensor, mode: str) -> tf.Tensor:
    """Each member's share weight (float32 [N]; 0 for non-members;
    speed: float32 [N]; members: bool [N]). A member not measured yet
    (speed 0) counts as the mean measured speed, or 1 if nobody is."""
    if mode == EQUAL:
        return tf.cast(members, tf.float32)
    measured, mean = measured_mean(speed, members)
    fill = tf.where(tf.reduce_any(measured), mean, 1.0)
    return tf.where(members, tf.where(speed > 0, speed, fill), 0.0)


def measured_mean(speed: tf.Tensor, members: tf.Tensor) -> tuple:
    """(the measured members: bool [N], their mean speed or 0: float32 [])."""
    measured = members & (speed > 0)
    return measured, tf.math.divide_no_nan(
        tf.reduce_sum(tf.where(measured, speed, 0.0)),
        tf.reduce_sum(tf.cast(measured, tf.float32)))


def at_most(members: tf.Tensor, count: int, chief: int = 0) -> tf.Tensor:
    """bool [N]: `members` (bool [N]) kept to the first `count`, the
    chief first, then in worker order; the others sit the round out."""
    is_chief = members & tf.equal(tf.range(tf.size(members)), chief)
    others = members & ~is_chief
    room = count - tf.reduce_sum(tf.cast(is_chief, tf.int32))
    return is_chief | (others & (tf.cumsum(tf.cast(others, tf.int32)) <= room))


def at_most_np(members, count: int, chief: int = 0) -> np.ndarray:
    """`at_most` in NumPy (bool [N])."""
    members = np.asarray(members, bool)
    others = members & (np.arange(len(members)) != chief)
    room = count - int(members[chief])
    return (members & (np.arange(len(members)) == chief)) | (
        others & (np.cumsum(others) <= room))


def bounds(weight: tf.Tensor, global_batch: int, unit: int = 1) -> tf.Tensor:
    """[first, end) per worker (int64 [N, 2]) of a global batch cut in
    proportion to `weight` (float32 [N]; 0: not a member, empty slice),
    in whole units of `unit` rows (--micro_batch, dividing the batch).
    Shares round down to at least one; an excess is taken one unit at a
    time from the largest slice, a lack given to the largest remainders
    (ties: the lower index)."""
    member = weight > 0
    batch = tf.cast(global_batch // unit, tf.int64)
    share = weight / tf.reduce_sum(weight) * tf.cast(batch, tf.float32)
    base = tf.where(member, tf.maximum(tf.cast(tf.floor(share), tf.int64),
                                       1), 0)
    def take_one(base):
        return [base - tf.one_hot(tf.argmax(base), tf.size(base),
                                  dtype=tf.int64)]
    (base,) = tf.while_loop(lambda base: tf.reduce_sum(base) > batch,
                            take_one, [base])
    left = batch - tf.reduce_sum(base)
    remainder = tf.where(member, share - tf.cast(base, tf.float32), -2.0)
    rank = tf.math.invert_permutation(tf.argsort(-remainder, stable=True))
    sizes = base + tf.cast((tf.cast(rank, tf.int64) < left) & member, tf.int64)
    ends = tf.cumsum(sizes)
    return tf.stack([ends - sizes, ends], axis=1) * unit


def prefer(base: tf.Tensor, new: tf.Tensor, weight: tf.Tensor,
           gain: float) -> tf.Tensor:
    """`base` (int64 [N, 2], e.g. the equal cut of the same members), or
    `new` if the speeds `weight` (float32 [N]) predict `base` takes over
    1 + `gain` times as long (why: docs/how-it-works.md, BALANCE_GAIN)."""
    def finish(cut):  # predicted time of the round's slowest member
        sizes = tf.cast(cut[:, 1] - cut[:, 0], tf.float32)
        return tf.reduce_max(tf.math.divide_no_nan(sizes, weight))
    return tf.where(finish(base) <= (1 + gain) * finish(new), base, new)


def prefer_np(base, new, weight, gain: float) -> np.ndarray:
    """`prefer` in NumPy (int64 [N, 2])."""
    base, new = np.asarray(base), np.asarray(new)
    weight = np.asarray(weight, np.float32)
    def finish(cut):
        sizes = (cut[:, 1] - cut[:, 0]).astype(np.float32)
        return max(s / w for s, w in zip(sizes, weight) if w > 0)
    return base if finish(base) <= (1 + gain) * finish(new) else new


def bounds_np(weight, global_batch: int, unit: int = 1) -> np.ndarray:
    """`bounds` in NumPy (int64 [N, 2])."""
    weight = np.asarray(weight, np.float32)
    global_batch //= unit
    member = weight > 0
    share = weight / weight.sum() * np.float32(global_batch)
    base = np.where(member, np.maximum(np.floor(share), 1), 0).astype(np.int64)
    while base.sum() > global_batch:
        base[np.argmax(base)] -= 1
    left = global_batch - int(base.sum())
    remainder = np.where(member, share - base, -2.0)
    rank = np.empty(len(weight), np.int64)
    rank[np.argsort(-remainder, kind="stable")] = np.arange(len(weight))
    sizes = base + ((rank < left) & member)
    ends = np.cumsum(sizes)
    return np.stack([ends - sizes, ends], axis=1) * unit
