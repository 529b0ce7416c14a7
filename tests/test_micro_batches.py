"""--micro_batch: slices in whole micro-batches, and a slice's gradient
computed m rows at a time equal to the one computed at once (up to float
rounding), each micro-batch's part whatever slice holds it."""

import numpy as np
import tensorflow as tf

from trainer.common.config import TrainConfig
from trainer.learning import batches
from trainer.learning import fixed_point
from trainer.learning import params as params_lib
from trainer.learning import replica
from trainer.sync import slices

BATCH = 32


def test_slices_are_whole_micro_batches_covering_the_batch():
    for weight in ([1, 2, 3], [1, 0, 5, 1], [3, 3]):
        cut = slices.bounds_np(weight, 128, unit=16)
        assert (cut % 16 == 0).all()
        assert cut[0, 0] == 0 and cut[-1, 1] == 128
        assert (cut[1:, 0] == cut[:-1, 1]).all()
        members = np.asarray(weight) > 0
        assert ((cut[:, 1] > cut[:, 0]) == members).all()


def _gradients(micro_batch: int, cuts: list,
               deterministic: bool = False) -> list[np.ndarray]:
    """Each slice's (shard) gradient sum for global step 3 of a random
    set of 64 examples: float32 [n] per slice (int32 [n] in fixed point
    if deterministic)."""
    config = TrainConfig(logdir="x", model="mlp", hidden_units=16,
                         batch_size=BATCH, seed=5, micro_batch=micro_batch,
                         deterministic=deterministic)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, [64, 28, 28], dtype=np.uint8)
    labels = rng.integers(0, 10, [64]).astype(np.int64)
    with tf.Graph().as_default():
        layout = params_lib.FlatParams(params_lib.plan_shards(
            replica.model_specs(config), 1))
        trainset = batches.InGraphTrainSet(64, config.seed, BATCH,
                                           (0, BATCH))
        values = [v.read_value() for v in layout.variables]
        step = tf.constant(3, tf.int64)
        grads = [replica.compute_gradients(
            config, layout, trainset, step,
            tf.constant(cut, tf.int64), values).shard_grads[0]
                 for cut in cuts]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            trainset.initialize(session, images, labels)
            # One slice per run, as in a worker: slices computed at once
            # would race on the trainset's cached epoch order.
            return [session.run(g) for g in grads]


def test_micro_batches_sum_to_the_slice_at_once():
    at_once, = _gradients(0, [[0, BATCH]])
    by_eight, = _gradients(8, [[0, BATCH]])
    np.testing.assert_allclose(by_eight, at_once, rtol=1e-5, atol=1e-6)


def test_a_micro_batch_gradient_does_not_depend_on_its_slice():
    # Rows 8..15 alone, and as the second micro-batch of a slice: the
    # difference of two slice sums that share all but it is its gradient.
    alone, first_two, first_one = _gradients(8, [[8, 16], [0, 16], [0, 8]])
    np.testing.assert_allclose(first_two - first_one, alone, rtol=1e-5,
                               atol=1e-6)


def test_fixed_point_slices_sum_to_the_batch_bit_for_bit():
    # --deterministic: however the batch is cut, the slices' integer sums
    # add up to the whole batch's, exactly, in any order.
    cuts = [[0, BATCH], [0, 8], [8, 24], [24, BATCH], [0, 16], [16, BATCH]]
    whole, a, b, c, d, e = _gradients(0, cuts, deterministic=True)
    assert whole.dtype == np.int32 and np.abs(whole).max() > 2 ** 16
    np.testing.assert_array_equal(c + b + a, whole)
    np.testing.assert_array_equal(e + d, whole)


def test_deterministic_mean_is_the_float_mean_up_to_rounding():
    fixed, = _gradients(0, [[0, BATCH]], deterministic=True)
    plain, = _gradients(8, [[0, BATCH]])
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        mean = session.run(fixed_point.mean(
            tf.constant(fixed), tf.constant(float(BATCH)),
            fixed_point.scheme(BATCH, TrainConfig("x", batch_size=BATCH)
                               .micro_batch_rows())))
    # The fixed point's resolution on the mean: 2^-scale_bits / BATCH.
    np.testing.assert_allclose(mean, plain / BATCH, rtol=1e-4, atol=1e-6)
