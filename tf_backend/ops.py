"""TensorFlow implementation of :class:`hvd_gradcomp.primitives.Primitives`.

Every function traces inside ``tf.function``; shapes must be static (gradients of variables
are). Python int/float operands of bit operations and min/max are converted to the other
operand's dtype, as PyTorch does implicitly.
"""
import dataclasses

import tensorflow as tf

from hvd_gradcomp.primitives import Primitives, compile_requested

__all__ = ["OPS", "COMPILED_OPS"]

_DTYPES = {"float16": tf.float16, "bfloat16": tf.bfloat16, "float32": tf.float32,
           "float64": tf.float64, "int32": tf.int32, "int64": tf.int64, "int8": tf.int8,
           "uint8": tf.uint8, "int16": tf.int16, "bool": tf.bool}


def _shape(x):
    dims = x.shape.as_list() if x.shape.rank is not None else None
    if dims is None or any(d is None for d in dims):
        raise ValueError(f"hvd_gradcomp needs a static shape, got {x.shape} for {getattr(x, 'name', x)!r}")
    return tuple(dims)


def _like(fn):
    """fn(a, b) with b converted to a's dtype when it is a Python number."""
    def wrapped(a, b):
        if not isinstance(b, (tf.Tensor, tf.Variable)):
            b = tf.constant(b, dtype=a.dtype)
        return fn(a, b)
    return wrapped


def tf32_split(x):
    """``(hi, lo)`` with ``hi + lo == x`` (float32) and ``hi`` exactly representable in TF32
    (its 13 low mantissa bits cleared): the operands of :func:`_matmul`'s three products."""
    hi = tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32), tf.constant(-8192, tf.int32)), tf.float32)
    return hi, x - hi


_GPU_VISIBLE = []  # [bool] once known: TensorFlow's devices are fixed once it has started


def _tf32_on_gpu() -> bool:
    """TensorFlow's TF32 switch is on (its default) and a GPU is visible (read at trace time)."""
    if not tf.config.experimental.tensor_float_32_execution_enabled():
        return False
    if not _GPU_VISIBLE:
        _GPU_VISIBLE.append(bool(tf.config.list_logical_devices("GPU")))
    return _GPU_VISIBLE[0]


def _matmul(a, b):
    """``a @ b`` in float32 precision even where TensorFlow runs float32 matmuls in TF32.

    TensorFlow enables TF32 by default on Ampere and later GPUs (10-bit mantissas), which
    breaks THC's rotation round trip and PowerSGD's orthogonalisation. Its switch
    (``tf.config.experimental.enable_tensor_float_32_execution``) is global and read when a
    kernel runs, so it cannot be turned off for our products alone. Instead each float32
    operand is split into a TF32-exact high part and the rest, and ``a @ b`` is taken as
    ``ah bh + ah bl + al bh`` (three TF32 products; the dropped ``al bl`` and TF32's rounding
    of the low parts are ~2**-22 relative): float32 accuracy, three products' cost, on GPUs
    with TF32 on only (trace-time check); elsewhere one plain product.
    """
    if a.dtype != tf.float32 or not _tf32_on_gpu():
        return tf.linalg.matmul(a, b)
    ah, al = tf32_split(a)
    bh, bl = tf32_split(b)
    return tf.linalg.matmul(ah, bh) + (tf.linalg.matmul(ah, bl) + tf.linalg.matmul(al, bh))


def _allreduce(x, op, name, group=None):
    # Inside a graph the wait cannot be polled: Horovod's own stall check
    # (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) is what stops a mismatched order (docs/usage.md).
    import horovod.tensorflow as hvd
    hop = {"sum": hvd.Sum, "max": hvd.Max}[op]
    safe = "".join(c if c.isalnum() or c in "_." else "_" for c in name)
    kwargs = {} if group is None else {"process_set": group}
    return hvd.allreduce(x, op=hop, name=safe, ignore_name_scope=True, **kwargs)


_KERNELS = {}


def _fuse_eager(fn, plan):
    """``Primitives.fuse`` without a compiler: ``fn(OPS, plan, *tensors)`` op by op (inside
    the caller's ``tf.function`` graph when there is one)."""
    return lambda *tensors: fn(OPS, plan, *tensors)


