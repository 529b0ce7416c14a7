"""Flat per-shard parameters: byte balance, the getter, and checkpoints."""

import numpy as np
import pytest
import tensorflow as tf

from trainer.learning import model
from trainer.learning import params


def specs_of(name):
    return params.record(lambda: model.build(name, tf.zeros([1, 28, 28, 1])))


def cnn_specs():
    return specs_of("cnn")


def test_record_lists_variables_in_model_order():
    specs = cnn_specs()
    assert [s.name for s in specs] == [
        "model/conv1/kernel", "model/conv1/bias", "model/conv2/kernel",
        "model/conv2/bias", "model/logits/kernel", "model/logits/bias"]
    assert sum(s.size for s in specs) == 34826


@pytest.mark.parametrize("name", ["softmax", "mlp", "cnn"])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_shards_are_contiguous_ranges_of_the_model_in_order(name,
                                                            num_shards):
    specs = specs_of(name)
    layout = params.plan_shards(specs, num_shards)
    sizes = [sum(p.size for p in shard) for shard in layout]
    assert max(sizes) - min(sizes) <= 1
    # Walking the shards in order walks every parameter from its first
    # float to its last, in model order, with nothing skipped or repeated.
    walked = [(p.name, p.start, p.stop) for shard in layout for p in shard]
    expected, i = [], 0
    for spec in specs:
        start = 0
        while i < len(walked) and walked[i][0] == spec.name:
            assert walked[i][1] == start
            start = walked[i][2]
            expected.append(walked[i])
            i += 1
        assert start == spec.size, spec.name
    assert walked == expected


def test_mlp_over_two_ps_tasks_halves_the_busiest_ps_bytes():
    specs = specs_of("mlp")
    total = sum(s.size for s in specs)
    flat = params.FlatLayout(params.plan_shards(specs, 2))
    assert flat.sizes == [50885, 50885]
    # Whole variables would leave 98.6% (the 784x128 kernel) on one ps.
    assert max(flat.sizes) <= total / 2 + 1
    assert [[p.name for p in shard] for shard in flat.shards] == [
        ["model/hidden/kernel"],
        ["model/hidden/kernel", "model/hidden/bias", "model/logits/kernel",
         "model/logits/bias"]]
    assert flat.ps_indices == [0, 1]


def test_more_shards_than_floats_leaves_the_last_ones_empty():
    tiny = [params.ParamSpec("model/a", (2,), tf.compat.v1.ones_initializer())]
    layout = params.plan_shards(tiny, 3)
    assert [len(shard) for shard in layout] == [1, 1, 0]
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        flat = params.FlatParams(layout)
        assert flat.ps_indices == [0, 1]
        assert flat.sizes == [1, 1]
        assert [v.op.name for v in flat.variables] == [
            "params/shard_0", "params/shard_1"]
        session.run(tf.compat.v1.global_variables_initializer())
        a = flat.unflatten([v.read_value() for v in flat.variables])
        np.testing.assert_array_equal(session.run(a["model/a"]), [1, 1])


def random_values(specs, seed):
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32)
            for s in specs}


def test_straddling_parameters_reassemble_exactly():
    specs = specs_of("mlp")
    values = random_values(specs, 1)
    flat = params.FlatLayout(params.plan_shards(specs, 3))
    # The 784x128 kernel lies on all three shards.
    assert [p.name for shard in flat.shards for p in shard].count(
        "model/hidden/kernel") == 3
    shard_values = flat.pack(values)
    assert [len(v) for v in shard_values] == flat.sizes
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        out = session.run(flat.unflatten(
            [tf.constant(v) for v in shard_values]))
    assert sorted(out) == sorted(values)
    for name, value in values.items():
        np.testing.assert_array_equal(out[name], value)


def build_and_init(layout, images, name="cnn"):
    """FlatParams of `layout` and the model on them; returns (flat, logits
    [n, 10], the shard values [n_i] the model reads)."""
    flat = params.FlatParams(layout)
    values = [v.read_value() for v in flat.variables]
    with tf.compat.v1.variable_scope(params.SCOPE,
                                     custom_getter=flat.getter(values)):
        logits = model.build(name, images)
    return flat, logits, values


def test_flat_layout_computes_what_separate_variables_compute():
    rng = np.random.default_rng(0)
    images = rng.random((4, 28, 28, 1), dtype=np.float32)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        reference = model.build("cnn", tf.constant(images))
        session.run(tf.compat.v1.global_variables_initializer())
        expected = session.run(reference)
    for num_shards in (2, 3):       # conv2/kernel, logits/kernel straddle
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            _, logits, _ = build_and_init(
                params.plan_shards(cnn_specs(), num_shards),
                tf.constant(images))
            session.run(tf.compat.v1.global_variables_initializer())
            np.testing.assert_allclose(session.run(logits), expected,
                                       rtol=1e-5, atol=1e-6)


def initial_concat(name, num_shards):
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        flat = params.FlatParams(params.plan_shards(specs_of(name),
                                                    num_shards))
        session.run(tf.compat.v1.global_variables_initializer())
        from_variables = np.concatenate(session.run(flat.variables))
        from_layout = np.concatenate(session.run(
            [flat.initial_value(i) for i in range(len(flat.shards))]))
    np.testing.assert_array_equal(from_variables, from_layout)
    return from_variables


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_initial_values_are_identical_across_shard_counts(name):
    one = initial_concat(name, 1)
    assert np.count_nonzero(one) > len(one) // 2   # kernels are random
    for num_shards in (2, 3):
        assert initial_concat(name, num_shards).tobytes() == one.tobytes()


