"""How the chief cuts a global batch among the workers that are in.

Each member gets a contiguous slice of at least one example; the slices
cover the batch exactly once, in worker order. With `--slices=equal` the
sizes differ by at most one; with `--slices=balanced` they follow each
worker's measured speed (examples per second over its recent rounds)
where that predicts clearly shorter rounds (`prefer`), so that every
member needs about the same time for its slice. Which worker computes
which example does not change the average (trainer/learning/replica.py):
this is a choice of speed only, never of the result.

`bounds` is the graph version the chief runs; `bounds_np` the same
arithmetic in NumPy, for tests and docs.
"""

import numpy as np
import tensorflow as tf

BALANCED, EQUAL = "balanced", "equal"


def weights(speed: tf.Tensor, members: tf.Tensor, mode: str) -> tf.Tensor:
    """Each member's share weight (float32 [N]; 0 for non-members;
    speed: float32 [N]; members: bool [N]). A member not measured yet
    (speed 0) counts as the mean measured speed, or 1 if nobody is."""
    if mode == EQUAL:
        return tf.cast(members, tf.float32)
    measured, mean = _measured_mean(speed, members)
    fill = tf.where(tf.reduce_any(measured), mean, 1.0)
    return tf.where(members, tf.where(speed > 0, speed, fill), 0.0)


def _measured_mean(speed: tf.Tensor, members: tf.Tensor) -> tuple:
    """(the members with a speed: bool [N], their mean speed: float32 [],
    0 if none)."""
    measured = tf.logical_and(members, speed > 0)
    return measured, tf.math.divide_no_nan(
        tf.reduce_sum(tf.where(measured, speed, 0.0)),
        tf.reduce_sum(tf.cast(measured, tf.float32)))


def benched(slice_secs: tf.Tensor, speed: tf.Tensor, roster: tf.Tensor,
            factor: float, min_share: float, chief: int = 0) -> tf.Tensor:
    """bool [N]: members other than the chief that sit this round out
    (slice_secs, speed: float32 [N], 0 until measured; roster: bool [N]):

    - slow: its recent slices took over `factor` times as long as every
      other member's. Balanced slices equalize the members' times, so a
      member still far behind is bound by its fixed cost per slice
      (pulling, pushing, a starved host), not by its share: fewer
      examples cannot help, leaving it out of the round can.
    - few: its balanced share would be under `min_share` of an equal one
      (its speed under `min_share` times the members' mean). Its slices
      take no longer than the others', but its fixed cost and a starved
      host's wait for its next CPU period still hold every round it is
      in, for a few examples' gain.
    """
    secs = tf.where(roster, slice_secs, 0.0)
    top = tf.math.top_k(secs, tf.minimum(2, tf.size(secs))).values
    second = top[-1] if secs.shape[0] > 1 else tf.constant(0.0)
    others = tf.where(tf.equal(secs, top[0]), second, top[0])
    slow = tf.logical_and(secs > factor * others, others > 0)
    measured, mean = _measured_mean(speed, roster)
    few = tf.logical_and(measured, speed < min_share * mean)
    return tf.logical_and(tf.logical_or(slow, few), tf.not_equal(
        tf.range(tf.size(secs)), chief))


def at_most(members: tf.Tensor, count: int, chief: int = 0) -> tf.Tensor:
    """bool [N]: `members` (bool [N]) kept to the first `count`, the
    chief first, then in worker order; the others sit the round out."""
    index = tf.range(tf.size(members))
    is_chief = tf.logical_and(members, tf.equal(index, chief))
    others = tf.logical_and(members, tf.logical_not(is_chief))
    room = count - tf.reduce_sum(tf.cast(is_chief, tf.int32))
    kept = tf.logical_and(others, tf.cumsum(tf.cast(others, tf.int32))
                          <= room)
    return tf.logical_or(is_chief, kept)


def at_most_np(members, count: int, chief: int = 0) -> np.ndarray:
    """`at_most` in NumPy (bool [N]), for tests and docs."""
    members = np.asarray(members, bool)
    others = members & (np.arange(len(members)) != chief)
    room = count - int(members[chief])
    return (members & (np.arange(len(members)) == chief)) | (
        others & (np.cumsum(others) <= room))


def bounds(weight: tf.Tensor, global_batch: int, unit: int = 1) -> tf.Tensor:
    """[first, end) per worker (int64 [N, 2]) of a global batch cut in
    proportion to `weight` (float32 [N]; 0: not a member, empty slice),
    in whole units of `unit` rows (--micro_batch; it divides the batch).
    Each member's share is rounded down, but to at least one example; an
    excess from that is taken back one by one from the largest slices,
    and what rounding left over goes one by one to the members with the
    largest remainders (ties: the lower index)."""
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
    # Stable: equal remainders keep worker order.
    rank = tf.math.invert_permutation(tf.argsort(-remainder, stable=True))
    sizes = base + tf.cast(tf.logical_and(tf.cast(rank, tf.int64) < left,
                                          member), tf.int64)
    ends = tf.cumsum(sizes)
    return tf.stack([ends - sizes, ends], axis=1) * unit


def prefer(base: tf.Tensor, new: tf.Tensor, weight: tf.Tensor,
           gain: float) -> tf.Tensor:
    """`base` (int64 [N, 2], a cut of the same members, e.g. the equal
    one) unless the speeds `weight` (float32 [N]) predict that `base`
    takes over 1 + `gain` (1.2) times as long as `new`; then `new`.

    A slice's measured time is noisy (a host's CPU comes in bursts of a
    CFS period), so balanced slices that followed every measurement moved
    examples back and forth between equal hosts (27 to 62 of 128 among
    three), and each round waited for whichever member the noise had
    overloaded. Hosts of different speed (2:1 predicts rounds 33%
    shorter) still get balanced slices.
    """
    def finish(cut):  # predicted time of the round's slowest member
        sizes = tf.cast(cut[:, 1] - cut[:, 0], tf.float32)
        return tf.reduce_max(tf.math.divide_no_nan(sizes, weight))

    keep = finish(base) <= (1 + gain) * finish(new)
    return tf.where(keep, base, new)


def prefer_np(base, new, weight, gain: float) -> np.ndarray:
    """`prefer` in NumPy (int64 [N, 2]), for tests and docs."""
    base, new = np.asarray(base), np.asarray(new)
    weight = np.asarray(weight, np.float32)

    def finish(cut):
        sizes = (cut[:, 1] - cut[:, 0]).astype(np.float32)
        return max(s / w for s, w in zip(sizes, weight) if w > 0)

    return base if finish(base) <= (1 + gain) * finish(new) else new


def bounds_np(weight, global_batch: int, unit: int = 1) -> np.ndarray:
    """`bounds` in NumPy (int64 [N, 2]), for tests and docs."""
    weight = np.asarray(weight, np.float32)
    global_batch //= unit
    member = weight > 0
    share = weight / weight.sum() * np.float32(global_batch)
    base = np.where(member, np.maximum(np.floor(share), 1), 0).astype(
        np.int64)
    while base.sum() > global_batch:
        base[np.argmax(base)] -= 1
    left = global_batch - int(base.sum())
    remainder = np.where(member, share - base, -2.0)
    rank = np.empty(len(weight), np.int64)
    rank[np.argsort(-remainder, kind="stable")] = np.arange(len(weight))
    sizes = base + ((rank < left) & member)
    ends = np.cumsum(sizes)
    return np.stack([ends - sizes, ends], axis=1) * unit
