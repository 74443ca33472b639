"""Horovod's grouped all-reduce (``num_groups``/``groups``), both frameworks.

TensorFlow's grouped all-reduce (``num_groups``/``groups``) sends a group in one collective,
which takes one dtype (``HorovodGroupedAllreduce`` has one type attribute), while a group may
hold payloads of several (THC's int32 words, fp16 for small tensors, PowerSGD's float32
factors). At the first member's ``compress`` the adapter compresses the whole group (Horovod's
frame holds it), and if the payload dtypes differ it casts each to the narrowest dtype that
holds every member's values and sums exactly (float16 + float32: float32; with int32 or
float64: float64), and back before ``decompress``: one collective per group as Horovod meant,
the same numbers as without groups, more bytes (``wire_bytes()`` counts them, a warning names
the tensors once). PyTorch's grouped all-reduce (``groups=``/``num_groups``) sends each group
as a bucket (:mod:`~hvd_gradcomp.buckets`, one codec call per route): the payloads are shared
out as one piece per tensor, views of one buffer per payload dtype that Horovod sums in place,
and the group's first ``decompress`` decodes every unit (docs/usage.md, "Grouped all-reduce").

The three entry points are functions over a Horovod compressor
(:class:`hvd_gradcomp.adapter.HorovodCompressor`, whose ``compress``/``decompress`` call them):
they keep the group being returned in its ``in_group`` and ``pieces``, find a member's call
through its ``frontend`` and compress through its ``codec`` (``encode_call``, ``plan_bucket``).
"""
import logging
from typing import Any, NamedTuple

from .calls import Call
from .horovod_ops import group_dtype
from .payloads import pack_payloads, unpack_payloads
from .primitives import FLOAT_DTYPES, itemsize

__all__ = ["compress_grouped", "compress_bucket", "decompress_piece", "WidenedCtx", "PieceCtx", "GroupBatch", "narrowed"]

log = logging.getLogger("hvd_gradcomp")


class PieceCtx(NamedTuple):
    """The ctx of one tensor of a PyTorch grouped all-reduce sent as a bucket: its share of the
    bucket's payloads (``index`` in the batch's pieces) and the batch."""

    index: int
    batch: Any  # GroupBatch


class GroupBatch:
    """One grouped all-reduce's bucket: the plan, each unit's ctx, the packed payloads
    (:class:`~hvd_gradcomp.payloads.Packed`: one buffer per dtype, which the members' pieces
    are views of), and the decoded gradients once decoded."""

    __slots__ = ("plan", "ctxs", "packed", "pieces", "outs", "left")

    def __init__(self, plan, ctxs, packed, pieces):
        self.plan, self.ctxs, self.packed, self.pieces = plan, ctxs, packed, pieces
        self.outs, self.left = None, len(pieces)


def narrowed(ops, payload, dtype: str):
    """A widened payload (:func:`~hvd_gradcomp.horovod_ops.group_dtype`) back in its own
    ``dtype``. int32 words come back modulo ``2**32`` (via int64; the float64 sum is exact, and
    a Sum of THC's ``subtract_own`` words may pass int32's range, which the int32 all-reduce
    would have wrapped); for values inside int32 this is the plain cast (toward zero)."""
    if dtype != "int32":
        return ops.cast(payload, dtype)
    wide = ops.cast(payload, "int64")
    return ops.cast(ops.bitwise_and(wide + 2 ** 31, 0xFFFFFFFF) - 2 ** 31, "int32")


class WidenedCtx(NamedTuple):
    """A payload widened for a TensorFlow group: cast the reduced one back to ``dtype`` first."""

    dtype: str
    inner: Any  # _AdapterCtx, or None for a tensor that passed through


def compress_grouped(comp, tensor, call: Call):
    """A member of a TensorFlow grouped all-reduce: the whole group is compressed at its
    first member, with one payload dtype (module docstring); the others are returned as
    Horovod asks for them."""
    group = call.group
    if comp.in_group is not None and comp.in_group[0] is group:
        done = comp.in_group[1].pop(id(tensor), None)
        if done is not None:
            if not comp.in_group[1]:
                comp.in_group = None
            return done
    results, keys = {}, {}
    for member in group:
        if id(member) in results:
            continue
        member_call = call if member is tensor else comp.frontend.find_call(member)
        payload, ctx, key = comp.codec.encode_call(member, member_call, comp.frontend.no_key_message)
        results[id(member)], keys[id(member)] = (payload, ctx), key
    dtypes = {i: comp.codec.ops.dtype(p) for i, (p, _) in results.items()}
    try:
        common = group_dtype(dtypes.values())
    except ValueError as e:
        raise ValueError(f"{comp.codec.spec}: grouped all-reduce of "
                         f"{[keys[i] for i in results]}: {e}; use groups=None") from None
    if common is not None:
        extra = 0
        for i, (payload, ctx) in list(results.items()):
            if dtypes[i] == common:
                continue
            results[i] = (comp.codec.ops.cast(payload, common), WidenedCtx(dtypes[i], ctx))
            key = keys[i]
            if key is not None and key in comp.codec.tensors.wire:
                w = comp.codec.tensors.wire[key]
                wide = w.payload * itemsize(common) // itemsize(dtypes[i])
                extra += wide - w.payload
                comp.codec.tensors.wire[key] = w._replace(payload=wide)
        members = tuple(sorted((str(keys[i]), dtypes[i]) for i in results))
        if members not in comp.warned:
            comp.warned.add(members)
            hint = ("route the group's small tensors to thc as well ('thc:min_numel=1')"
                    if "int32" in dtypes.values() else "route a group's tensors to schemes of one "
                    "payload dtype")
            log.warning("hvd_gradcomp: TensorFlow grouped all-reduce of %s: Horovod's grouped "
                        "all-reduce takes one dtype, so these payloads travel as %s (exact; %d more "
                        "bytes per step). To avoid it, %s, or use groups lists that keep them apart.",
                        ", ".join(f"{k} ({d})" for k, d in members), common, extra, hint)
    mine = results.pop(id(tensor))
    comp.in_group = (group, results) if results else None
    return mine


