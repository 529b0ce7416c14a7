"""The exported SavedModel: what a fresh process that knows nothing of
this package gets from it, and how exports fail and replace each other."""

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from trainer.learning import data as data_lib
from trainer.saving import export
from trainer.learning import model
from trainer.learning import params
from trainer.common.errors import UserError

# Run by a fresh interpreter: loads each export with plain TensorFlow,
# classifies the saved images and reports the signature it found.
CLASSIFY = """
import json, sys
import numpy as np
import tensorflow as tf
report = []
for export_dir, images_path, out_path in json.loads(sys.argv[1]):
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    out = serve(images=tf.constant(np.load(images_path)))
    np.savez(out_path, **{k: v.numpy() for k, v in out.items()})
    specs = {**serve.structured_input_signature[1],
             **serve.structured_outputs}
    report.append({k: [v.dtype.name, v.shape.as_list()]
                   for k, v in specs.items()})
print(json.dumps({"signatures": report,
                  "trainer_imported": "trainer" in sys.modules}))
"""

# Run by a fresh interpreter: MNIST's test set read with its own code,
# classified by the export; prints the accuracy.
ACCURACY = """
import gzip, json, os, sys
import numpy as np
import tensorflow as tf

def read_idx(path):
    with gzip.open(path) as f:
        raw = f.read()
    dims = raw[3]
    shape = np.frombuffer(raw, ">u4", dims, offset=4)
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)

folder = os.environ.get("MNIST_DATA_DIR") or "/work/shared/mnist"
images = read_idx(os.path.join(folder, "t10k-images-idx3-ubyte.gz"))
labels = read_idx(os.path.join(folder, "t10k-labels-idx1-ubyte.gz"))
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
classes = np.concatenate([
    serve(images=tf.constant(images[i:i + 2000] / 255.0, tf.float32))
    ["classes"].numpy() for i in range(0, len(images), 2000)])
print(json.dumps({"accuracy": float(np.mean(classes == labels)),
                  "count": len(labels),
                  "trainer_imported": "trainer" in sys.modules}))
"""


def run_fresh(script: str, *args: str, env: dict | None = None) -> dict:
    """Runs `script` in a new interpreter outside the repository; returns
    the JSON object it prints last."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True,
        text=True, timeout=120, cwd="/", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report.pop("trainer_imported") is False
    return report


def random_values(name: str, hidden_units: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 0.1, shape).astype(np.float32)
            for n, shape in export.parameter_shapes(name, hidden_units)
            .items()}


def reference_logits(model_name: str, hidden_units: int, values: dict,
                     images: np.ndarray) -> np.ndarray:
    """model.build on images [n, 28, 28] with `values` as its parameters:
    logits [n, 10]."""
    def constant_getter(getter, name, *args, **kwargs):
        del getter, args, kwargs
        return tf.constant(values[name])

    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        with tf.compat.v1.variable_scope(params.SCOPE,
                                         custom_getter=constant_getter):
            logits = model.build(model_name, tf.constant(images[..., None]),
                                 hidden_units=hidden_units)
        return session.run(logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def test_fresh_process_classifies_like_the_model(tmp_path):
    images = np.random.default_rng(1).random((16, 28, 28), np.float32)
    np.save(tmp_path / "images.npy", images)
    cases = {"mlp": (32, random_values("mlp", 32, 2)),
             "cnn": (128, random_values("cnn", 128, 3))}
    jobs = []
    for name, (hidden, values) in cases.items():
        # The cnn is exported the way the chief calls it: from inside a
        # graph of its own, where eager execution is off.
        in_graph = tf.Graph().as_default() if name == "cnn" else (
            contextlib.nullcontext())
        with in_graph:
            assert tf.executing_eagerly() == (name != "cnn")
            path = export.export_saved_model(str(tmp_path / name / "export"),
                                             name, hidden, values)
        jobs.append([path, str(tmp_path / "images.npy"),
                     str(tmp_path / f"{name}.npz")])
    report = run_fresh(CLASSIFY, json.dumps(jobs))
    for (name, (hidden, values)), signature in zip(cases.items(),
                                                   report["signatures"]):
        assert signature == {"images": ["float32", [None, 28, 28]],
                             "probabilities": ["float32", [None, 10]],
                             "classes": ["int64", [None]]}
        out = np.load(tmp_path / f"{name}.npz")
        expected = softmax(reference_logits(name, hidden, values, images))
        assert out["probabilities"].dtype == np.float32
        np.testing.assert_allclose(out["probabilities"], expected, atol=1e-5)
        np.testing.assert_array_equal(out["classes"],
                                      expected.argmax(axis=1))
        # Random weights still have to spread the images over classes, or
        # equal classes would prove little.
        assert len(set(out["classes"])) > 1


def train_softmax(images: np.ndarray, labels: np.ndarray) -> dict:
    """300 steps of minibatch SGD on images [n, 784] in [0, 1]."""
    rng = np.random.default_rng(0)
    kernel = np.zeros((784, 10), np.float32)
    bias = np.zeros(10, np.float32)
    for _ in range(300):
        batch = rng.integers(0, len(images), 128)
        x, y = images[batch], labels[batch]
        p = softmax(x @ kernel + bias)
        p[np.arange(len(y)), y] -= 1.0           # d loss / d logits
        kernel -= 0.5 * x.T @ p / len(y)
        bias -= 0.5 * p.mean(axis=0)
    return {"model/dense/kernel": kernel, "model/dense/bias": bias}


def test_exported_accuracy_on_the_real_test_set(tmp_path):
    folder = helpers.real_mnist_dir()
    if folder is None:
        pytest.skip("real MNIST not found in $MNIST_DATA_DIR or "
                    "../shared/mnist")
    mnist = data_lib.load(folder, allow_download=False)
    train = mnist.train_images.reshape(-1, 784).astype(np.float32) / 255.0
    values = train_softmax(train, mnist.train_labels.astype(np.int64))
    test = mnist.test_images.astype(np.float32) / 255.0
    logits = reference_logits("softmax", 128, values, test)
    expected = float(np.mean(logits.argmax(axis=1) == mnist.test_labels))
    assert expected > 0.85    # it learned: the comparison means something
    path = export.export_saved_model(str(tmp_path / "export"), "softmax",
                                     128, values)
    accuracy = accuracy_in_fresh_process(pathlib.Path(path))
    # 0.01 points is one image of 10,000 (plus float slack).
    assert abs(accuracy - expected) * 100 <= 0.01 + 1e-9, (accuracy,
                                                           expected)


def write_trainer_checkpoint(prefix: pathlib.Path, values: dict) -> str:
    """A checkpoint as the trainer writes it: per-parameter entries from
    flat shard variables, Adam's slots and the global step."""
    specs = params.record(lambda: model.build("softmax",
                                              tf.zeros([1, 28, 28, 1])))
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        flat = params.FlatParams(params.plan_shards(specs, 2))
        step = tf.compat.v1.train.get_or_create_global_step()
        optimizer = tf.compat.v1.train.AdamOptimizer()
        optimizer.apply_gradients([(tf.ones_like(v), v)
                                   for v in flat.variables])
        slots = {name: (lambda v, name=name: optimizer.get_slot(v, name))
                 for name in optimizer.get_slot_names()}
        session.run(tf.compat.v1.global_variables_initializer())
        session.run([variable.assign(vector) for variable, vector in
                     zip(flat.variables, flat.pack(values))])
        saver = tf.compat.v1.train.Saver(flat.saveables(slots) + [step])
        return saver.save(session, str(prefix), global_step=7)


