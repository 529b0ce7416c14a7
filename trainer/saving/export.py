"""Exports trained parameters as a SavedModel for inference.

The chief writes `<logdir>/export/<global step>/`, the layout TensorFlow
Serving loads: under a model base path, each folder named by an integer is
a version, and the highest one is served. The newest --keep_checkpoints
versions are kept. A SavedModel needs nothing of this package to be used:

    loaded = tf.saved_model.load(newest_version("runs/cnn/export"))
    out = loaded.signatures["serving_default"](images=tf.constant(x))
    out["classes"], out["probabilities"]

where `x` is float32 [batch, 28, 28] with pixel values in [0, 1]: MNIST's
raw bytes / 255, so 0 is the white background and 1 the darkest ink.

Signature `serving_default` (TensorFlow Serving's predict method):
  input  `images`:        float32 [batch, 28, 28]
  output `probabilities`: float32 [batch, 10], the softmax of the logits
  output `classes`:       int64 [batch], the most probable digit
"""

import os
import pathlib
import shutil
import uuid

import numpy as np
import tensorflow as tf
from absl import logging

from trainer.learning import model as model_lib
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.common.config import MODELS
from trainer.learning.data import IMAGE_SIZE
from trainer.common.errors import UserError, edge
from trainer.saving import checkpoints

SIGNATURE_KEY = tf.saved_model.DEFAULT_SERVING_SIGNATURE_DEF_KEY


def parameter_shapes(model: str, hidden_units: int) -> dict[str, tuple]:
    """Parameter name ("model/conv1/kernel") -> shape, in model order."""
    if model not in MODELS:
        raise UserError(f"unknown model '{model}'; use one of "
                        f"{', '.join(MODELS)}")
    return {s.name: s.shape
            for s in replica_lib.param_specs(model, hidden_units)}


def check_values(values: dict, model: str, hidden_units: int,
                 source: str = "the export") -> None:
    """Refuses values that are not exactly the model's parameters
    (checkpoints.check_fit, the check a resumed checkpoint passes too)."""
    checkpoints.check_fit(
        {name: list(np.shape(value)) for name, value in values.items()},
        parameter_shapes(model, hidden_units), source,
        f"--model={model} --hidden_units={hidden_units}",
        "use the flags of the run that trained these parameters",
        refuse=lambda name: True)


def values_from_checkpoint(checkpoint_path: str, model: str,
                           hidden_units: int) -> dict[str, np.ndarray]:
    """Reads the model's parameters from a trainer checkpoint.

    Args:
      checkpoint_path: a checkpoint prefix (".../model.ckpt-500"), or a
        folder whose newest checkpoint is read.
    Returns:
      parameter name -> float32 array; optimizer slots ("<name>/m"), the
      global step and the like are left out.
    """
    if os.path.isdir(checkpoint_path):
        latest = tf.train.latest_checkpoint(checkpoint_path)
        if not latest:
            raise UserError(f"no checkpoint in {checkpoint_path}; give a "
                            "run's --logdir or a checkpoint prefix")
        checkpoint_path = latest
    try:
        reader = tf.train.load_checkpoint(checkpoint_path)
    except (tf.errors.OpError, ValueError) as e:
        raise UserError(f"cannot read checkpoint {checkpoint_path} "
                        f"({str(e).splitlines()[0]}); give a checkpoint "
                        "prefix such as <logdir>/model.ckpt-500") from None
    names = reader.get_variable_to_shape_map()
    values = {name: reader.get_tensor(name).astype(np.float32)
              for name in parameter_shapes(model, hidden_units)
              if name in names}
    check_values(values, model, hidden_units,
                 f"checkpoint {checkpoint_path}")
    return values


