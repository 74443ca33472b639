"""One collective per payload dtype: the pack, post and unpack that every engine runs.

A bucket's units encode to payloads of one or more dtypes (THC's int32 words and the float16
of its small tensors; PowerSGD's float32 factors). An engine sends them as one flat buffer per
payload dtype, summed elementwise by its collective, and hands each unit its part of the
reduced buffers. :func:`pack_payloads` builds the buffers and the spans, :func:`post_payloads`
packs and posts each buffer with the engine's ``post``, :func:`unpack_payloads` cuts reduced
buffers (or the packed ones, summed in place) back into payloads. Framework-free: tensors
through the primitives table (``ops``).

Engines calling them: the DDP hook (:mod:`torch_backend.ddp`), Horovod's PyTorch groups sent
as a bucket (:mod:`hvd_gradcomp.grouped`), FSDP2's all-reduce across replicas
(:mod:`torch_backend.fsdp`). Not these: FSDP2's compressed reduce-scatter
(:mod:`torch_backend.fsdp_scatter`: one region per destination rank, its values and every
unit's agreed part, not one buffer of whole payloads) and update sync
(:mod:`torch_backend.update_sync_rounds`: one all-reduce per tensor; packed, its float sums
change on 3 or more ranks, as the ring's chunk boundaries move).
"""
from typing import NamedTuple

__all__ = ["Packed", "pack_payloads", "post_payloads", "unpack_payloads"]


class Packed(NamedTuple):
    """Payloads packed for the wire.

    buffers: one flat (1-D) buffer per payload dtype, in the order of the dtypes' names
        (``"float16"`` before ``"int32"``); a dtype's only payload, 1-D already, is the buffer
        itself (no copy).
    spans: per payload, in the order given: ``(buffer index, offset, numel, shape)``
        (elements; ``shape`` the payload's, a tuple).
    """

    buffers: list
    spans: tuple


def _flat(ops, x, shape):
    return x if len(shape) == 1 else ops.reshape(x, (-1,))


def pack_payloads(ops, payloads, copy: bool = False) -> Packed:
    """``payloads`` (tensors of any shapes and dtypes) packed into one flat buffer per dtype.

    Args:
        ops: the backend's primitives (``dtype``, ``shape``, ``reshape``, ``concat``).
        payloads: a sequence of tensors.
        copy: every buffer a new tensor (one concat per dtype), never a payload itself: for an
            engine whose payload may be a view of a buffer it changes while the collective is
            in flight (FSDP's overlap zeroes its output; a ``none`` unit's payload is a view).

    Returns :class:`Packed`. Copies only where a dtype has several payloads (one concat), or
    with ``copy``.
    """
    by_dtype = {}
    for i, p in enumerate(payloads):
        by_dtype.setdefault(ops.dtype(p), []).append(i)
    buffers, spans = [], [None] * len(payloads)
    for dtype in sorted(by_dtype):
        parts, at = [], 0
        for i in by_dtype[dtype]:
            shape = tuple(ops.shape(payloads[i]))
            numel = 1
            for s in shape:
                numel *= s
            parts.append(_flat(ops, payloads[i], shape))
            spans[i] = (len(buffers), at, numel, shape)
            at += numel
        buffers.append(parts[0] if len(parts) == 1 and not copy else ops.concat(parts, 0))
    return Packed(buffers, tuple(spans))


def post_payloads(ops, payloads, post, copy: bool = False):
    """Pack ``payloads`` (``copy``: as :func:`pack_payloads`) and post each buffer:
    ``(packed, [post(buffer), ...])``.

    ``post(buffer)`` is the engine's collective (e.g. an asynchronous all-reduce returning a
    work or future); called once per payload dtype, in the buffers' order, so every rank posts
    the same sequence."""
    packed = pack_payloads(ops, payloads, copy)
    return packed, [post(b) for b in packed.buffers]


def unpack_payloads(ops, packed: Packed, reduced=None, view=None) -> list:
    """The payloads of ``packed`` read back from ``reduced`` (one flat buffer per dtype, as
    ``packed.buffers``; default: ``packed.buffers`` themselves, for a collective that sums in
    place). Returns one tensor per payload, in ``packed``'s order, each a view of its buffer in
    the payload's shape (a buffer holding one payload: the buffer itself, reshaped).
    ``view(part, shape)``: how a 1-D part takes a payload's shape (default ``ops.reshape``; an
    engine may pass a cheaper one, e.g. ``torch.Tensor.view``: one operation instead of two)."""
    reduced = packed.buffers if reduced is None else reduced
    view = ops.reshape if view is None else view
    sole = [0] * len(reduced)
    for b, _, _, _ in packed.spans:
        sole[b] += 1
    out = []
    for b, at, numel, shape in packed.spans:
        flat = reduced[b]
        part = flat if sole[b] == 1 else flat[at:at + numel]
        out.append(part if tuple(ops.shape(part)) == shape else view(part, shape))
    return out