def test_values_from_a_trainer_checkpoint(tmp_path):
    values = random_values("softmax", 128, 4)
    path = write_trainer_checkpoint(tmp_path / "model.ckpt", values)
    entries = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    assert "model/dense/kernel/m" in entries and "global_step" in entries
    for where in (path, str(tmp_path)):     # a prefix, or the newest in a dir
        read = export.values_from_checkpoint(where, "softmax", 128)
        assert sorted(read) == sorted(values)
        for name, value in values.items():
            np.testing.assert_array_equal(read[name], value)
    with pytest.raises(UserError, match="no value for parameter "
                       "'model/hidden/kernel'"):
        export.values_from_checkpoint(path, "mlp", 128)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no checkpoint in .*empty; give"):
        export.values_from_checkpoint(str(tmp_path / "empty"), "mlp", 128)
    with pytest.raises(UserError, match="cannot read checkpoint .*missing"):
        export.values_from_checkpoint(str(tmp_path / "missing"), "mlp", 128)


@pytest.mark.parametrize("change, message", [
    (lambda v: v.pop("model/logits/bias"),
     "no value for parameter 'model/logits/bias' \\[10\\]"),
    (lambda v: v.update({"model/hidden/kernel": np.zeros((784, 64))}),
     "'model/hidden/kernel' is \\[784, 64\\] but --model=mlp "
     "--hidden_units=32 needs \\[784, 32\\]"),
    (lambda v: v.update({"model/conv1/kernel": np.zeros((3, 3, 1, 32))}),
     "'model/conv1/kernel' is not a parameter of --model=mlp"),
])
def test_values_that_do_not_fit_are_refused(tmp_path, change, message):
    values = random_values("mlp", 32, 5)
    change(values)
    with pytest.raises(UserError, match=message):
        export.export_saved_model(str(tmp_path / "export"), "mlp", 32, values)
    assert os.listdir(tmp_path) == []


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(UserError, match="unknown model 'resnet'"):
        export.export_saved_model(str(tmp_path / "export"), "resnet", 128, {})


def loaded_parameter_names(path: str) -> list[str]:
    return sorted(v.name for v in tf.saved_model.load(path).variables)


