"""How the chief cuts a global batch: every member gets a contiguous slice
of at least one example, the slices cover the batch once, and balanced
slices follow the measured speeds."""

import numpy as np
import pytest
import tensorflow as tf

from trainer.common import config as config_lib
from trainer.common.errors import UserError
from trainer.learning import batches
from trainer.sync import slices


def graph_bounds(weight, global_batch):
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        return session.run(slices.bounds(tf.constant(weight, tf.float32),
                                         global_batch))


def graph_weights(speed, members, mode):
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        return session.run(slices.weights(
            tf.constant(speed, tf.float32),
            tf.constant(np.asarray(members, bool)), mode))


def assert_a_cover(cut, weight, global_batch):
    sizes = cut[:, 1] - cut[:, 0]
    member = np.asarray(weight) > 0
    assert sizes.sum() == global_batch
    assert (sizes[member] >= 1).all() and (sizes[~member] == 0).all()
    inside = cut[member]
    assert inside[0, 0] == 0 and inside[-1, 1] == global_batch
    np.testing.assert_array_equal(inside[1:, 0], inside[:-1, 1])


def test_equal_weights_give_the_static_shards():
    for n, batch in [(1, 64), (3, 64), (4, 128), (5, 7), (16, 16)]:
        cut = graph_bounds(np.ones(n), batch)
        assert [tuple(b) for b in cut] == batches.shard_bounds(batch, n)


def test_graph_and_numpy_agree_and_cover_the_batch():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        batch = int(rng.integers(n, 300))
        weight = rng.random(n).astype(np.float32) * 1000
        weight[rng.random(n) < 0.3] = 0
        if not (weight > 0).any():
            weight[0] = 1.0
        cut = graph_bounds(weight, batch)
        np.testing.assert_array_equal(cut, slices.bounds_np(weight, batch))
        assert_a_cover(cut, weight, batch)


def test_balanced_slices_follow_the_speeds():
    # Two hosts at half the speed of the other two: a third of the share.
    cut = graph_bounds([600.0, 600.0, 300.0, 300.0], 128)
    sizes = (cut[:, 1] - cut[:, 0]).tolist()
    assert sizes == [43, 43, 21, 21]
    # A very slow member still gets one example.
    cut = graph_bounds([1000.0, 1e-3], 64)
    assert (cut[:, 1] - cut[:, 0]).tolist() == [63, 1]


def test_weights_of_members_not_measured_yet_are_the_mean():
    weight = graph_weights([400.0, 0.0, 200.0, 50.0], [1, 1, 1, 0],
                           slices.BALANCED)
    np.testing.assert_allclose(weight, [400.0, 300.0, 200.0, 0.0])
    weight = graph_weights([0.0, 0.0], [1, 1], slices.BALANCED)
    np.testing.assert_allclose(weight, [1.0, 1.0])
    weight = graph_weights([400.0, 9.0, 0.0], [1, 1, 0], slices.EQUAL)
    np.testing.assert_allclose(weight, [1.0, 1.0, 0.0])


@pytest.mark.parametrize("value, message", [
    (0, "--min_workers=0 must be at least 1 and at most the 3"),
    (4, "--min_workers=4 must be at least 1 and at most the 3"),
])
def test_min_workers_outside_the_declared_workers_is_refused(value,
                                                             message):
    config = config_lib.TrainConfig(logdir="x", min_workers=value)
    with pytest.raises(UserError, match=message):
        config_lib.validate(config, num_workers=3)


def test_an_unknown_slicing_is_refused():
    config = config_lib.TrainConfig(logdir="x", slices="fast")
    with pytest.raises(UserError, match="--slices=fast is unknown; choose "
                       "one of balanced, equal"):
        config_lib.validate(config, num_workers=2)


def graph_prefer(base, new, weight, gain):
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        return session.run(slices.prefer(
            tf.constant(base, tf.int64), tf.constant(new, tf.int64),
            tf.constant(weight, tf.float32), gain))


def test_equal_slices_stay_until_the_speeds_predict_a_clear_gain():
    equal = slices.bounds_np([1.0, 1.0, 1.0, 0.0], 128)    # 43, 43, 42
    # Noise of ten percent in equal hosts' speeds: equal slices.
    weight = np.float32([1.1, 0.95, 1.0, 0.0])
    balanced = slices.bounds_np(weight, 128)
    assert not np.array_equal(balanced, equal)
    for cut in (graph_prefer(equal, balanced, weight, 0.2),
                slices.prefer_np(equal, balanced, weight, 0.2)):
        np.testing.assert_array_equal(cut, equal)
    # A host at half speed: balanced slices end the round far sooner.
    weight = np.float32([1.0, 0.5, 1.0, 0.0])
    balanced = slices.bounds_np(weight, 128)
    assert not np.array_equal(balanced, equal)
    for cut in (graph_prefer(equal, balanced, weight, 0.2),
                slices.prefer_np(equal, balanced, weight, 0.2)):
        np.testing.assert_array_equal(cut, balanced)


def test_at_most_keeps_the_chief_then_the_first_members():
    """Fewer micro-batches than members: the chief and the first others
    keep a slice each, the rest sit the round out; graph and NumPy agree
    on every roster of 4 and every count."""
    import itertools
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        members_in = tf.compat.v1.placeholder(tf.bool, [4])
        count_in = tf.compat.v1.placeholder(tf.int32, [])
        chief_ops = {c: slices.at_most(members_in, count_in, c)
                     for c in (0, 2)}
        for bits in itertools.product([False, True], repeat=4):
            for count, chief in itertools.product(range(1, 6), (0, 2)):
                kept = session.run(chief_ops[chief], {
                    members_in: bits, count_in: count})
                np.testing.assert_array_equal(
                    kept, slices.at_most_np(bits, count, chief))
                members = np.asarray(bits)
                assert not (kept & ~members).any()
                assert kept.sum() == min(count, members.sum())
                if members[chief]:
                    assert kept[chief]
    assert list(slices.at_most_np([1, 1, 1, 1], 2, chief=2)) == [
        True, False, True, False]
