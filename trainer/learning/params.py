"""Model parameters packed into one flat variable per ps shard.

Every `session.run` that crosses between a worker and a ps pays one RPC per
tensor, so the trainer keeps all parameters that live on one ps task in a
single float32 vector and moves it as one tensor each step. The model still
calls `tf.compat.v1.get_variable`; a custom getter hands it tensors cut from
the shard vectors instead of separate variables.

Parameters are spread over the shards by bytes, a parameter may straddle
shards: the concatenation of every parameter, flattened in model order, is
cut into contiguous ranges whose sizes differ by at most one float. (Cut by
whole variables, the mlp's 784x128 kernel alone would keep one ps task busy
with 98.6% of the bytes.) A parameter cut into pieces is put back together
by the getter (concat, then reshape), so its gradient flows to each piece's
shard.

Checkpoints store each parameter under its own name and shape
(`model/conv1/kernel`), not the shard vectors, so a run can resume with a
different number of ps tasks and a checkpoint of another model is refused
by name and shape.
"""

import contextlib
import dataclasses
from typing import Callable

from absl import logging
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


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of one parameter, flattened (row-major), kept
    contiguously in one shard vector."""

    spec: ParamSpec
    start: int
    stop: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def size(self) -> int:
        return self.stop - self.start


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
                ) -> list[list[Piece]]:
    """Cuts the parameters into `num_shards` shards of (almost) equal bytes.

    Shard i holds a contiguous range of the concatenation of all parameters,
    flattened in model order; the first `total % num_shards` shards hold one
    float more than the others. A parameter crossing a boundary becomes one
    piece in each shard it touches. With more shards than floats the last
    shards are empty, so the ps tasks without parameters are the last ones.

    Returns:
      layout[i]: the pieces of shard i, in model order.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    for spec in specs:
        if spec.size < 1:
            raise ValueError(f"parameter {spec.name} {spec.shape} is empty")
    total = sum(s.size for s in specs)
    base, extra = divmod(total, num_shards)
    layout: list[list[Piece]] = []
    lo = 0
    for i in range(num_shards):
        hi = lo + base + (1 if i < extra else 0)
        pieces = []
        offset = 0        # where the current parameter starts in the total
        for spec in specs:
            start, stop = max(lo, offset), min(hi, offset + spec.size)
            if start < stop:
                pieces.append(Piece(spec, start - offset, stop - offset))
            offset += spec.size
        layout.append(pieces)
        lo = hi
    return layout


