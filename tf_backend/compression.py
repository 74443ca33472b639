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

Routing rules (``Compression.rules``) match the variable's name (``var.name``), which
TensorFlow does not keep equal across ranks: rules with a glob need
``compressor.route(model.trainable_variables)`` on every rank before the first step (see
:mod:`hvd_gradcomp.routing`). ``num_groups``/``groups``: a group's payloads get one dtype (see
:mod:`hvd_gradcomp.adapter`). ``IndexedSlices`` gradients (an Embedding without
``sparse_as_dense``) bypass ``compress``; the adapter counts their bytes in graph
(``bytes_per_step().sparse``).

``jit_compile=True`` on the training step does not work with Horovod 0.28.1, compressed or
not: Horovod's collectives have no XLA kernels.
"""
import sys

import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from hvd_gradcomp.adapter import Call, HorovodCompressor
from hvd_gradcomp.frontend import Frontend
from hvd_gradcomp.horovod_ops import op_name
from hvd_gradcomp.namespace import Namespace

from .ops import OPS

__all__ = ["Compressor", "Compression", "TFFrontend", "VariableStore"]

_NO_KEY = ("{scheme}: cannot tell which variable this gradient belongs to; use the compressor "
           "through hvd.DistributedGradientTape / hvd.DistributedOptimizer, pass name= to "
           "hvd.allreduce, or call compress(tensor, name=...)")


def _find_call(tensor) -> Call:
    """Key, op, scaling and process set of ``tensor``'s all-reduce, from Horovod's frames.

    Horovod's ``allreduce(tensor, ..., op, prescale_factor, postscale_factor, name,
    process_set)`` calls ``compress`` and holds those arguments. Above it,
    ``allreduce_grads(grads, vars)`` (also under autograph, as ``tf__allreduce_grads``) hands
    each element of ``grads`` itself to ``compress``, in the grouped and the non-grouped path
    alike; the key is the gradient's position ``grad_<j>`` in that call, as Horovod names its
    own collectives, so it is identical on every rank even when auto-generated variable names
    differ. The owner is the variable: another variable at the same position (a second tape
    or optimizer using this compressor) gets its own state under ``grad_<j>@1``.
    ``hvd.allreduce(t, name=...)`` called directly gives ``name``.
    """
    import horovod.tensorflow as hvd
    frame = sys._getframe(2)
    call = group = None
    while frame is not None:
        loc = frame.f_locals
        code = frame.f_code.co_name.removeprefix("tf__")
        if group is None and call is None and "compression" in loc and isinstance(loc.get("tensor_list"), list):
            # grouped_allreduce's dense tensors; under autograph, in the frame of its if-branch.
            group = loc["tensor_list"]
        if code == "allreduce" and call is None and "compression" in loc:
            name = loc.get("name")
            call = Call(name if isinstance(name, str) else None, op_name(hvd, loc.get("op"), loc.get("average")),
                        float(loc.get("prescale_factor", 1.0) or 1.0),
                        float(loc.get("postscale_factor", 1.0) or 1.0), loc.get("process_set"))
        elif code == "grouped_allreduce" and call is None and "compression" in loc:
            call = Call(None, op_name(hvd, loc.get("op"), loc.get("average")),
                        float(loc.get("prescale_factor", 1.0) or 1.0),
                        float(loc.get("postscale_factor", 1.0) or 1.0), loc.get("process_set"),
                        group=group)
        elif code == "allreduce_grads" and isinstance(loc.get("grads"), (list, tuple)):
            variables = loc.get("vars")
            for j, grad in enumerate(loc["grads"]):
                if grad is tensor:
                    var = variables[j] if variables is not None and j < len(variables) else None
                    is_var = isinstance(var, tf.Variable)
                    return (call or Call())._replace(key=f"grad_{j}", owner=var,
                                                     shape=getattr(var, "shape", None),
                                                     label=var.name if is_var else None,
                                                     pin=var.ref() if is_var else None,
                                                     batch=(loc["grads"], variables))
            return call or Call()
        frame = frame.f_back
    return call or Call()


class VariableStore:
    """The scheme states of a TensorFlow compressor (:class:`hvd_gradcomp.store.Store`): a
    tuple of non-trainable ``tf.Variable`` s per key, which a traced ``tf.function`` reads and
    assigns; exported as tensors (``portable``: NumPy arrays)."""

    __slots__ = ("vars",)

    def __init__(self):
        self.vars = {}  # key -> (state class, tuple of variables)

    def has(self, key):
        return key in self.vars

    def read(self, key):
        cls, variables = self.vars[key]
        return cls(*[tf.identity(v) for v in variables])

    def create(self, key, state):
        # A gradient may first appear in a later trace of the user's tf.function (a variable
        # outside the loss at first), and tf.Variable() refuses creation after the first call.
        # These variables are created eagerly (init_scope) and kept for the compressor's
        # lifetime, which is what that rule protects; constructing the ResourceVariable class
        # directly skips the tf.function variable-creator check.
        with tf.init_scope():
            safe = "".join(c if c.isalnum() else "_" for c in key)
            variables = tuple(ResourceVariable(v, trainable=False, name=f"hvd_gradcomp_{safe}_{f}")
                              for f, v in zip(state._fields, state))
        self.vars[key] = (type(state), variables)

    def write(self, key, state):
        cls, variables = self.vars[key]
        if cls._fields != state._fields or any(v.shape != value.shape for v, value in zip(variables, state)):
            # An adaptive scheme (auto) changed its fields: new variables (it runs eagerly).
            self.create(key, state)
            return
        for var, value in zip(variables, state):
            var.assign(value)

    def drop(self, key):
        del self.vars[key]

    def export(self, value, portable=False):
        return value.numpy() if portable else tf.identity(value)

    def load(self, value):
        return tf.convert_to_tensor(value)

    def zeros_like(self, value):
        return tf.zeros_like(value)

    def to_device(self, value, like):
        return tf.convert_to_tensor(value)


class TFFrontend(Frontend):
    """What a codec needs of TensorFlow (:class:`hvd_gradcomp.frontend.Frontend`): Horovod's
    calling frames (:func:`_find_call`), ``horovod.tensorflow``, first states built outside any
    graph, static shapes, ``IndexedSlices`` counted in graph, the Keras loss scale. One per
    compressor (it keeps the last batch of gradients it watched)."""

    __slots__ = ("last_batch",)
    no_key_message = _NO_KEY
    find_call = staticmethod(_find_call)

    def __init__(self):
        self.last_batch = None

    def horovod(self):
        import horovod.tensorflow as hvd
        return hvd

    def on_gpu(self, tensor):
        # Inside a tf.function a tensor's device may still be unplaced (""): Horovod's op then
        # lands on a GPU whenever one is visible (its GPU kernel exists in a GPU build).
        device = getattr(tensor, "device", "") or ""
        return "GPU" in device.upper() or (not device and bool(tf.config.list_logical_devices("GPU")))

    def build_state(self, build, like):
        with tf.init_scope():  # initial values must not live in the calling tf.function's graph
            return build(None)

    def scale_of(self, source):
        scale = getattr(source, "loss_scale", source)  # Keras LossScaleOptimizer: a variable
        return tf.reshape(tf.cast(tf.convert_to_tensor(scale), tf.float32), [])

    def static(self, tensor, call):
        """Give a gradient with unknown dimensions (``sparse_as_dense`` on an embedding gives
        ``(None, 16)``) its variable's static shape, so the payload size is a function of the
        known shape and every rank posts the same size."""
        if tensor.shape.rank is not None and tensor.shape.is_fully_defined():
            return tensor
        known = call.shape
        if known is None or not tf.TensorShape(known).is_fully_defined():
            raise ValueError(f"hvd_gradcomp: gradient {call.key or getattr(tensor, 'name', '?')!r} has shape "
                             f"{tensor.shape} with unknown dimensions and no variable of known shape; "
                             f"compressors need a static shape (pass a tensor of known shape)")
        return tf.reshape(tensor, tf.TensorShape(known).as_list())

    def route_items(self, params):
        for item in params:
            name, var = (item.name, item) if isinstance(item, tf.Variable) else item
            pin = var.ref() if isinstance(var, tf.Variable) else None
            yield name, tuple(var.shape.as_list()), var.dtype.name, pin

    def watch_sparse(self, call, compressor):
        """``IndexedSlices`` among the gradients of Horovod's ``allreduce_grads`` call: Horovod
        gathers them on its sparse path, without compress. Once per traced call (the first dense
        gradient's compress), an in-graph assign records this rank's bytes of each (values +
        indices) and counts the step, in an int64 [2] variable read by bytes_per_step()."""
        grads, variables = call.batch
        if grads is self.last_batch:
            return
        self.last_batch = grads
        for j, grad in enumerate(grads):
            if not isinstance(grad, tf.IndexedSlices):
                continue
            var = variables[j] if variables is not None and j < len(variables) else None
            key = f"grad_{j}"

            def make(key=key):
                with tf.init_scope():
                    return ResourceVariable(tf.zeros([2], tf.int64), trainable=False,
                                            name=f"hvd_gradcomp_sparse_{key}")

            entry = compressor.codec.tensors.note_sparse(key, make, compressor.spec,
                                                         key if var is None else f"{key} ({var.name})")
            nbytes = (tf.size(grad.values, out_type=tf.int64) * grad.values.dtype.size
                      + tf.size(grad.indices, out_type=tf.int64) * grad.indices.dtype.size)
            entry.assign(tf.stack([nbytes, entry[1] + 1]))

    def read_sparse(self, entry):
        value = entry.numpy()
        return int(value[0]), int(value[1])


class Compressor(HorovodCompressor):
    """A Horovod compressor for TensorFlow tensors (see :class:`hvd_gradcomp.adapter.HorovodCompressor`).

    State is a tuple of non-trainable ``tf.Variable``s per gradient (:class:`VariableStore`);
    ``state_dict()`` returns their values as tensors.
    """

    __slots__ = ()

    def __init__(self, routing):
        super().__init__(routing, OPS, VariableStore(), TFFrontend())

    # Horovod's functions run under autograph inside tf.function; ours must not be converted
    # (their Python branches are on static facts, and autograph would rewrite them).
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor, name=None):
        return super().compress(tensor, name)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, payload, ctx):
        return super().decompress(payload, ctx)

    def __hash__(self):  # Horovod caches its tf.function per compressor object
        return id(self)

    def __eq__(self, other):
        return self is other


Compression = Namespace(Compressor)