def test_new_export_replaces_the_old_one_whole(tmp_path, monkeypatch):
    target = tmp_path / "export"
    export.export_saved_model(str(target), "mlp", 32,
                              random_values("mlp", 32, 6))
    (target / "stale.txt").write_text("from the old export")
    export.export_saved_model(str(target), "softmax", 128,
                              random_values("softmax", 128, 7))
    assert not (target / "stale.txt").exists()
    assert os.listdir(tmp_path) == ["export"]     # no staging folders left
    softmax_names = ["model/dense/bias:0", "model/dense/kernel:0"]
    assert loaded_parameter_names(str(target)) == softmax_names

    def crash(directory, *args):
        del args
        pathlib.Path(directory, "saved_model.pb").write_text("half")
        raise OSError("disk full")

    # A failed export leaves the previous one in place, untouched.
    monkeypatch.setattr(export, "_build_and_save", crash)
    with pytest.raises(OSError, match="disk full"):
        export.export_saved_model(str(target), "mlp", 32,
                                  random_values("mlp", 32, 8))
    assert os.listdir(tmp_path) == ["export"]
    assert loaded_parameter_names(str(target)) == softmax_names


def serving_versions(base: pathlib.Path) -> list[int]:
    """The versions TensorFlow Serving would see under model base path
    `base`, each checked to be a SavedModel folder: numeric subfolders
    (others are ignored) with saved_model.pb and variables/ (its index
    and data shards)."""
    found = sorted(int(p.name) for p in base.iterdir() if p.name.isdigit())
    for version in found:
        folder = base / str(version)
        assert (folder / "saved_model.pb").is_file()
        assert (folder / "variables" / "variables.index").is_file()
        assert list((folder / "variables").glob("variables.data-*"))
    return found


def test_versions_in_the_layout_tf_serving_loads(tmp_path):
    """export/<step>/ per run end; the newest `keep` versions stay; the
    highest is the newest and loads; other names are left alone."""
    base = tmp_path / "export"
    base.mkdir()
    (base / "notes").mkdir()              # not a version: ignored, kept
    for step in (100, 1000, 200, 300):
        export.export_version(str(base), step, "mlp", 32,
                              random_values("mlp", 32, step), keep=3)
    assert serving_versions(base) == [200, 300, 1000]
    assert (base / "notes").is_dir()
    assert not [p for p in os.listdir(base) if p.startswith(".")]
    newest = export.newest_version(str(base))
    assert newest == str(base / "1000")
    assert loaded_parameter_names(newest) == sorted(
        f"{n}:0" for n in export.parameter_shapes("mlp", 32))
    # The same version again (a rerun that only evaluated) is replaced.
    export.export_version(str(base), 1000, "mlp", 32,
                          random_values("mlp", 32, 9), keep=3)
    assert serving_versions(base) == [200, 300, 1000]
    with pytest.raises(UserError, match="no exported version"):
        export.newest_version(str(tmp_path / "none"))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """A short softmax run of the real trainer (1 ps, 1 worker); its logdir
    and results. The chief exports the model into <logdir>/export."""
    folder = helpers.real_mnist_dir()
    if folder is None:
        pytest.skip("real MNIST not found in $MNIST_DATA_DIR or "
                    "../shared/mnist")
    logdir = tmp_path_factory.mktemp("export_run") / "run"
    result = helpers.launch(logdir, folder, 1, "--model=softmax",
                            "--train_steps=200", "--batch_size=64",
                            timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    return logdir, json.loads((logdir / "results.json").read_text())


def accuracy_in_fresh_process(export_dir: pathlib.Path) -> float:
    report = run_fresh(ACCURACY, str(export_dir), env={
        **os.environ, "MNIST_DATA_DIR": str(helpers.real_mnist_dir())})
    assert report["count"] == 10000
    return report["accuracy"]


def test_export_of_a_run_checkpoint_matches_its_results(tmp_path, real_run):
    logdir, results = real_run
    values = export.values_from_checkpoint(str(logdir), "softmax", 128)
    path = export.export_saved_model(str(tmp_path / "export"), "softmax",
                                     128, values)
    accuracy = accuracy_in_fresh_process(pathlib.Path(path))
    assert accuracy > 0.8
    assert abs(accuracy - results["final_test_accuracy"]) * 100 <= (
        0.01 + 1e-9), (accuracy, results["final_test_accuracy"])


def test_chief_export_matches_results(real_run):
    logdir, results = real_run
    assert export.versions(str(logdir / "export")) == [results["global_step"]]
    accuracy = accuracy_in_fresh_process(
        pathlib.Path(export.newest_version(str(logdir / "export"))))
    assert abs(accuracy - results["final_test_accuracy"]) * 100 <= (
        0.01 + 1e-9), (accuracy, results["final_test_accuracy"])
