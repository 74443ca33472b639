"""Frozen-variance AdamW for TensorFlow/Keras 2: AdamW whose second moment stops moving after a
warm-up (1-bit Adam, Tang et al., ICML 2021; 0/1 Adam, Lu et al., ICLR 2023; Bagua QAdam).

The same recursion as ``torch_backend.optim.FrozenVarianceAdamW`` (see its module doc), on the
same gradients the same values within float32 rounding. Per step ``t`` (``iterations + 1``)::

    w <- w - lr * weight_decay * w
    m <- m + (1 - beta_1) * (g - m)
    if t <= freeze_step or t is a refresh step:
        v <- beta_2 * v + (1 - beta_2) * g * g;  k <- k + 1
    w <- w - lr / (1 - beta_1^t) * m / (sqrt(v) / sqrt(1 - beta_2^k) + epsilon)

Differences from Keras' own AdamW, on purpose: epsilon is added after the bias correction
(PyTorch's placement, so both frameworks agree), and the defaults are PyTorch's (epsilon 1e-8,
weight_decay 1e-2). The step count is the optimizer's ``iterations``, one for all variables
(Keras has no per-variable count): the freeze happens on the same step for every variable and,
under Horovod, on every rank. ``k``, the gradients ``v`` holds, is a function of ``t``,
``freeze_step`` and ``refresh_interval``, so the optimizer's variables (``iterations``, ``m``,
``v`` per variable, as in AdamW) are its whole state: checkpoints round-trip with
``tf.train.Checkpoint``, the options with ``get_config``/``from_config``.
"""
import math
import numbers

import tensorflow as tf

__all__ = ["FrozenVarianceAdamW"]

_NAME = "FrozenVarianceAdamW"
_MAX_DOUBLINGS = 62  # refresh steps freeze_step + R * (2^j - 1) for j < 62 fit in int64


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{_NAME}: {name} must be an int >= {low}, got {value!r}")


def _check_float(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{_NAME}: {name} must be a finite float, got {value!r}")
    if value < low or (high is not None and value >= high):
        bound = "" if high is None else f" and < {high}"
        raise ValueError(f"{_NAME}: {name} must be >= {low}{bound}, got {value!r}")


_AdamW = tf.keras.optimizers.AdamW


class FrozenVarianceAdamW(_AdamW):
    """Keras 2 AdamW that freezes its second moment after ``freeze_step`` steps (module doc).

    Usable with ``horovod.tensorflow.keras.DistributedOptimizer`` (which rebuilds it from
    ``get_config()``) and with ``hvd.DistributedGradientTape`` + ``apply_gradients``.

    Args:
        learning_rate: float >= 0 or a Keras learning-rate schedule.
        weight_decay: decoupled weight decay (float >= 0), times the learning rate per step.
        beta_1, beta_2: floats in [0, 1).
        epsilon: float >= 0, added to ``sqrt(v / (1 - beta_2^k))``.
        freeze_step: steps of plain AdamW before ``v`` freezes (int >= 1).
        refresh_interval: 0 (off) or R > 0: ``v`` takes one more gradient at steps
            ``freeze_step + R * (2^j - 1)``, j >= 1 (0/1 Adam's growing intervals, simplified).
        **kwargs: Keras' optimizer arguments (clipnorm, jit_compile, name, ...); ``amsgrad``
            must be False.

    Gradients: dense tensors (``tf.IndexedSlices`` are densified: ``m`` decays everywhere).

    Raises:
        ValueError: an option out of range or of the wrong type, naming it; amsgrad=True.
    """

    def __init__(self, learning_rate=1e-3, weight_decay=1e-2, beta_1=0.9, beta_2=0.999, epsilon=1e-8,
                 freeze_step=1000, refresh_interval=0, amsgrad=False, name=_NAME, **kwargs):
        if amsgrad:
            raise ValueError(f"{_NAME}: amsgrad=True is not supported")
        if not isinstance(learning_rate, tf.keras.optimizers.schedules.LearningRateSchedule) \
                and not callable(learning_rate) and not isinstance(learning_rate, (tf.Tensor, tf.Variable)):
            _check_float("learning_rate", learning_rate, 0.0)
        _check_float("weight_decay", weight_decay, 0.0)
        _check_float("beta_1", beta_1, 0.0, 1.0)
        _check_float("beta_2", beta_2, 0.0, 1.0)
        _check_float("epsilon", epsilon, 0.0)
        _check_int("freeze_step", freeze_step, 1)
        _check_int("refresh_interval", refresh_interval, 0)
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, amsgrad=False, name=name, **kwargs)
        self.freeze_step = freeze_step
        self.refresh_interval = refresh_interval

    def _second_moment_schedule(self):
        """(update_v, k) for this step: whether ``v`` takes this step's gradient (bool scalar)
        and how many gradients it holds after this step (int64 scalar)."""
        t = tf.cast(self.iterations, tf.int64) + 1
        freeze = tf.constant(self.freeze_step, tf.int64)
        update = t <= freeze
        count = tf.minimum(t, freeze)
        if self.refresh_interval > 0:
            r = self.refresh_interval
            k = t - freeze
            q = tf.math.floordiv(k, r)
            refresh = (k > 0) & (tf.math.floormod(k, r) == 0) & (tf.bitwise.bitwise_and(q + 1, q) == 0)
            marks = [r * (2 ** j - 1) for j in range(1, _MAX_DOUBLINGS) if r * (2 ** j - 1) < 2 ** 62]
            count += tf.reduce_sum(tf.cast(tf.constant(marks, tf.int64) <= k, tf.int64))
            update = update | refresh
        return update, count

    def update_step(self, gradient, variable):
        """One step of ``variable`` (float, any shape) with ``gradient`` (same shape)."""
        if isinstance(gradient, tf.IndexedSlices):
            gradient = tf.convert_to_tensor(gradient)
        dtype = variable.dtype
        index = self._index_dict[self._var_key(variable)]
        m, v = self._momentums[index], self._velocities[index]
        update_v, count = self._second_moment_schedule()
        t = tf.cast(self.iterations + 1, tf.float64)
        lr = tf.cast(self.learning_rate, tf.float64)
        step_size = tf.cast(lr / (1.0 - tf.pow(tf.constant(self.beta_1, tf.float64), t)), dtype)
        bias2_sqrt = tf.cast(tf.sqrt(1.0 - tf.pow(tf.constant(self.beta_2, tf.float64),
                                                   tf.cast(count, tf.float64))), dtype)
        gradient = tf.cast(gradient, dtype)
        m.assign_add((gradient - m) * tf.cast(1.0 - self.beta_1, dtype))
        v.assign(tf.where(update_v, v * tf.cast(self.beta_2, dtype)
                          + tf.square(gradient) * tf.cast(1.0 - self.beta_2, dtype), v))
        denom = tf.sqrt(v) / bias2_sqrt + tf.cast(self.epsilon, dtype)
        variable.assign_sub(step_size * m / denom)

    def get_config(self):
        config = super().get_config()
        config.update({"freeze_step": self.freeze_step, "refresh_interval": self.refresh_interval})
        return config
