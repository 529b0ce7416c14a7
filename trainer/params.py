"""Model parameters packed into one flat variable per ps shard.

Every `session.run` that crosses between a worker and a ps pays one RPC per
tensor, so the trainer keeps all parameters that live on one ps task in a
single float32 vector and moves it as one tensor each step. The model still
calls `tf.compat.v1.get_variable`; a custom getter hands it slices of the
shard vectors instead of separate variables.

Parameters are spread over the shards by size (largest first onto the
least-loaded shard), so several ps tasks carry about the same bytes.

Checkpoints store each parameter under its own name and shape
(`model/conv1/kernel`), not the shard vectors, so a run can resume with a
different number of ps tasks and a checkpoint of another model is refused
by name and shape.
"""

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorflow.python.training.saving import saveable_object

SCOPE = "model"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One model variable as the model asked for it."""

    name: str                 # checkpoint key, e.g. "model/conv1/kernel"
    shape: tuple[int, ...]
    initializer: Callable

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def record(build: Callable[[], object]) -> list[ParamSpec]:
    """Runs `build` in a scratch graph and lists its get_variable calls."""
    specs: list[ParamSpec] = []

    def recording_getter(getter, name, shape=None, initializer=None, **_):
        del getter
        specs.append(ParamSpec(name, tuple(int(d) for d in shape),
                               initializer))
        return tf.zeros(shape)

    with tf.Graph().as_default():
        with tf.compat.v1.variable_scope(SCOPE,
                                         custom_getter=recording_getter):
            build()
    return specs


def plan_shards(specs: list[ParamSpec], num_shards: int
                ) -> list[list[ParamSpec]]:
    """Assigns parameters to shards, balancing bytes greedily.

    Within a shard parameters keep the model's order. A shard may be empty
    when there are more ps tasks than parameters.
    """
    loads = [0] * num_shards
    owner: dict[str, int] = {}
    for spec in sorted(specs, key=lambda s: -s.size):
        shard = loads.index(min(loads))
        owner[spec.name] = shard
        loads[shard] += spec.size
    return [[s for s in specs if owner[s.name] == i] for i in range(num_shards)]


class FlatLayout:
    """Which parameters each shard vector holds, and how to slice it.

    Knows nothing of variables or devices: the ps trainer keeps the shard
    vectors in variables on the ps tasks (FlatParams), other trainers may
    keep them anywhere. A ps task that got no parameters (more ps tasks
    than parameters) holds no shard.
    """

    def __init__(self, layout: list[list[ParamSpec]]):
        """layout[i]: the parameters of ps task i, from plan_shards."""
        self.ps_indices = [i for i, specs in enumerate(layout) if specs]
        self.shards = [layout[i] for i in self.ps_indices]

    @property
    def sizes(self) -> list[int]:
        return [sum(s.size for s in specs) for specs in self.shards]

    def initial_value(self, shard: int) -> tf.Tensor:
        """Shard `shard`'s initial vector: each parameter's own initializer,
        flattened, in order (float32 [n])."""
        return _concat_initializer(self.shards[shard])(None)

    def unflatten(self, shard_values: list[tf.Tensor]) -> dict[str, tf.Tensor]:
        """Splits shard vectors [n_i] into parameter tensors by name."""
        out = {}
        for specs, value in zip(self.shards, shard_values):
            pieces = tf.split(value, [s.size for s in specs])
            for spec, piece in zip(specs, pieces):
                out[spec.name] = tf.reshape(piece, spec.shape)
        return out

    def getter(self, shard_values: list[tf.Tensor]):
        """A custom getter serving the model's variables from shard_values."""
        by_name = self.unflatten(shard_values)

        def flat_getter(getter, name, *args, **kwargs):
            del getter, args, kwargs
            return by_name[name]

        return flat_getter

    def expected_checkpoint_shapes(self, slot_suffixes=()) -> dict:
        """Checkpoint key -> shape for every parameter and slot entry."""
        out = {}
        for specs in self.shards:
            for spec in specs:
                out[spec.name] = list(spec.shape)
                for suffix in slot_suffixes:
                    out[f"{spec.name}/{suffix}"] = list(spec.shape)
        return out


class FlatParams(FlatLayout):
    """The shard vectors as variables `params/shard_<i>`.

    Build it under a device function that puts variable `params/shard_<i>`
    on ps task `i` (see `graph._ps_strategy`).
    """

    def __init__(self, layout: list[list[ParamSpec]]):
        super().__init__(layout)
        self.variables = [
            tf.compat.v1.get_variable(
                f"params/shard_{i}", [size], tf.float32,
                initializer=_concat_initializer(specs), use_resource=True)
            for i, size, specs in zip(self.ps_indices, self.sizes,
                                      self.shards)]

    def saveables(self, slot_names: dict[str, Callable] | None = None
                  ) -> list[saveable_object.SaveableObject]:
        """Checkpoint entries, one per parameter (and per optimizer slot).

        Args:
          slot_names: suffix -> function(shard variable) returning the slot
            variable to save as "<param>/<suffix>", e.g. Adam's moments.
        """
        out = [_FlatSaveable(v, specs, "")
               for v, specs in zip(self.variables, self.shards)]
        for suffix, slot_of in (slot_names or {}).items():
            out.extend(_FlatSaveable(slot_of(v), specs, "/" + suffix)
                       for v, specs in zip(self.variables, self.shards))
        return out


def _concat_initializer(specs: list[ParamSpec]):
    """An initializer for a shard: each parameter's own, flattened."""

    def initializer(shape, dtype=tf.float32, partition_info=None):
        del shape, partition_info
        return tf.concat([tf.reshape(s.initializer(s.shape, dtype), [-1])
                          for s in specs], axis=0)

    return initializer


class _FlatSaveable(saveable_object.SaveableObject):
    """Saves slices of a flat variable under per-parameter names."""

    def __init__(self, variable, specs: list[ParamSpec], suffix: str):
        self._variable = variable
        value = variable.read_value()
        pieces = tf.split(value, [s.size for s in specs])
        save_specs = [
            saveable_object.SaveSpec(tf.reshape(piece, s.shape), "",
                                     s.name + suffix)
            for s, piece in zip(specs, pieces)]
        super().__init__(variable, save_specs, variable.op.name)

    def restore(self, restored_tensors, restored_shapes):
        del restored_shapes
        flat = tf.concat([tf.reshape(t, [-1]) for t in restored_tensors], 0)
        return self._variable.assign(flat, read_value=False)
