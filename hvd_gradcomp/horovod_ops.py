"""What Horovod does with a payload, as the adapters need to know it: the name of an op
constant, the dtype of a TensorFlow grouped all-reduce, and whether an Average on a GPU is
NCCL's ``ncclAvg`` (which divides by n before summing). Facts read from Horovod 0.28.1's
sources. :class:`HorovodCollectives`: the codec's collectives outside compress when no engine
is bound (Horovod's world, object gather and blocking all-reduce).
"""
__all__ = ["op_name", "group_dtype", "horovod_nccl_avg", "nccl_avg_rule", "HorovodCollectives"]


class HorovodCollectives:
    """Horovod's collectives as a codec uses them outside compress (route checks, checkpoints,
    link calibration), for a compressor with no engine bound.

    Args:
        horovod: a callable returning the framework's Horovod module (``horovod.torch`` or
            ``horovod.tensorflow``), imported when first needed.
    """

    __slots__ = ("horovod",)

    def __init__(self, horovod):
        self.horovod = horovod

    def world(self, process_set=None):
        """(size, rank) of ``process_set`` (None: the global set). Raises ValueError before
        ``hvd.init()`` and ImportError without Horovod, as Horovod does."""
        hvd = self.horovod()
        if process_set is None or getattr(process_set, "process_set_id", 0) == 0:
            return hvd.size(), hvd.rank()
        return process_set.size(), process_set.rank()

    def gather(self, obj, name: str) -> list:
        """``[obj of rank 0, 1, ...]`` on every rank of the global set: one
        ``hvd.broadcast_object`` per rank, in rank order."""
        hvd = self.horovod()
        return [hvd.broadcast_object(obj, root_rank=r, name=f"{name}.{r}") for r in range(hvd.size())]

    def allreduce(self, x, average: bool, name: str, process_set=None):
        """``x`` summed (``average``: averaged) over ``process_set``, blocking."""
        hvd = self.horovod()
        kwargs = {} if process_set is None else {"process_set": process_set}
        return hvd.allreduce(x, op=hvd.Average if average else hvd.Sum, name=name, **kwargs)

    def nccl_avg(self) -> bool:
        """:func:`horovod_nccl_avg` of this Horovod."""
        return horovod_nccl_avg(self.horovod())


def group_dtype(dtypes):
    """The payload dtype a TensorFlow grouped all-reduce of payloads of ``dtypes`` uses.

    None when they are all one dtype (nothing to do). float16 and float32 -> float32 (every
    float16 is a float32, and the sum is at least as exact). With int32 or float64 -> float64:
    its 53-bit mantissa holds every float32 and int32 value and their sums over ranks exactly,
    and Horovod's Average of a float64 word, ``W * (1/n)``, truncated back to int32, is what it
    computes for an int32 word. A Sum that passes int32's range (THC's ``subtract_own`` words)
    comes back modulo ``2**32``, as the int32 all-reduce wraps it
    (:func:`hvd_gradcomp.grouped.narrowed`).

    Raises:
        ValueError: a mix no dtype holds exactly (e.g. int64 with floats).
    """
    dtypes = set(dtypes)
    if len(dtypes) <= 1:
        return None
    if dtypes <= {"float16", "float32"}:
        return "float32"
    if dtypes <= {"float16", "float32", "float64", "int32"}:
        return "float64"
    raise ValueError(f"no payload dtype holds payloads of dtypes {sorted(dtypes)} exactly")


# NCCL_VERSION(2, 10, 0): Horovod 0.28.1 sends Average as ncclAvg from this NCCL on.
_NCCL_AVG_VERSION = 21000


def _env_int(environ, name) -> int:
    """``strtol(environ[name])`` as Horovod reads its switches (leading integer, else 0)."""
    import re
    m = re.match(r"\s*([+-]?\d+)", environ.get(name, ""))
    return int(m.group(1)) if m else 0


def horovod_nccl_avg(hvd, environ=None) -> bool:
    """True when Horovod (``hvd``: horovod.torch or horovod.tensorflow, initialised) all-reduces
    a GPU tensor under ``op=Average`` with ``ncclAvg``, which multiplies each rank's payload by
    1/n in the payload's dtype before summing (so schemes must not pre-scale by 1/n as well:
    :attr:`hvd_gradcomp.base.TensorInfo.prescale`).

    From Horovod 0.28.1's ``horovod/common/ops/nccl_operations.cc`` and ``operations.cc``: the
    flat ``NCCLAllreduce`` uses ``ncclAvg`` when built with NCCL >= 2.10 (``hvd.nccl_built()``
    returns NCCL's version code), not for ROCm; the hierarchical and torus all-reduces (chosen
    by ``HOROVOD_HIERARCHICAL_ALLREDUCE`` / ``HOROVOD_TORUS_ALLREDUCE`` > 0, on more than one
    node) sum and scale by 1/n afterwards instead. Not seen from here: a build whose GPU
    all-reduce is MPI (``HOROVOD_GPU_ALLREDUCE=MPI``) with NCCL for other ops, and an autotuner
    (``HOROVOD_AUTOTUNE``) that switches to the hierarchical all-reduce during the run; pin
    ``HOROVOD_HIERARCHICAL_ALLREDUCE=0`` with autotuning (docs/gpu.md).
    """
    import os
    return nccl_avg_rule(int(hvd.nccl_built()), bool(hvd.rocm_built()), hvd.size(), hvd.local_size(),
                         os.environ if environ is None else environ)


def nccl_avg_rule(nccl_version: int, rocm: bool, size: int, local_size: int, environ) -> bool:
    """:func:`horovod_nccl_avg` from the facts it reads: Horovod's ``nccl_built()`` (NCCL's
    version code, 0 without NCCL), ``rocm_built()``, ``size()``, ``local_size()`` and the
    environment (a mapping)."""
    if nccl_version < _NCCL_AVG_VERSION or rocm:
        return False
    if size == local_size:
        return True  # one node: Horovod ignores the hierarchical and torus switches
    return (_env_int(environ, "HOROVOD_HIERARCHICAL_ALLREDUCE") <= 0
            and _env_int(environ, "HOROVOD_TORUS_ALLREDUCE") <= 0)


def op_name(hvd, op, average=None) -> str:
    """Horovod's op constant ``op`` (or the deprecated ``average`` flag when ``op`` is None) as
    a lower-case name: ``"average" "sum" "adasum" "min" "max" "product"``; ``hvd`` is the
    framework's Horovod module."""
    if op is None:
        return "average" if average is None or average else "sum"
    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if getattr(hvd, name, object()) == op:
            return name.lower()
    return str(op)
