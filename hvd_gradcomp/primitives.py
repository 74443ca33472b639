"""The tensor primitives every compression scheme is written against.

Rules (after einops' backend table and array-api-compat):

1. The core (``hvd_gradcomp``) imports no framework and no NumPy. Each scheme receives an
   ``ops: Primitives`` instance and calls only its fields, plus Python's arithmetic and
   comparison operators (``+ - * / < >``), which both PyTorch and TensorFlow tensors overload
   with the same meaning for same-dtype operands and Python scalars.
2. ``torch_backend`` and ``tf_backend`` each build one instance by keyword, so a missing
   primitive fails at import, not in the middle of a training step.
3. Names follow the frameworks (``top_k``, ``argsort``, ``matmul``); every reduction takes an
   explicit ``axis`` (``None`` reduces everything to a 0-d tensor).
4. Dtypes are named by strings: ``"float16" "bfloat16" "float32" "float64" "int32" "int64"``.
5. Nothing here moves data to the host or branches on tensor values: the same scheme code
   runs on GPU tensors and traces inside ``tf.function``. Sizes used to build shapes are
   static Python ints taken from the tensor's static shape.
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Primitives", "FLOAT_DTYPES", "itemsize", "one_rank", "compile_requested",
           "COMPILE_ENV"]

# Environment switch for the backends' kernel compiler (see ``Primitives.fuse``).
COMPILE_ENV = "HVD_GRADCOMP_COMPILE"

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8,
             "int8": 1, "uint8": 1, "int16": 2, "bool": 1}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in :class:`Primitives` (e.g. ``"float16"`` -> 2)."""
    return _ITEMSIZE[dtype]