class FlatLayout:
    """Which pieces of which parameters each shard vector holds.

    Knows nothing of variables or devices: the ps trainer keeps the shard
    vectors in variables on the ps tasks (FlatParams), other trainers may
    keep them anywhere. A ps task that got no parameters (more ps tasks
    than floats) holds no shard.
    """

    def __init__(self, layout: list[list]):
        """layout[i]: the pieces of ps task i, from plan_shards.

        A whole ParamSpec also counts as a piece covering all of it (the
        whole-variable layouts of earlier versions).
        """
        layout = [[p if isinstance(p, Piece) else Piece(p, 0, p.size)
                   for p in shard] for shard in layout]
        self.ps_indices = [i for i, pieces in enumerate(layout) if pieces]
        self.shards: list[list[Piece]] = [layout[i] for i in self.ps_indices]
        # Every parameter once, in order of first appearance (model order
        # for plan_shards' layouts).
        by_name: dict[str, ParamSpec] = {}
        covered: dict[str, int] = {}
        for piece in (p for shard in self.shards for p in shard):
            by_name.setdefault(piece.name, piece.spec)
            covered[piece.name] = covered.get(piece.name, 0) + piece.size
        self.specs = list(by_name.values())
        for spec in self.specs:
            if covered[spec.name] != spec.size:
                raise ValueError(f"layout holds {covered[spec.name]} of "
                                 f"{spec.size} floats of {spec.name}")

    @property
    def sizes(self) -> list[int]:
        """Floats per shard vector, for the shards in ps_indices."""
        return [sum(p.size for p in pieces) for pieces in self.shards]

    def initial_value(self, shard: int) -> tf.Tensor:
        """Shard `shard`'s initial vector (float32 [sizes[shard]]): its range
        of the concatenation of every parameter's own initializer output."""
        return _shard_initializer(self.shards[shard])(None)

    def unflatten(self, shard_values: list[tf.Tensor]) -> dict[str, tf.Tensor]:
        """Shard vectors (float32 [sizes[i]]) -> parameter tensors by name.

        A parameter held in pieces on several shards is the reshaped concat
        of its pieces, so a gradient w.r.t. it reaches every shard value.
        """
        parts: dict[str, list] = {}
        for pieces, value in zip(self.shards, shard_values):
            cut = tf.split(value, [p.size for p in pieces])
            for piece, part in zip(pieces, cut):
                parts.setdefault(piece.name, []).append((piece.start, part))
        out = {}
        for spec in self.specs:
            ordered = [part for _, part in sorted(parts[spec.name],
                                                  key=lambda sp: sp[0])]
            flat = ordered[0] if len(ordered) == 1 else tf.concat(ordered, 0)
            out[spec.name] = tf.reshape(flat, spec.shape)
        return out

    def flatten(self, values: dict[str, tf.Tensor]) -> list[tf.Tensor]:
        """Parameter tensors by name -> the shard vectors (float32
        [sizes[i]]) holding them; the inverse of unflatten."""
        flat = {name: tf.reshape(v, [-1]) for name, v in values.items()}
        return [tf.concat([flat[p.name][p.start:p.stop] for p in pieces], 0)
                for pieces in self.shards]

    def pack(self, values: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Per-parameter arrays by name -> the shard vectors (float32
        [sizes[i]]) holding them; the inverse of unflatten, in NumPy."""
        return [np.concatenate(
            [np.asarray(values[p.name], np.float32).reshape(-1)[
                p.start:p.stop] for p in pieces]) for pieces in self.shards]

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
        for spec in self.specs:
            out[spec.name] = list(spec.shape)
            for suffix in slot_suffixes:
                out[f"{spec.name}/{suffix}"] = list(spec.shape)
        return out

    def describe(self) -> str:
        """One line: floats per shard and the parameters that straddle."""
        counts: dict[str, int] = {}
        for piece in (p for shard in self.shards for p in shard):
            counts[piece.name] = counts.get(piece.name, 0) + 1
        straddle = [f"{n} ({c} shards)" for n, c in counts.items() if c > 1]
        return (f"{sum(self.sizes)} floats on ps tasks {self.ps_indices}: "
                f"{self.sizes} floats; straddling: "
                f"{', '.join(straddle) or 'none'}")


class FlatParams(FlatLayout):
    """The shard vectors as variables `params/shard_<i>` (float32 [n_i]).

    Build it under a device function that puts variable `params/shard_<i>`
    on ps task `i` (see `devices.variable_placement`).
    """

    def __init__(self, layout: list[list],
                 elsewhere: dict[int, tuple[str, str]] | None = None):
        """elsewhere: ps index -> (name, device) of the variable that
        serves its shard instead of `params/shard_<i>` (a copy, while that
        ps is down: trainer/sync/mirrors.py)."""
        super().__init__(layout)
        logging.info("parameters: %s", self.describe())
        elsewhere = elsewhere or {}
        self.variables = []
        for i, size, pieces in zip(self.ps_indices, self.sizes, self.shards):
            name, device = elsewhere.get(i, (f"params/shard_{i}", None))
            # (device(None) would clear the placement around us.)
            with (tf.compat.v1.device(device) if device
                  else contextlib.nullcontext()):
                self.variables.append(tf.compat.v1.get_variable(
                    name, [size], tf.float32,
                    initializer=_shard_initializer(pieces),
                    use_resource=True))

    def saveables(self, slot_names: dict[str, Callable] | None = None
                  ) -> list[saveable_object.SaveableObject]:
        """Checkpoint entries, one per parameter (and per optimizer slot).

        Args:
          slot_names: suffix -> function(shard variable) returning the slot
            variable to save as "<param>/<suffix>", e.g. Adam's moments.
        Returns:
          One saveable for the shard variables and one per slot suffix,
          each covering every shard (a parameter may straddle them).
        """
        out = [_FlatSaveable(self, self.variables, "")]
        for suffix, slot_of in (slot_names or {}).items():
            slots = [slot_of(v) for v in self.variables]
            out.append(_FlatSaveable(self, slots, "/" + suffix))
        return out


def _shard_initializer(pieces: list[Piece]):
    """An initializer for a shard: its pieces of each parameter's own
    initializer output, flattened.

    A straddling parameter's initializer runs once per shard that holds a
    piece of it; the model seeds each initializer, so every run produces
    the same values and the pieces fit together exactly.
    """

    def initializer(shape, dtype=tf.float32, partition_info=None):
        del shape, partition_info
        return tf.concat(
            [tf.reshape(p.spec.initializer(p.spec.shape, dtype),
                        [-1])[p.start:p.stop] for p in pieces], axis=0)

    return initializer


class _FlatSaveable(saveable_object.SaveableObject):
    """Saves flat shard variables under per-parameter names and shapes.

    One SaveableObject covers all the shard variables of one kind (the
    parameters, or one optimizer slot): a straddling parameter is saved as
    the concat of its pieces, and restoring splits it back into each shard.
    """

    def __init__(self, layout: FlatLayout, variables: list, suffix: str):
        self._layout = layout
        self._variables = variables
        values = layout.unflatten([v.read_value() for v in variables])
        save_specs = [saveable_object.SaveSpec(values[s.name], "",
                                               s.name + suffix)
                      for s in layout.specs]
        # The first variable names the saveable and is its (unique) op.
        super().__init__(variables[0], save_specs, variables[0].op.name)

    def restore(self, restored_tensors, restored_shapes):
        """restored_tensors: one per parameter, in layout.specs order."""
        del restored_shapes
        flat = {spec.name: tf.reshape(t, [-1])
                for spec, t in zip(self._layout.specs, restored_tensors)}
        assigns = []
        for variable, pieces in zip(self._variables, self._layout.shards):
            with tf.device(variable.device):
                value = tf.concat([flat[p.name][p.start:p.stop]
                                   for p in pieces], 0)
                assigns.append(variable.assign(value, read_value=False))
        return tf.group(*assigns)
