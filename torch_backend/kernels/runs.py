"""Gather and write back a bucket's flat group that is not contiguous in the bucket; write a
contiguous one's decoded values unless the decode already wrote them there.

A DDP bucket (:mod:`torch_backend.ddp`, FSDP's flat shards) may hold the tensors of one flat
group (:mod:`hvd_gradcomp.buckets`) with tensors of other routes between them (e.g. THC's
matrices between the biases and norms sent as fp16). The group's coordinates are then a few
runs of the buffer (:attr:`~hvd_gradcomp.buckets.Unit.runs`). On the CPU these functions copy
them run by run with ``memcpy`` (``csrc/runs.c``): no framework operation and no index read,
where ``index_select``/``index_copy_`` with one int64 index per coordinate cost 3-5x a copy
(5.2M coordinates in 16 runs, one thread: 5.7 and 8.6 ms against 1.5 and 1.6 ms). Elsewhere
(a GPU, no compiler) they are those two operations, one each.
"""
import ctypes
import functools

import torch

__all__ = ["gather", "scatter", "write_into"]

_lib = None
_why = None


def _library():
    global _lib, _why
    if _lib is None and _why is None:
        try:
            from . import cbuild
            lib = cbuild.load("runs")
            lib.hgc_copy_runs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_int64]
            lib.hgc_copy_runs.restype = None
            _lib = lib
        except ImportError as exc:  # no compiler: the index operations
            _why = str(exc)
    return _lib


@functools.lru_cache(maxsize=256)
def _flat_runs(runs):
    """The runs ``((start, stop), ...)`` as a ctypes int64 array of their 2 r positions (per
    plan: the same tuple at every step)."""
    return (ctypes.c_int64 * (2 * len(runs)))(*(p for run in runs for p in run))


def _direct(buffer) -> bool:
    return (buffer.device.type == "cpu" and buffer.is_contiguous() and not torch.compiler.is_compiling()
            and _library() is not None)


def gather(buffer, unit):
    """The unit's coordinates of ``buffer`` (1-D, any dtype), packed in the unit's order: a new
    tensor [unit.info.numel] of the buffer's dtype and device (``buffer[unit.index]``)."""
    if not _direct(buffer) or not unit.runs:
        return buffer.index_select(0, unit.index)
    out = torch.empty(unit.index.shape[0], dtype=buffer.dtype)
    _lib.hgc_copy_runs(buffer.data_ptr(), out.data_ptr(), _flat_runs(unit.runs), len(unit.runs), buffer.element_size(), 1)
    return out


def scatter(buffer, unit, values):
    """Write ``values`` (1-D [unit.info.numel], cast to the buffer's dtype) into the unit's
    coordinates of ``buffer`` in place (``buffer[unit.index] = values``)."""
    if values.dim() != 1:  # (1-D already, or of the buffer's dtype: no operation recorded)
        values = values.reshape(-1)
    if values.dtype != buffer.dtype:
        values = values.to(buffer.dtype)
    if not _direct(buffer) or not unit.runs or values.device.type != "cpu":
        buffer.index_copy_(0, unit.index, values)
        return
    values = values.contiguous()
    _lib.hgc_copy_runs(buffer.data_ptr(), values.data_ptr(), _flat_runs(unit.runs), len(unit.runs), buffer.element_size(), 0)


def write_into(dst, values):
    """Copy ``values`` (the unit's decoded values, any shape of ``dst.numel()``) into ``dst`` (a
    contiguous unit's slice of the bucket), unless they already are ``dst``'s storage (a decode
    that wrote into it: :meth:`hvd_gradcomp.codec.Codec.decode`'s ``into``)."""
    if values.data_ptr() == dst.data_ptr() and values.dtype == dst.dtype and values.is_contiguous():
        return
    dst.copy_(values if values.dim() == 1 else values.reshape(-1))
