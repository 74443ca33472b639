"""A reduce-scatter's decode (FSDP2's, :func:`torch_backend.fsdp.install_reduce_scatter`), as a
function over a :class:`~hvd_gradcomp.codec.Codec` (whose ``decode_scattered`` calls it): every
rank sent the tensor; one rank, the destination, received the sum of its values; every rank
the sum of its agreed part (:func:`~hvd_gradcomp.composite.scatter_split`).
"""
from . import composite
from .base import HALF_MAX, EmptyState, saturate_output
from .calls import scheme_info

__all__ = ["decode_scattered"]


def decode_scattered(codec, values, agreed, ctx, divide=None):
    """One tensor's step after a reduce-scatter of its payload (FSDP2's,
    :func:`torch_backend.fsdp.install_reduce_scatter`): every rank sent the tensor; one
    rank, the destination, received the sum of its values; every rank the sum of its
    agreed part.

    Args:
        values: on the destination, the summed values (``payload[:split]``, ``split`` the
            :func:`~hvd_gradcomp.composite.scatter_split` of the tensor's scheme; 1-D, the
            payload's dtype); None on every other rank.
        agreed: the summed agreed part (``payload[split:]``, 1-D, possibly empty), the same
            bit for bit on every rank.
        ctx: ``codec.encode``'s (or ``encode_unit``'s) ctx on this rank.
        divide: as ``codec.decode`` (None: the sum; n: divided by n in float32).

    The state steps, on every rank, by ``receive`` and ``finish`` of the payload with its
    values zeroed, so the fields the ranks agree on stay equal everywhere and each rank's
    own fields (error feedback: what it sent of the tensor) move on; the destination
    decompresses the whole payload with the same ``receive`` ctx. A half-precision output
    is clamped as in ``codec.decode``, the destination keeping all of the excess (no other
    rank sees the output). Returns the decoded tensor in the gradient's shape and dtype on
    the destination, else None.

    Raises:
        ValueError: the tensor's scheme has no split (``scatter_split`` None), or ``values``
            is not as long as its split says; before any state moves.
    """
    ops = codec.ops
    decode = values is not None
    if ctx is None:  # passed through as it is (none): the payload is the values
        if not decode:
            return None
        return values if divide is None else values / divide
    info, inner, scale, scheme = ctx
    sinfo = scheme_info(info, scale)
    has_state = codec.store.has(info.key)
    if not decode and not has_state:
        return None
    state = codec.store.read(info.key) if has_state else EmptyState()
    payload = None
    if decode:
        payload = values if ops.shape(agreed)[0] == 0 else ops.concat([values, agreed], 0)
    if not has_state:  # by the contract receive reads the agreed part only
        masked = payload
    else:
        split = _split_of(codec, scheme, sinfo, ops.shape(agreed)[0], values)
        masked = ops.concat([ops.zeros((split,), ops.dtype(agreed), agreed), agreed], 0) if split else agreed
    inner = scheme.receive(ops, masked, inner, sinfo)
    new_state = scheme.finish(ops, masked, inner, state, sinfo) if has_state else state
    out = None
    if decode:
        out = ops.reshape(scheme.decompress(ops, payload, inner, sinfo), info.shape)
        if divide is not None:
            out = out * (1.0 / divide)
        if info.dtype in HALF_MAX:
            out, new_state = saturate_output(scheme, ops, out, new_state, sinfo, HALF_MAX[info.dtype], scale,
                                             keep=1.0 if divide is None else float(divide))
        if scale is not None:
            out = out * scale
        if info.dtype != "float32":
            out = ops.cast(out, info.dtype)
    if has_state and new_state is not state:
        codec.store.write(info.key, new_state)
    return out

def _split_of(codec, scheme, info, agreed: int, values) -> int:
    """The values' length of ``scheme``'s payload for ``info`` (ValueError where the scheme
    cannot be reduce-scattered, or the parts do not add up)."""
    ops = codec.ops
    split = composite.scatter_split(scheme, info)
    if split is None:
        raise ValueError(f"{scheme.spec()}: tensor {info.key!r} cannot be reduce-scattered "
                         f"(hvd_gradcomp.composite.scatter_split)")
    if values is not None and ops.shape(values)[0] != split:
        raise ValueError(f"{scheme.spec()}: tensor {info.key!r}: {tuple(values.shape)[0]} values "
                         f"reduce-scattered, its payload has {split} (and {agreed} agreed)")
    return split
