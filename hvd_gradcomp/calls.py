"""What the adapters know about one compress call and its result: :class:`Call` (read from
Horovod's calling frame, or given by an engine), the ctx ``decompress`` gets back, and the
float32 view a loss scale puts the scheme under. No framework imports."""
import dataclasses
from typing import Any, NamedTuple

from .base import Scheme, TensorInfo

__all__ = ["Call", "AdapterCtx", "scheme_info"]


class Call(NamedTuple):
    """What the adapters learn from Horovod's calling frame about one compress call.

    key: Horovod's name for the tensor (parameter name, variable position, ``name=``), or None.
    op: ``"sum" "average" "adasum" "min" "max" "product"``, or None when unknown.
    prescale, postscale: the factors Horovod will multiply the payload by before and after the
        reduction (``gradient_predivide_factor`` f gives 1/f and f under Average); 1.0 when none.
    process_set: the framework's process set of the all-reduce, or None for the global one.
    owner: what the key belongs to, stable across steps: the PyTorch optimizer, or the
        TensorFlow variable; a second owner under the same key gets its own state
        (``key@1``, ``key@2``, ... in order of first use), or None.
    filled_in: True when Horovod's ``synchronize()`` is filling in a gradient this rank never
        computed (an unused parameter): its collectives run in an order that differs between
        ranks.
    shape: the static shape of the tensor's variable, when the gradient's own shape has
        unknown dimensions (TensorFlow ``sparse_as_dense``); None otherwise.
    label: the name routing rules match (:mod:`~hvd_gradcomp.routing`); None: ``key``.
    pin: TensorFlow: the variable's ``ref()``, under which ``route()`` stored the decision
        (variable names may differ between ranks); None: decide from ``label``.
    group: TensorFlow ``grouped_allreduce``: the list of the group's tensors (one collective,
        one dtype); None otherwise.
    batch: TensorFlow ``allreduce_grads``: its ``(grads, vars)``, where sparse gradients
        (``IndexedSlices``, which bypass compress) are found; None otherwise.
    bucket: PyTorch ``hvd.DistributedOptimizer(groups=...)``: the group's ``(key, gradient)``
        pairs in Horovod's order (one grouped all-reduce), compressed as one bucket
        (:mod:`~hvd_gradcomp.buckets`); None otherwise.
    """

    key: Any = None
    op: Any = None
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: Any = None
    owner: Any = None
    filled_in: bool = False
    shape: Any = None
    label: Any = None
    pin: Any = None
    group: Any = None
    batch: Any = None
    bucket: Any = None


class AdapterCtx(NamedTuple):
    """What ``decompress`` needs of one compress call."""

    info: TensorInfo
    inner: Any  # the scheme's ctx
    scale: Any  # the loss scale divided out (0-d float32 tensor), or None
    scheme: Scheme  # the route's scheme


def scheme_info(info: TensorInfo, scale) -> TensorInfo:
    """The :class:`TensorInfo` the scheme works under: with a loss ``scale`` (not None) the
    gradient is divided by it in float32, so ``info`` as float32; else ``info`` itself."""
    return info if scale is None or info.dtype == "float32" else dataclasses.replace(info, dtype="float32")
