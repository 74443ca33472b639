"""What a codec reports, as functions over a :class:`~hvd_gradcomp.codec.Codec` (the
compressor's ``wire_bytes()``, ``bytes_per_step()``, ``metrics()``, ... call them): bytes on
the wire per tensor and per step, the schemes' diagnostics, the routes and ``auto``'s
decisions. They read the codec's tensor book, group book, route table and store; nothing here
posts a collective or reads a tensor on the host.
"""
from . import composite
from .base import StepBytes

__all__ = ["wire_bytes", "bytes_per_step", "sparse_bytes", "metrics", "decisions", "routes"]


def routes(codec) -> dict:
    """``{key: scheme spec}``: the route of every tensor seen so far."""
    return {key: route.text for key, route in codec.table.routes.items()}


def wire_bytes(codec) -> dict:
    """``{key: WireBytes}`` for every tensor seen: bytes per step, per rank, as routed (and
    widened for a TensorFlow group). A bucket group's bytes (:mod:`~hvd_gradcomp.buckets`) are
    shared out among its tensors by size; their sum is the group's."""
    out, groups = {}, codec.groups.groups
    for key, w in _live_wire(codec).items():
        grp = groups.get(key)
        if grp is None:
            out[key] = w
            continue
        total, given = sum(grp.numels), [0, 0]
        for i, (k, n) in enumerate(zip(grp.keys, grp.numels)):
            if i == len(grp.keys) - 1:
                out[k] = type(w)(w.payload - given[0], w.side - given[1], 0)
            else:
                share = type(w)(w.payload * n // total, w.side * n // total, 0)
                given = [given[0] + share.payload, given[1] + share.side]
                out[k] = share
    return out


def _live_wire(codec) -> dict:
    """The wire bytes of the units that send now: a bucket group of an earlier layout (DDP's
    first-step buckets) holds no tensor's bytes any more."""
    wire, book = codec.tensors.wire, codec.groups
    if not book.holders:
        return wire
    live = set(book.holders.values())
    return {k: w for k, w in wire.items() if k in live or k not in book.groups}


def sparse_bytes(codec) -> dict:
    """``{key: bytes}`` of each sparse gradient seen (indices and values this rank handed to
    Horovod's sparse path, as of the last step it was seen); they bypass compression."""
    return {key: codec.frontend.read_sparse(entry)[0] for key, entry in codec.tensors.sparse.items()}


def bytes_per_step(codec) -> StepBytes:
    """:func:`wire_bytes` summed over tensors, plus the sparse gradients' own collectives
    (:class:`~hvd_gradcomp.base.StepBytes`; ``total`` counts everything)."""
    payload = side = collectives = 0
    for w in _live_wire(codec).values():
        payload, side, collectives = payload + w.payload, side + w.side, collectives + w.side_collectives
    sparse = codec.tensors.sparse
    return StepBytes(payload, side, collectives, sum(sparse_bytes(codec).values()), 2 * len(sparse))


def metrics(codec) -> dict:
    """``{key: {name: value}}``: the schemes' per-tensor (per group) diagnostics (tensors, no
    host sync); for ``auto`` its choice, why, and the bytes it saves against fp16; for sparse
    gradients ``sparse_bytes`` / ``sparse_steps`` (ints)."""
    out, store, book, routes_ = {}, codec.store, codec.tensors, codec.table.routes
    for k in book.infos:
        if k in codec.groups.groups and store.has(k):  # a bucket group: its own diagnostics
            out[k] = dict(composite.metrics(codec.groups.scheme_of(k), store.read(k)))
            continue
        if not (store.has(k) and k in routes_):
            continue
        scheme = routes_[k].scheme
        out[k] = dict(composite.metrics(scheme, store.read(k)))
        if scheme.adaptive:
            out[k].update(scheme.explain(k))
            out[k]["bytes_saved"] = 2 * book.infos[k].numel - book.wire[k].payload
    for key, entry in book.sparse.items():
        nbytes, steps = codec.frontend.read_sparse(entry)
        out.setdefault(key, {}).update(sparse_bytes=nbytes, sparse_steps=steps)
    return out


def decisions(codec) -> list:
    """Every ``auto`` decision the codec's tensors took, oldest first (dicts of
    :meth:`hvd_gradcomp.auto.AutoScheme.history_records`); [] without ``auto``."""
    seen, out = set(), []
    for route in codec.table.routes.values():
        scheme = route.scheme
        if scheme.adaptive and id(scheme) not in seen:
            seen.add(id(scheme))
            out.extend(scheme.history_records())
    return out
