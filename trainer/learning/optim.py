"""The update rule and the learning-rate schedule: change the optimizer here.

Both are chosen by name from a table (`--optimizer`, `--lr_schedule`);
the names are checked where the settings are, in config.validate, so
here they are known to be valid. Every trainer builds them from here: the ps chief
(a tf.compat.v1 optimizer applied on the ps tasks), the single-process
baseline (the same optimizer in one process) and the MultiWorkerMirrored
baseline (the same update kernels on a local flat variable, in eager mode).
So all three update alike, bit for bit where their gradients agree.
"""

import math

import tensorflow as tf

from trainer.common.config import LR_SCHEDULES, OPTIMIZERS, TrainConfig
from trainer.common.errors import UserError

ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON = 0.9, 0.999, 1e-8


# --- Learning-rate schedules: progress in [0, 1] -> factor of the rate ---

def _cosine(progress, cos):
    """Half a cosine from 1 at the first step to 0 at the last."""
    return 0.5 * (1.0 + cos(math.pi * progress))


def _constant(progress, cos):
    del progress, cos
    return 1.0


_SCHEDULES = {"cosine": _cosine, "constant": _constant}
assert tuple(_SCHEDULES) == LR_SCHEDULES


def _schedule(config: TrainConfig):
    """The schedule config.lr_schedule names (checked by validate)."""
    return _SCHEDULES[config.lr_schedule]


def learning_rate(config: TrainConfig, step: tf.Tensor,
                  train_steps: int) -> tf.Tensor:
    """The rate of the update of global step `step` (int64 []) as a graph
    op: float32 []."""
    progress = tf.minimum(tf.cast(step, tf.float32) / train_steps, 1.0)
    factor = _schedule(config)(progress, tf.cos)
    return tf.convert_to_tensor(config.learning_rate * factor, tf.float32)


def learning_rate_at(config: TrainConfig, step: int, train_steps: int
                     ) -> float:
    """The same rate in Python, for logs and summaries."""
    progress = min(step / train_steps, 1.0)
    return config.learning_rate * _schedule(config)(progress, math.cos)


# --- Update rules ---
# Each rule gives a tf.compat.v1 optimizer (graph mode, the ps trainer and
# the single-process baseline) and the same kernel on a flat local variable
# (eager mode, the MultiWorkerMirroredStrategy baseline).

class _Sgd:
    def __init__(self, config: TrainConfig):
        self.config = config

    def optimizer(self, rate):
        return tf.compat.v1.train.GradientDescentOptimizer(rate)

    def flat_state(self, size: int) -> dict:
        del size
        return {}

    def apply_flat(self, state: dict, var: tf.Variable, grad, rate) -> None:
        del state
        tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=rate,
                                                delta=grad)


class _Momentum(_Sgd):
    def optimizer(self, rate):
        return tf.compat.v1.train.MomentumOptimizer(rate,
                                                    self.config.momentum)

    def flat_state(self, size: int) -> dict:
        return {"accum": tf.Variable(tf.zeros([size]))}

    def apply_flat(self, state: dict, var: tf.Variable, grad, rate) -> None:
        tf.raw_ops.ResourceApplyMomentum(
            var=var.handle, accum=state["accum"].handle, lr=rate, grad=grad,
            momentum=self.config.momentum)


class _Adam(_Sgd):
    def optimizer(self, rate):
        return tf.compat.v1.train.AdamOptimizer(
            rate, ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON)

    def flat_state(self, size: int) -> dict:
        return {"m": tf.Variable(tf.zeros([size])),
                "v": tf.Variable(tf.zeros([size])),
                "beta1_power": tf.Variable(ADAM_BETA1),
                "beta2_power": tf.Variable(ADAM_BETA2)}

    def apply_flat(self, state: dict, var: tf.Variable, grad, rate) -> None:
        tf.raw_ops.ResourceApplyAdam(
            var=var.handle, m=state["m"].handle, v=state["v"].handle,
            beta1_power=state["beta1_power"],
            beta2_power=state["beta2_power"], lr=rate, beta1=ADAM_BETA1,
            beta2=ADAM_BETA2, epsilon=ADAM_EPSILON, grad=grad)
        state["beta1_power"].assign(state["beta1_power"] * ADAM_BETA1)
        state["beta2_power"].assign(state["beta2_power"] * ADAM_BETA2)


_RULES = {"sgd": _Sgd, "momentum": _Momentum, "adam": _Adam}
assert tuple(_RULES) == OPTIMIZERS


def update_rule(config: TrainConfig):
    """The rule config.optimizer names; UserError naming the known ones
    for a name _RULES lacks (config.validate refuses it first)."""
    rule = _RULES.get(config.optimizer)
    if rule is None:
        raise UserError(f"--optimizer={config.optimizer} is unknown; choose "
                        f"one of {', '.join(_RULES)}")
    return rule(config)


def make_optimizer(config: TrainConfig, rate) -> tf.compat.v1.train.Optimizer:
    """The tf.compat.v1 optimizer of config.optimizer; `rate` is a float, a
    float32 [] tensor or a function returning one."""
    return update_rule(config).optimizer(rate)


class ScheduledUpdate:
    """The run's optimizer, built once, with the rate of the step it
    applies: `apply(step, grads_and_vars)` builds the update of global
    step `step` (int64 []). The checkpoint saver reads its slots from
    `optimizer`."""

    def __init__(self, config: TrainConfig, train_steps: int):
        self._step = None
        # A tf.compat.v1 optimizer calls a callable rate each time it builds
        # an update, so every update gets the rate of its own step.
        self.optimizer = make_optimizer(
            config, lambda: learning_rate(config, self._step, train_steps))

    def apply(self, step: tf.Tensor, grads_and_vars: list) -> tf.Operation:
        self._step = step
        try:
            return self.optimizer.apply_gradients(grads_and_vars)
        finally:
            self._step = None