@dataclass(frozen=True)
class Primitives:
    """One framework's implementation of the primitives (see the module docstring).

    ``x`` is a tensor of the framework, ``n``/``k`` are Python ints, ``dtype`` a dtype string.
    """

    name: str  # "torch" or "tensorflow"
    # --- structure (static shapes only) ---
    shape: Callable[[Any], tuple]  # shape(x) -> tuple of Python ints; ValueError if unknown
    dtype: Callable[[Any], str]  # dtype(x) -> dtype string
    reshape: Callable[[Any, tuple], Any]  # reshape(x, shape) -> view/copy of x in that shape
    concat: Callable[[list, int], Any]  # concat([x, ...], axis) along an existing axis
    transpose: Callable[[Any, tuple], Any]  # transpose(x, perm) -> x with axes permuted
    zeros: Callable[[tuple, str, Any], Any]  # zeros(shape, dtype, like): on like's device
    arange: Callable[[int, str, Any], Any]  # arange(n, dtype, like) -> [0, 1, ..., n-1]
    constant: Callable[[list, str, Any], Any]  # constant(nested Python list, dtype, like)
    cast: Callable[[Any, str], Any]  # cast(x, dtype): round-to-nearest for floats
    # scaled_cast(x float32, factor Python float, dtype) -> cast(x * factor, dtype): the product
    # rounded to float32, then to dtype (the bits of the two operations), in one pass where
    # the backend can; factor 1.0 is just the cast
    scaled_cast: Callable[[Any, float, str], Any]
    # --- elementwise math ---
    abs: Callable[[Any], Any]
    sqrt: Callable[[Any], Any]
    floor: Callable[[Any], Any]
    round: Callable[[Any], Any]  # round half to even (both frameworks' default)
    log2: Callable[[Any], Any]  # float32 log base 2 (last bits may differ between frameworks)
    exp2: Callable[[Any], Any]  # float32 2**x
    minimum: Callable[[Any, Any], Any]
    maximum: Callable[[Any, Any], Any]
    # clip(x float, lo, hi Python floats) -> min(max(x, lo), hi) in one pass (NaN stays NaN)
    clip: Callable[[Any, float, float], Any]
    where: Callable[[Any, Any, Any], Any]  # where(cond, a, b), broadcasting
    isfinite: Callable[[Any], Any]
    logical_and: Callable[[Any, Any], Any]
    # --- reductions (axis=None -> 0-d) ---
    sum: Callable[[Any, Any], Any]  # sum(x, axis)
    max: Callable[[Any, Any], Any]  # max(x, axis)
    all: Callable[[Any, Any], Any]  # all(bool_x, axis)
    count: Callable[[Any, Any], Any]  # count(bool_x, axis) -> int64 number of True, no cast pass
    # norm(x float, axis) -> the L2 norm along axis, sqrt(sum(x * x, axis)), in one reduction
    # (no x * x temporary: 1.8 ms against 3.9 ms for a 16 MiB [16384, 256] in PyTorch on CPU).
    # Not rescaled against overflow: callers pre-scale where squares could overflow.
    norm: Callable[[Any, Any], Any]
    # --- linear algebra ---
    matmul: Callable[[Any, Any], Any]  # matmul(a [.., n, k], b [.., k, m]) -> [.., n, m]
    # addmm(c [n, m], a [n, k], b [k, m], alpha Python float) -> c + alpha * (a @ b); may
    # reuse c's storage, so c must be a temporary the caller no longer needs (PyTorch updates
    # it in place: one pass over c instead of a product and a difference, 2-3x faster on CPU
    # for PowerSGD's residual M - P Q^T).
    addmm: Callable[[Any, Any, Any, float], Any]
    # --- selection ---
    top_k: Callable[[Any, int], Any]  # top_k(x 1-D, k) -> int64 indices of the k largest
    argsort: Callable[[Any], Any]  # argsort(x 1-D) -> int64, descending, stable (ties: lower index first)
    gather: Callable[[Any, Any], Any]  # gather(x, idx) -> x[idx] along axis 0
    scatter: Callable[[Any, Any, tuple], Any]  # scatter(idx, rows, shape) -> zeros(shape) with [idx] = rows
    # index_add(x, idx, rows) -> x with x[idx] += rows (idx unique); may reuse x's storage,
    # so x must be a temporary the caller no longer needs (PyTorch updates it in place).
    index_add: Callable[[Any, Any, Any], Any]
    # --- integer bit operations (int32/int64, non-negative operands) ---
    # bitcast(x, dtype) -> x's bits read as dtype of the same item size (int32 <-> float32),
    # no arithmetic (a view where the backend can).
    bitcast: Callable[[Any, str], Any]
    bitwise_and: Callable[[Any, Any], Any]
    bitwise_or: Callable[[Any, Any], Any]
    bitwise_xor: Callable[[Any, Any], Any]
    left_shift: Callable[[Any, Any], Any]
    right_shift: Callable[[Any, Any], Any]
    # --- control flow ---
    # cond(pred bool 0-d, true_fn, false_fn) -> the outputs of the branch pred selects; only
    # that branch runs (so it may hold collectives; all ranks must take the same branch).
    # Both return the same structure and dtypes; shapes may differ (TensorFlow relaxes the
    # static shape of such an output). PyTorch reads pred on the host: a device sync on GPU.
    cond: Callable[[Any, Callable, Callable], Any]
    # select(pred bool 0-d, true_fn, false_fn) -> true_fn() if pred else false_fn(): the
    # values of where(pred, a, b) without where's pass over a and b, for whole tensors (or
    # tuples / NamedTuples of them, None allowed) of equal shapes and dtypes. Never a device
    # sync: PyTorch branches in Python on a CPU pred (free: the value is already in host
    # memory) and on a GPU runs both functions and blends them with where; TensorFlow uses
    # tf.cond. So the functions must be pure (no collectives, no state updates), and select
    # is not for fused kernels (a Python branch inside torch.compile breaks the graph).
    select: Callable[[Any, Callable, Callable], Any]
    # --- side collective (synchronous, all ranks in the same order with the same name) ---
    # allreduce(x, op "sum"|"max", name, group) -> reduced x over the process set ``group``
    # (None: the global set). Only the blocking variants use it (see base.py); PyTorch gives
    # up with a RuntimeError after HVD_GRADCOMP_SIDE_TIMEOUT seconds (default 60) instead of
    # hanging.
    allreduce: Callable[[Any, str, str, Any], Any]
    # --- kernels ---
    # fuse(fn, plan) -> run(*tensors) == fn(ops, plan, *tensors). ``fn`` is a module-level
    # function of tensors only (no collectives, no host reads, no Python branches on tensor
    # values); ``plan`` is a hashable tuple of Python scalars, the same for every tensor a
    # scheme instance compresses with one world size (never a size: sizes come from the
    # tensors' shapes). With compile_requested() the backend compiles ``run`` once per
    # (fn, plan) for all shapes (torch.compile with dynamic shapes; XLA in TensorFlow), which
    # fuses the elementwise passes into a few loops; otherwise ``run`` calls ``fn`` directly.
    fuse: Callable[[Callable, tuple], Callable]
    # --- host (the one exception to rule 5; only ``auto`` uses them, see hvd_gradcomp/auto/) ---
    # to_host(x) -> x's values as Python numbers (a float/int for 0-d, nested lists else):
    # a device sync. ``auto`` reads its measurements and agreed statistics once per decision
    # window, never on the steps between.
    to_host: Callable[[Any], Any]
    # eager() -> True when tensors hold values now (PyTorch always; TensorFlow outside
    # tf.function), so that to_host can be called.
    eager: Callable[[], bool]


def compile_requested() -> bool:
    """True when ``HVD_GRADCOMP_COMPILE`` is ``1``/``true``/``on`` (read at each kernel's first
    use): the backends then compile ``fuse``d kernels (``torch.compile``, TensorFlow XLA).

    Off by default: compiling costs seconds per kernel when a job starts (measured and reported
    by ``python -m hvd_gradcomp.bench overhead --compile``), which pays only in long runs.

    Raises:
        ValueError: any other value than 0/1/true/false/on/off (empty = off).
    """
    import os
    value = os.environ.get(COMPILE_ENV, "").strip().lower()
    if value in ("", "0", "false", "off"):
        return False
    if value in ("1", "true", "on"):
        return True
    raise ValueError(f"{COMPILE_ENV} must be 0/1 (or true/false, on/off), got {value!r}")


def one_rank(ops: Primitives) -> Primitives:
    """``ops`` whose side all-reduce is the identity, which is what an all-reduce over a
    world of one rank returns. For running schemes without Horovod: scheme-level tests and
    the overhead benchmark (collective excluded)."""
    return dataclasses.replace(ops, allreduce=lambda x, op, name, group=None: x)
