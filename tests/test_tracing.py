"""--trace_steps end to end: a real local cluster traces a few steps."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from trainer.observe import timeline

pytestmark = pytest.mark.cluster
STEPS = 40


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return helpers.fake_mnist(tmp_path_factory.mktemp("fake_mnist"))


def run(logdir, data, *flags):
    result = helpers.launch(logdir, data, 2, "--model=mlp",
                            "--hidden_units=32", "--batch_size=64",
                            f"--train_steps={STEPS}", "--log_every=10",
                            "--eval_every=40",
                            # Both from the first step (the chief would
                            # start alone), each with a slice every step
                            # (balanced slices may bench one that measured
                            # slow): both trace the traced steps.
                            "--min_workers=2", "--slices=equal", *flags)
    assert result.returncode == 0, result.stdout[-3000:]
    return json.loads((logdir / "results.json").read_text())


def final_parameters(logdir) -> dict:
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(logdir)))
    return {name: reader.get_tensor(name)
            for name in reader.get_variable_to_shape_map()
            if name.startswith("model/")}


def test_traced_run_writes_traces_and_a_breakdown(tmp_path, data):
    results = run(tmp_path / "traced", data, "--trace_steps=12:17")
    for k in (0, 1):
        trace = json.loads((tmp_path / "traced" /
                            f"trace_worker{k}.json").read_text())
        events = trace["traceEvents"]
        names = " ".join(str(e.get("args", {}).get("name", ""))
                         for e in events if e.get("ph") == "M")
        assert "/job:worker/replica:0/task:%d" % k in names, names
        assert "/job:ps/replica:0/task:0" in names, names
        assert any(e.get("ph") == "X" for e in events)
    breakdown = results["step_breakdown"]
    assert breakdown["steps"] == [12, 13, 14, 15, 16]
    assert set(breakdown["ms"]) == set(timeline.CATEGORIES)
    assert all(v >= 0 for v in breakdown["ms"].values())
    parts = sum(breakdown["ms"].values())
    assert abs(parts - breakdown["step_ms"]) <= 0.1 * breakdown["step_ms"]
    assert breakdown["ms"]["compute"] > 0
    # Tracing changes the speed of those steps, not what they compute.
    untraced = tmp_path / "untraced"
    run(untraced, data)
    traced, plain = final_parameters(tmp_path / "traced"), \
        final_parameters(untraced)
    assert traced.keys() == plain.keys()
    for name in traced:
        np.testing.assert_array_equal(traced[name], plain[name])