def shard_gradients(num_shards, images, labels):
    """d loss / d shard value (float32 [n_i]) for each shard, for the mlp
    at its initial parameters."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        _, logits, values = build_and_init(
            params.plan_shards(specs_of("mlp"), num_shards),
            tf.constant(images), "mlp")
        loss = tf.reduce_sum(model.per_example_loss(logits,
                                                    tf.constant(labels)))
        grads = tf.gradients(loss, values)
        session.run(tf.compat.v1.global_variables_initializer())
        return session.run(grads)


def test_gradient_per_shard_is_its_slice_of_the_single_shard_gradient():
    rng = np.random.default_rng(2)
    images = rng.random((8, 28, 28, 1), dtype=np.float32)
    labels = rng.integers(0, 10, 8).astype(np.int32)
    (whole,) = shard_gradients(1, images, labels)
    assert np.count_nonzero(whole) > 1000
    for num_shards in (2, 3):
        grads = shard_gradients(num_shards, images, labels)
        flat = params.FlatLayout(params.plan_shards(specs_of("mlp"),
                                                    num_shards))
        assert [len(g) for g in grads] == flat.sizes
        bounds = np.cumsum([0] + flat.sizes)
        # Same ops on the same values: the pieces' gradients are slices of
        # the whole one, bit for bit.
        for i, grad in enumerate(grads):
            np.testing.assert_array_equal(grad,
                                          whole[bounds[i]:bounds[i + 1]])


def flat_with_adam(layout):
    """FlatParams of `layout` with Adam's slots, and a Saver of both."""
    flat = params.FlatParams(layout)
    optimizer = tf.compat.v1.train.AdamOptimizer()
    optimizer.apply_gradients([(tf.ones_like(v), v) for v in flat.variables])
    slots = {name: (lambda v, name=name: optimizer.get_slot(v, name))
             for name in optimizer.get_slot_names()}
    saver = tf.compat.v1.train.Saver(flat.saveables(slots))
    every = {"": flat.variables}
    every.update({f"/{name}": [slot(v) for v in flat.variables]
                  for name, slot in slots.items()})
    return flat, saver, every


def read_entries(session, flat, every):
    """Checkpoint key -> value of the parameters and their slots."""
    out = {}
    for suffix, variables in every.items():
        values = session.run(flat.unflatten(
            [v.read_value() for v in variables]))
        out.update({name + suffix: value for name, value in values.items()})
    return out


def save_values(layout, values, path):
    """Writes a checkpoint of `layout` holding `values` (key -> array)."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        flat, saver, every = flat_with_adam(layout)
        session.run(tf.compat.v1.global_variables_initializer())
        for suffix, variables in every.items():
            packed = flat.pack({s.name: values[s.name + suffix]
                                for s in flat.specs})
            session.run([v.assign(p) for v, p in zip(variables, packed)])
        assert read_entries(session, flat, every).keys() == values.keys()
        return saver.save(session, str(path))


def restore_values(layout, path):
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        flat, saver, every = flat_with_adam(layout)
        saver.restore(session, path)
        return read_entries(session, flat, every)


def checkpoint_values(specs, seed):
    """Distinct random values for every parameter and Adam slot entry."""
    values = {}
    for i, suffix in enumerate(["", "/m", "/v"]):
        values.update({name + suffix: value for name, value in
                       random_values(specs, seed * 10 + i).items()})
    return values


@pytest.mark.parametrize("saved_on,restored_on", [(1, 3), (3, 2)])
def test_checkpoint_uses_parameter_names_and_fits_other_shard_counts(
        tmp_path, saved_on, restored_on):
    specs = cnn_specs()
    values = checkpoint_values(specs, saved_on)
    path = save_values(params.plan_shards(specs, saved_on), values,
                       tmp_path / "ckpt")
    reader = tf.train.load_checkpoint(path)
    shapes = reader.get_variable_to_shape_map()
    layout = params.FlatLayout(params.plan_shards(specs, restored_on))
    assert shapes == layout.expected_checkpoint_shapes(["m", "v"])
    assert shapes["model/conv2/kernel/m"] == [3, 3, 32, 64]
    # conv2/kernel straddles shards: still one entry, whole.
    np.testing.assert_array_equal(reader.get_tensor("model/conv2/kernel"),
                                  values["model/conv2/kernel"])
    restored = restore_values(params.plan_shards(specs, restored_on), path)
    assert sorted(restored) == sorted(values)
    for name, value in values.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_checkpoints_of_whole_variable_layouts_are_the_same_entries(
        tmp_path):
    """Earlier versions kept whole variables per shard (conv2/kernel on
    one, the rest on the other); their checkpoints and ours must be
    interchangeable."""
    specs = cnn_specs()
    by_name = {s.name: s for s in specs}
    whole = [[by_name["model/conv2/kernel"]],
             [s for s in specs if s.name != "model/conv2/kernel"]]
    values = checkpoint_values(specs, 7)
    old = save_values(whole, values, tmp_path / "old")
    new = save_values(params.plan_shards(specs, 2), values, tmp_path / "new")
    old_reader, new_reader = (tf.train.load_checkpoint(p) for p in (old, new))
    assert (old_reader.get_variable_to_shape_map()
            == new_reader.get_variable_to_shape_map())
    for name in values:
        assert (old_reader.get_tensor(name).tobytes()
                == new_reader.get_tensor(name).tobytes())
    for layout, path in ((params.plan_shards(specs, 2), old), (whole, new)):
        restored = restore_values(layout, path)
        for name, value in values.items():
            np.testing.assert_array_equal(restored[name], value, err_msg=name)
