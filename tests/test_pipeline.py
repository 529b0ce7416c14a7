"""The pipelined protocol (--chunk_kb, trainer/sync/pipeline.py): exact
against one worker and one ps, through the chunks and their applies on
every ps; and its bad input."""

import json

import pytest

from tests import helpers
from tests.test_cluster_runs import max_relative_difference

STEPS = 30


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory):
    return helpers.fake_mnist(tmp_path_factory.mktemp("fake_mnist"))


def _slots(logdir) -> dict:
    """Parameters and optimizer slots of the latest checkpoint."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(logdir)))
    return {name: reader.get_tensor(name)
            for name in reader.get_variable_to_shape_map()
            if name.startswith("model/")}


@pytest.mark.cluster
def test_pipelined_chunks_on_four_ps_match_one_worker(tmp_path, fake_data):
    common = ("--model=mlp", "--optimizer=adam", "--learning_rate=0.003",
              "--batch_size=64", f"--train_steps={STEPS}", "--seed=5",
              "--log_every=10", "--checkpoint_every=10")
    reference = tmp_path / "one"
    result = helpers.launch(reference, fake_data, 1, *common, num_ps=1)
    assert result.returncode == 0, result.stdout[-3000:]
    pipelined = tmp_path / "pipelined"
    result = helpers.launch(pipelined, fake_data, 4, *common, "--chunk_kb=16",
                            "--min_workers=4", "--slices=equal", num_ps=4)
    assert result.returncode == 0, result.stdout[-3000:]
    difference = max_relative_difference(_slots(reference),
                                         _slots(pipelined))
    print(f"1 worker 1 ps vs 4 workers 4 ps in 16 KiB chunks, Adam, "
          f"{STEPS} steps: parameters and slots within {difference:.3g}")
    assert difference <= 1e-4
    results = json.loads((pipelined / "results.json").read_text())
    assert results["global_step"] == STEPS
    assert results["averaged_steps"] == {str(k): STEPS for k in range(4)}


@pytest.mark.parametrize("flags, message", [
    (("--chunk_kb=2",), "--chunk_kb=2 is below 4"),
    (("--chunk_kb=-8",), "--chunk_kb=-8 is below 4"),
    (("--chunk_kb=64", "--backup_workers=1"),
     "--chunk_kb and --backup_workers do not mix"),
    (("--chunk_kb=64", "--ordered_pulls"),
     "--chunk_kb and --ordered_pulls do not mix"),
])
def test_bad_chunk_settings_are_refused(flags, message):
    from trainer.common import config as config_lib
    from trainer.common.errors import UserError
    values = {"chunk_kb": 0, "backup_workers": 0, "ordered_pulls": False}
    for flag in flags:
        name, _, value = flag[2:].partition("=")
        values[name] = int(value) if value else True
    with pytest.raises(UserError, match=message.replace("-", r"\-")):
        config_lib.validate(config_lib.TrainConfig(logdir="x", **values), 3)


def test_a_chunk_larger_than_the_model_is_one_line_and_exit_2(tmp_path,
                                                              fake_data):
    # The mlp of 128 hidden units is 398 KiB of float32.
    result = helpers.launch(tmp_path / "logs", fake_data, 2, "--model=mlp",
                            "--chunk_kb=1000", "--train_steps=5",
                            timeout=120)
    assert result.returncode == 2, result.stdout[-3000:]
    assert ("--chunk_kb=1000 is more than the whole mlp model (398 KiB of "
            "float32); use 4 to 397, or 0 to send whole shards"
            in result.stdout)
    assert "Traceback" not in result.stdout


def test_the_chunks_are_spread_over_the_ps_tasks_in_model_order():
    from trainer.common.config import TrainConfig
    from trainer.sync import pipeline
    config = TrainConfig(logdir="x", model="mlp", chunk_kb=64)
    shards = pipeline.layout(config, num_ps=4)
    # 398 KiB in chunks of at most 64 KiB: 7, rounded up to 8 for 4 ps.
    assert len(shards) == 8
    sizes = [sum(p.size for p in shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) * 4 <= 64 * 1024
    assert shards[0][0].name == "model/hidden/kernel"
    assert shards[0][0].start == 0
    assert len(pipeline.layout(TrainConfig(logdir="x", model="mlp"), 4)) == 4


def test_either_picks_one_exactly_whichever_is_empty():
    import numpy as np
    import tensorflow as tf
    from trainer.roles.pipelined_step import _either
    carried = tf.constant([1.5, -0.0, 3e-38])
    fresh = tf.constant([7.0, 8.0, 9.0])
    empty = tf.zeros([0])
    picked = [_either(tf.constant(True), carried, empty),
              _either(tf.constant(False), carried, fresh)]
    assert all(p.shape == [3] for p in picked)  # known, for the loop
    first, second = [p.numpy() for p in picked]
    assert first.tobytes() == carried.numpy().tobytes()  # -0.0 kept too
    np.testing.assert_array_equal(second, fresh.numpy())
