"""Horovod (TensorFlow) compressors built from the shared schemes.

Usage, exactly like Horovod's own ``hvd.Compression.fp16``::

    import horovod.tensorflow as hvd
    from tf_backend import Compression
    tape = hvd.DistributedGradientTape(tape, compression=Compression.topkc(ratio=0.01))

Horovod builds its all-reduce inside ``tf.function`` (and a ``tf.cond`` branch), so
``compress`` runs at trace time: per-tensor state lives in ``tf.Variable``s, created under
``tf.init_scope()`` on first use and updated with ``assign``; the same code also runs eagerly.

Tensor identity: Horovod passes ``compress`` only the gradient. Its variable is found in
Horovod's calling frames (``allreduce_grads(grads, vars)`` and the index of the gradient
being reduced, also for ``groups``); the key is the variable's name, identical on every rank
and stable across steps and retraces. ``hvd.allreduce(t, name=..., compression=c)`` uses
``name``. Anything else must call ``compress(tensor, name=...)``.
"""
import sys

import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from hvd_gradcomp.adapter import HorovodCompressor, Namespace

from .ops import OPS

__all__ = ["Compressor", "Compression"]

_NO_KEY = ("{scheme}: cannot tell which variable this gradient belongs to; use the compressor "
           "through hvd.DistributedGradientTape / hvd.DistributedOptimizer, pass name= to "
           "hvd.allreduce, or call compress(tensor, name=...)")


def _variable_name(tensor):
    """The name of the variable whose gradient ``tensor`` is, from Horovod's calling frames.

    Horovod's ``allreduce_grads(grads, vars, ...)`` (also under autograph, as
    ``tf__allreduce_grads``) hands each element of ``grads`` itself to ``compress``, in the
    grouped and the non-grouped path alike, so the position of ``tensor`` in ``grads`` names
    its variable. ``hvd.allreduce(t, name=...)`` called directly gives ``name``.
    """
    frame = sys._getframe(3)
    name = None
    while frame is not None:
        loc = frame.f_locals
        code = frame.f_code.co_name.removeprefix("tf__")
        if code == "allreduce_grads" and isinstance(loc.get("grads"), (list, tuple)):
            for j, grad in enumerate(loc["grads"]):
                if grad is tensor:
                    variables = loc.get("vars")
                    return variables[j].name if variables is not None else f"grad_{j}"
            return None
        if code == "allreduce" and name is None and isinstance(loc.get("name"), str):
            name = loc["name"]
        frame = frame.f_back
    return name


class Compressor(HorovodCompressor):
    """A Horovod compressor for TensorFlow tensors (see :class:`hvd_gradcomp.adapter.HorovodCompressor`).

    State is a tuple of non-trainable ``tf.Variable``s per gradient; ``state_dict()`` returns
    their values as tensors.
    """

    __slots__ = ("_vars",)
    ops = OPS

    def __init__(self, scheme):
        super().__init__(scheme)
        self._vars = {}

    # Horovod's functions run under autograph inside tf.function; ours must not be converted
    # (their Python branches are on static facts, and autograph would rewrite them).
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor, name=None):
        return super().compress(tensor, name)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, payload, ctx):
        return super().decompress(payload, ctx)

    no_key_message = _NO_KEY
    _find_key = staticmethod(_variable_name)

    @staticmethod
    def _horovod():
        import horovod.tensorflow as hvd
        return hvd

    def _has_state(self, key):
        return key in self._vars

    def _read_state(self, key):
        cls, variables = self._vars[key]
        return cls(*[tf.identity(v) for v in variables])

    def _initial_state(self, info, like, loaded):
        with tf.init_scope():  # initial values must not live in the calling tf.function's graph
            return super()._initial_state(info, None, loaded)

    def _create_state(self, key, state):
        # A gradient may first appear in a later trace of the user's tf.function (a variable
        # outside the loss at first), and tf.Variable() refuses creation after the first call.
        # These variables are created eagerly (init_scope) and kept in self._vars for the
        # compressor's lifetime, which is what that rule protects; constructing the
        # ResourceVariable class directly skips the tf.function variable-creator check.
        with tf.init_scope():
            safe = "".join(c if c.isalnum() else "_" for c in key)
            variables = tuple(ResourceVariable(v, trainable=False, name=f"hvd_gradcomp_{safe}_{f}")
                              for f, v in zip(state._fields, state))
        self._vars[key] = (type(state), variables)

    def _write_state(self, key, state):
        _, variables = self._vars[key]
        for var, value in zip(variables, state):
            var.assign(value)

    def _export(self, tensor):
        return tf.identity(tensor)

    def _to_device(self, value, like):
        return tf.convert_to_tensor(value)

    def __hash__(self):  # Horovod caches its tf.function per compressor object
        return id(self)

    def __eq__(self, other):
        return self is other


Compression = Namespace(Compressor)