def _build_and_save(directory: str, model: str, hidden_units: int,
                    values: dict) -> None:
    """Writes the SavedModel into the empty folder `directory`.

    Built with the TF1 SavedModelBuilder in a graph and session of its
    own, not with tf.saved_model.save: that needs eager execution, which
    the chief's `with tf.Graph().as_default()` turns off, while a private
    graph works the same from an eager caller and from a graph-mode one.
    TF2's tf.saved_model.load loads such a model and its signature.
    """
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        images = tf.compat.v1.placeholder(
            tf.float32, [None, IMAGE_SIZE, IMAGE_SIZE], name="images")
        # Under SCOPE the model's variables get the parameter names.
        with tf.compat.v1.variable_scope(params_lib.SCOPE):
            logits = model_lib.build(model, tf.expand_dims(images, -1),
                                     hidden_units=hidden_units)
        probabilities = tf.nn.softmax(logits, name="probabilities")
        classes = tf.argmax(logits, axis=1, output_type=tf.int64,
                            name="classes")
        for variable in tf.compat.v1.global_variables():
            # Feeding the initial value sets the variable without adding
            # a copy of the values to the graph as a constant.
            session.run(variable.initializer, {
                variable.initial_value: np.asarray(values[variable.op.name],
                                                    np.float32)})
        signature = tf.compat.v1.saved_model.predict_signature_def(
            inputs={"images": images},
            outputs={"probabilities": probabilities, "classes": classes})
        builder = tf.compat.v1.saved_model.Builder(directory)
        builder.add_meta_graph_and_variables(
            session, [tf.saved_model.SERVING],
            signature_def_map={SIGNATURE_KEY: signature})
        builder.save()


def export_saved_model(export_dir: str, model: str, hidden_units: int,
                       values: dict[str, np.ndarray]) -> str:
    """Writes a SavedModel of `model` with `values` (see the module doc).

    Args:
      export_dir: where the SavedModel goes (e.g. "<logdir>/export"); an
        export already there is replaced whole.
      model, hidden_units: the flags of the run that trained the values.
      values: parameter name ("model/conv1/kernel") -> trained value, for
        exactly the parameters `params.record` lists for the model.
    Returns:
      export_dir.
    """
    check_values(values, model, hidden_units)
    target = pathlib.Path(export_dir)
    def place():
        return edge("the export folder", target, "give a folder this user "
                    "can create and write (a new --logdir)")

    with place():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built in a hidden sibling, then moved into place by _replace.
        # The sibling is made by os.mkdir, which keeps the umask's
        # permissions (tempfile.mkdtemp's 0700 would hide the export from
        # a server that runs as another user).
        staging = str(target.parent /
                      f".{target.name}.tmp-{uuid.uuid4().hex}")
        os.mkdir(staging)
    try:
        _build_and_save(staging, model, hidden_units, values)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    with place():
        _replace(target, staging)
    logging.info("exported the %s model to %s", model, target)
    return str(target)


def _replace(target: pathlib.Path, staging: str) -> None:
    """Moves folder `staging` to `target`, replacing any folder there.

    Two renames within one file system, so `target` only ever holds a
    whole export. A crash between them leaves no `target` and the previous
    export at `<staging>.old`; a crash while building leaves `staging`.
    """
    old = staging + ".old"
    if target.exists():
        os.rename(target, old)
    try:
        os.rename(staging, target)
    except OSError:
        if os.path.exists(old):
            os.rename(old, target)   # put the previous export back
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def versions(base_dir: str) -> list[int]:
    """The version numbers under a TF Serving model base path, ascending:
    folders named by an integer that hold a saved_model.pb."""
    base = pathlib.Path(base_dir)
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.iterdir()
                  if p.name.isdigit() and (p / "saved_model.pb").is_file())


def newest_version(base_dir: str) -> str:
    """The folder of the highest version: the one TF Serving serves."""
    found = versions(base_dir)
    if not found:
        raise UserError(f"no exported version in {base_dir}; give a run's "
                        "<logdir>/export after training ended")
    return str(pathlib.Path(base_dir) / str(found[-1]))


def export_version(base_dir: str, version: int, model: str,
                   hidden_units: int, values: dict[str, np.ndarray],
                   keep: int) -> str:
    """Writes version `version` (the global step) under `base_dir`, then
    removes all but the newest `keep` versions (an export of the same
    version is replaced whole). Returns the version's folder."""
    path = export_saved_model(str(pathlib.Path(base_dir) / str(int(version))),
                              model, hidden_units, values)
    for old in versions(base_dir)[:-keep]:
        shutil.rmtree(pathlib.Path(base_dir) / str(old), ignore_errors=True)
        logging.info("removed export version %d (--keep_checkpoints=%d)",
                     old, keep)
    return path