def _fuse_compiled(fn, plan):
    """``Primitives.fuse`` through XLA: one ``tf.function(jit_compile=True)`` per (fn, plan),
    traced and compiled once per distinct input shape (the scheme code needs static shapes, so
    shapes are not relaxed; XLA specialises on shapes anyway). No autograph: kernels have no
    Python branches on tensor values to convert."""
    key = (fn, plan)
    run = _KERNELS.get(key)
    if run is None:
        run = _KERNELS[key] = tf.function(lambda *tensors: fn(OPS, plan, *tensors),
                                          jit_compile=True, autograph=False)
    return run


def _fuse(fn, plan):
    """``Primitives.fuse``: XLA when ``HVD_GRADCOMP_COMPILE`` asks for it, else op by op."""
    return (_fuse_compiled if compile_requested() else _fuse_eager)(fn, plan)


OPS = Primitives(
    name="tensorflow",
    shape=_shape,
    dtype=lambda x: x.dtype.name,
    reshape=lambda x, shape: tf.reshape(x, shape),
    concat=lambda xs, axis: tf.concat(xs, axis),
    transpose=lambda x, perm: tf.transpose(x, perm),
    zeros=lambda shape, dtype, like: tf.zeros(shape, dtype=_DTYPES[dtype]),
    arange=lambda n, dtype, like: tf.range(n, dtype=_DTYPES[dtype]),
    constant=lambda value, dtype, like: tf.constant(value, dtype=_DTYPES[dtype]),
    cast=lambda x, dtype: tf.cast(x, _DTYPES[dtype]),
    scaled_cast=lambda x, factor, dtype: tf.cast(x if factor == 1.0 else x * factor, _DTYPES[dtype]),
    abs=tf.abs,
    sqrt=tf.sqrt,
    floor=tf.floor,
    round=tf.round,
    log2=lambda x: tf.math.log(x) * (1.0 / 0.6931471805599453),
    exp2=lambda x: tf.math.pow(tf.constant(2.0, x.dtype), x),
    minimum=_like(tf.minimum),
    maximum=_like(tf.maximum),
    clip=lambda x, lo, hi: tf.clip_by_value(x, tf.constant(lo, x.dtype), tf.constant(hi, x.dtype)),
    where=lambda c, a, b: tf.where(c, a, b),
    isfinite=tf.math.is_finite,
    logical_and=tf.logical_and,
    sum=lambda x, axis: tf.reduce_sum(x, axis),
    max=lambda x, axis: tf.reduce_max(x, axis),
    all=lambda x, axis: tf.reduce_all(x, axis),
    count=lambda x, axis: tf.math.count_nonzero(x, axis, dtype=tf.int64),
    norm=lambda x, axis: tf.sqrt(tf.reduce_sum(x * x, axis)),
    matmul=_matmul,
    addmm=lambda c, a, b, alpha: c + alpha * _matmul(a, b),
    top_k=lambda x, k: tf.cast(tf.math.top_k(x, k, sorted=True).indices, tf.int64),
    argsort=lambda x: tf.cast(tf.argsort(x, direction="DESCENDING", stable=True), tf.int64),
    gather=lambda x, idx: tf.gather(x, idx),
    scatter=lambda idx, rows, shape: tf.scatter_nd(tf.expand_dims(idx, 1), rows, shape),
    index_add=lambda x, idx, rows: tf.tensor_scatter_nd_add(x, tf.expand_dims(idx, 1), rows),
    bitcast=lambda x, dtype: tf.bitcast(x, _DTYPES[dtype]),
    bitwise_and=_like(tf.bitwise.bitwise_and),
    bitwise_or=_like(tf.bitwise.bitwise_or),
    bitwise_xor=_like(tf.bitwise.bitwise_xor),
    left_shift=_like(tf.bitwise.left_shift),
    right_shift=_like(tf.bitwise.right_shift),
    cond=lambda pred, true_fn, false_fn: tf.cond(pred, true_fn, false_fn),
    select=lambda pred, true_fn, false_fn: tf.cond(pred, true_fn, false_fn),
    allreduce=_allreduce,
    fuse=_fuse,
    to_host=lambda x: x.numpy().tolist(),
    eager=tf.executing_eagerly,
)

# The same primitives with every fused kernel compiled by XLA, whatever the environment says.
COMPILED_OPS = dataclasses.replace(OPS, fuse=_fuse_compiled)