def compress_bucket(comp, tensor, call: Call):
    """A member of a PyTorch grouped all-reduce (``groups=``/``num_groups``): at the first
    member the whole group is compressed as one bucket (one codec call per route,
    :mod:`~hvd_gradcomp.buckets`) and its payloads are shared out as one piece per member
    (views of one buffer per payload dtype, which Horovod's in-place grouped all-reduce
    sums); the others get their piece. None when the group cannot go as a bucket (mixed
    dtypes, a gradient that is not a float tensor): then each member is compressed alone."""
    ops = comp.codec.ops
    if comp.pieces is not None:
        done = comp.pieces.pop(id(tensor), None)
        if done is not None:
            return done
    grads = [g for _, g in call.bucket]
    dtypes = {ops.dtype(g) for g in grads}
    if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_DTYPES or \
            any(comp.frontend.is_sparse(g) for g in grads) or all(g is not tensor for g in grads):
        return None
    from .buckets import Member
    dtype = dtypes.pop()
    members, offset = [], 0
    for (name, g) in call.bucket:
        key = comp.codec.tensors.key(Call(key=name, owner=call.owner))
        shape = tuple(ops.shape(g))
        numel = 1
        for s in shape:
            numel *= s
        members.append(Member(key, name, shape, offset, numel))
        offset += numel
    flat = ops.concat([ops.reshape(comp.frontend.detach(g), (-1,)) for g in grads], 0)
    plan = comp.codec.plan_bucket(members, dtype, call.op,  # (its members checked against the call's op)
                            call.process_set, flat)
    encoded = [comp.codec.encode_unit(unit, flat[unit.start:unit.stop] if unit.contiguous
                                else ops.gather(flat, unit.index)) for unit in plan.units]
    packed = pack_payloads(ops, [p for p, _ in encoded])
    buffers = packed.buffers
    sizes = [ops.shape(b)[0] for b in buffers]
    if len(grads) < len(buffers) or sum(sizes) < len(grads):
        return None  # (a tiny group: fewer elements than members) compressed one by one
    # one piece per member: every buffer one, the rest cut from the largest
    counts = [1] * len(buffers)
    counts[sizes.index(max(sizes))] += len(grads) - len(buffers)
    if max(sizes) < counts[sizes.index(max(sizes))]:
        return None
    pieces = []
    for buf, size, k in zip(buffers, sizes, counts):
        bounds = [size * j // k for j in range(k + 1)]
        pieces.extend(buf[bounds[j]:bounds[j + 1]] for j in range(k))
    batch = GroupBatch(plan, [c for _, c in encoded], packed, pieces)
    results = {id(g): (piece, PieceCtx(j, batch)) for j, (g, piece) in enumerate(zip(grads, pieces))}
    mine = results.pop(id(tensor))
    comp.pieces = results or None
    return mine

def decompress_piece(comp, payload, ctx: "PieceCtx"):
    """A grouped member's decoded gradient: at the batch's first decompress every unit is
    decoded from the summed buffers (Horovod's grouped all-reduce sums the pieces in place,
    so the buffers hold every member's sum by then)."""
    batch = ctx.batch
    if payload is not batch.pieces[ctx.index]:
        raise RuntimeError(f"{comp.codec.spec}: a grouped all-reduce returned a new tensor for piece "
                           f"{ctx.index} instead of summing it in place (Horovod's "
                           f"grouped_allreduce_async_ does); the bucket cannot be decoded")
    if batch.outs is None:
        ops, plan = comp.codec.ops, batch.plan
        outs = [ops.reshape(comp.decompress(p, uctx), (-1,))
                for uctx, p in zip(batch.ctxs, unpack_payloads(ops, batch.packed))]
        if all(u.contiguous for u in plan.units):  # the units partition the flat vector
            order = sorted(range(len(outs)), key=lambda i: plan.units[i].start)
            full = outs[order[0]] if len(order) == 1 else ops.concat([outs[i] for i in order], 0)
        else:
            total = plan.members[-1].offset + plan.members[-1].numel
            full = ops.zeros((total,), plan.dtype, outs[0])
            for unit, out in zip(plan.units, outs):
                index = unit.index if not unit.contiguous else ops.arange(unit.stop - unit.start, "int64", out) + unit.start
                full = ops.index_add(full, index, out)
        batch.outs = [ops.reshape(full[m.offset:m.offset + m.numel], m.shape) for m in plan.members]
    batch.left -= 1
    out = batch.outs[ctx.index]
    if batch.left == 0:
        batch.outs = batch.pieces = None
    return out
