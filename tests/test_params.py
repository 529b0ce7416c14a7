"""Flat per-shard parameters: balance, the getter, and checkpoints."""

import numpy as np
import tensorflow as tf

from trainer import model, params


def cnn_specs():
    return params.record(lambda: model.build("cnn", tf.zeros([1, 28, 28, 1])))


def test_record_lists_variables_in_model_order():
    specs = cnn_specs()
    assert [s.name for s in specs] == [
        "model/conv1/kernel", "model/conv1/bias", "model/conv2/kernel",
        "model/conv2/bias", "model/logits/kernel", "model/logits/bias"]
    assert sum(s.size for s in specs) == 34826


def test_plan_balances_bytes_over_shards():
    specs = cnn_specs()
    layout = params.plan_shards(specs, 2)
    loads = [sum(s.size for s in shard) for shard in layout]
    # conv2 kernel (18,432) alone on one shard, the rest (16,394) on the other.
    assert sorted(loads) == [16394, 18432]
    assert sorted(s.name for shard in layout for s in shard) == sorted(
        s.name for s in specs)
    one = params.plan_shards(specs, 1)
    assert [s.name for s in one[0]] == [s.name for s in specs]


def test_more_shards_than_parameters_leaves_some_empty():
    specs = params.record(lambda: model.build("softmax",
                                              tf.zeros([1, 28, 28, 1])))
    layout = params.plan_shards(specs, 3)
    assert [len(shard) for shard in layout] == [1, 1, 0]
    with tf.Graph().as_default():
        flat = params.FlatParams(layout)
        assert flat.ps_indices == [0, 1]
        assert flat.sizes == [7840, 10]


def build_and_init(layout, images):
    flat = params.FlatParams(layout)
    values = [v.read_value() for v in flat.variables]
    with tf.compat.v1.variable_scope(params.SCOPE,
                                     custom_getter=flat.getter(values)):
        logits = model.build("cnn", images)
    return flat, logits


def test_flat_layout_computes_what_separate_variables_compute():
    rng = np.random.default_rng(0)
    images = rng.random((4, 28, 28, 1), dtype=np.float32)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        reference = model.build("cnn", tf.constant(images))
        session.run(tf.compat.v1.global_variables_initializer())
        expected = session.run(reference)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        flat, logits = build_and_init(params.plan_shards(cnn_specs(), 2),
                                      tf.constant(images))
        session.run(tf.compat.v1.global_variables_initializer())
        np.testing.assert_allclose(session.run(logits), expected, rtol=1e-5,
                                   atol=1e-6)


def test_checkpoint_uses_parameter_names_and_fits_other_shard_counts(
        tmp_path):
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        flat, _ = build_and_init(params.plan_shards(cnn_specs(), 1),
                                 tf.zeros([2, 28, 28, 1]))
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(flat.variables[0].assign(
            tf.range(34826, dtype=tf.float32)))
        saved = session.run(flat.unflatten(
            [v.read_value() for v in flat.variables]))
        path = tf.compat.v1.train.Saver(flat.saveables()).save(
            session, str(tmp_path / "ckpt"))
    shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    assert shapes == flat.expected_checkpoint_shapes()
    assert shapes["model/conv2/kernel"] == [3, 3, 32, 64]
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        flat3, _ = build_and_init(params.plan_shards(cnn_specs(), 3),
                                  tf.zeros([2, 28, 28, 1]))
        tf.compat.v1.train.Saver(flat3.saveables()).restore(session, path)
        restored = session.run(flat3.unflatten(
            [v.read_value() for v in flat3.variables]))
    assert set(restored) == set(saved)
    for name in saved:
        np.testing.assert_array_equal(restored[name], saved[name])
