"""The pipelined protocol (--chunk_kb, trainer/sync/pipeline.py): exact
against one worker and one ps, through the chunks and their applies on
every ps; and its bad input."""

import json
import subprocess
import sys

import pytest

from tests import helpers
from tests.test_cluster_runs import final_parameters, max_relative_difference

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
