"""PyTorch implementation of :class:`hvd_gradcomp.primitives.Primitives`: :data:`OPS`, the
primitives of :data:`torch_backend.reference_ops.REFERENCE_OPS` with the fusing ``fuse``
(hand-written fused forms of :mod:`torch_backend.kernels`, else the reference composition,
compiled when ``HVD_GRADCOMP_COMPILE`` asks for it)."""
import dataclasses
import os

import torch

from hvd_gradcomp.primitives import COMPILE_ENV, compile_requested

from .kernels import ENV as _KERNELS_ENV, dispatch
from .reference_ops import REFERENCE_OPS, exact_addmm, exact_matmul, reduced_fp32, to_torch_dtype

__all__ = ["OPS", "COMPILED_OPS", "REFERENCE_OPS", "to_torch_dtype"]

_KERNELS = {}


def _fuse_eager(fn, plan):
    """``Primitives.fuse`` without a compiler: ``fn(OPS, plan, *tensors)`` op by op."""
    return lambda *tensors: fn(OPS, plan, *tensors)


def _fuse_compiled(fn, plan):
    """``Primitives.fuse`` through Inductor (C++/OpenMP loops on CPU, Triton on GPU).

    One ``torch.compile`` per (fn, plan, exact), every tensor dimension dynamic from the first
    call, so all tensor sizes share one compiled kernel (Dynamo still specialises sizes 0 and
    1); the plan's ints stay constants. Dynamo caches compiled code per code object and caps the
    entries of each, so each kernel gets its own copy of the wrapper's code object: kernels
    never evict one another. If the first compiled call fails (no C++ compiler, an unsupported
    build) the kernel runs uncompiled from then on and one warning says why.

    ``exact``: the user's float32 matmul setting, read at each call outside the compiled code
    (:func:`reduced_fp32`; Dynamo cannot trace those getters). Under a reduced setting (TF32,
    bfloat16) the kernel's variant whose products run in float64 is called
    (:func:`exact_matmul` with ``force``), so the compiled rotation stays exact whatever the
    setting; otherwise the plain variant, whose products read the (full) setting when they run.
    """
    def run(*tensors):
        cuda = any(getattr(t, "is_cuda", False) for t in tensors)
        return _compiled_kernel(fn, plan, reduced_fp32(cuda))(*tensors)
    return run


def _compiled_kernel(fn, plan, exact):
    """The compiled kernel of :func:`_fuse_compiled` for one (fn, plan, exact)."""
    key = (fn, plan, exact)
    run = _KERNELS.get(key)
    if run is not None:
        return run
    import types
    import warnings

    def call(*tensors):
        return fn(EXACT_OPS if exact else OPS, plan, *tensors)

    code = call.__code__.replace(co_name=f"hvd_gradcomp_{fn.__name__}_{len(_KERNELS)}")
    compiled_fn = torch.compile(types.FunctionType(code, call.__globals__, code.co_name, None,
                                                   call.__closure__), fullgraph=True)

    def compiled(*tensors):
        for t in tensors:
            for dim in range(t.dim() if t is not None else 0):  # (None: an optional input left out)
                torch._dynamo.maybe_mark_dynamic(t, dim)
        return compiled_fn(*tensors)

    def first(*tensors):
        try:
            out = compiled(*tensors)
            _KERNELS[key] = compiled
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back, once
            warnings.warn(f"hvd_gradcomp: torch.compile of kernel {fn.__name__} failed "
                          f"({type(exc).__name__}: {exc}); running it uncompiled", RuntimeWarning)
            _KERNELS[key] = call
            out = call(*tensors)
        return out

    _KERNELS[key] = first
    return first


# (fn, plan, HVD_GRADCOMP_COMPILE, HVD_GRADCOMP_KERNELS) -> the runner _fuse built for them
_FUSED = {}
# The two switches' values, read at each call: os.environ's own store (bytes keys on POSIX)
# where it has one, a dict lookup each instead of os.environ.get's encode and decode (a THC
# call makes seven fuse calls; docs/bench.md, "THC's per-call cost").
_ENV_STORE = getattr(os.environ, "_data", None) if os.name == "posix" else None
_SWITCHES = (COMPILE_ENV.encode(), _KERNELS_ENV.encode())


def _switches():
    if _ENV_STORE is not None:
        return _ENV_STORE.get(_SWITCHES[0]), _ENV_STORE.get(_SWITCHES[1])
    return os.environ.get(COMPILE_ENV), os.environ.get(_KERNELS_ENV)


def _fuse(fn, plan):
    """``Primitives.fuse``: a hand-written fused form of ``fn`` where one is registered for the
    tensors' device type (:mod:`torch_backend.kernels`: Triton on CUDA, compiled loops on the
    CPU), else the reference composition, compiled when ``HVD_GRADCOMP_COMPILE`` asks for it
    (:func:`hvd_gradcomp.primitives.compile_requested`), else op by op. The runner is built once
    per kernel, plan and value of the two switches (both still read at each call)."""
    key = (fn, plan) + _switches()
    run = _FUSED.get(key)
    if run is None:
        reference = (_fuse_compiled if compile_requested() else _fuse_eager)(fn, plan)
        run = _FUSED[key] = dispatch(fn, plan, reference)
    return run


# The reference primitives with the fusing fuse (the fused forms' contract: torch_backend.kernels).
OPS = dataclasses.replace(REFERENCE_OPS, fuse=_fuse)

# The same primitives with every fused kernel compiled, whatever the environment says (the
# overhead benchmark times both side by side).
COMPILED_OPS = dataclasses.replace(OPS, fuse=_fuse_compiled)

# The primitives a compiled kernel's exact variant traces: float32 products always in float64
# (_fuse_compiled; the user's setting is reduced when that variant runs).
EXACT_OPS = dataclasses.replace(OPS, matmul=lambda a, b: exact_matmul(a, b, force=True),
                                addmm=lambda c, a, b, alpha: exact_addmm(c, a, b, alpha, force=True))
