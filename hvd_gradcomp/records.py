"""The codec's tensor book: per tensor key, the static facts, the bytes on the wire, a loaded
checkpoint's pending state, the owners sharing a key, the sparse gradients seen.

:class:`TensorBook` is a part of :class:`~hvd_gradcomp.codec.Codec` (its ``tensors``): it
owns those dicts and creates, checks and reads a tensor's own scheme state through the
:class:`~hvd_gradcomp.store.Store` it is handed. Where a bucket group holds a tensor's error
feedback instead: the group book, :mod:`~hvd_gradcomp.buckets`.
"""
import logging

from . import composite
from .base import check_state

__all__ = ["TensorBook", "FieldBag", "SPARSE_WARNING"]

log = logging.getLogger("hvd_gradcomp")

SPARSE_WARNING = ("hvd_gradcomp: {name} has a sparse gradient (PyTorch sparse=True / TensorFlow "
                  "IndexedSlices): Horovod's sparse path sends its indices and values uncompressed, around "
                  "the compressor {spec!r}; bytes_per_step().sparse counts them. Pass "
                  "sparse_as_dense=True to Horovod's optimizer to compress it (as a dense gradient "
                  "of the full table)")


class TensorBook:
    """Per-tensor records of one codec.

    Fields:
        ops: the backend's :class:`~hvd_gradcomp.primitives.Primitives`.
        store: where each key's scheme state lives (:class:`~hvd_gradcomp.store.Store`).
        frontend: the framework's :class:`~hvd_gradcomp.frontend.Frontend` (where a first state
            is built: TensorFlow's outside any graph).
        infos: ``{key: TensorInfo}`` of every tensor (and bucket group) compressed.
        wire: ``{key: WireBytes}`` of the same.
        pending: ``{key: state}`` loaded by ``load_state_dict`` before the key was first seen.
        owners: ``{Horovod key: [owner, ...]}``, in order of first use (a second optimizer or
            variable under one key gets ``key@1``).
        sparse: ``{key: backend entry of (bytes last step, steps)}`` of sparse gradients seen.
    """

    __slots__ = ("ops", "store", "frontend", "infos", "wire", "pending", "owners", "sparse")

    def __init__(self, ops, store, frontend):
        self.ops, self.store, self.frontend = ops, store, frontend
        self.infos, self.wire, self.pending, self.owners, self.sparse = {}, {}, {}, {}, {}

    def key(self, call):
        """The state key of a :class:`~hvd_gradcomp.calls.Call`: its key, kept apart per owner
        (``key@1``, ``key@2``, ... for a second owner); None without a key."""
        key = call.key
        if key is None:
            return None
        if call.owner is not None:
            owners = self.owners.setdefault(key, [])
            for i, owner in enumerate(owners):
                if owner is call.owner:
                    break
            else:
                i = len(owners)
                owners.append(call.owner)
            if i:
                key = f"{key}@{i}"
        return key

    def state_for(self, scheme, info, like):
        """The state under ``info.key``: existing, loaded (``pending``), or freshly made; a
        stateless scheme's empty state is not stored."""
        store = self.store
        if store.has(info.key):
            return store.read(info.key)
        fresh = self.initial_state(scheme, info, like, self.pending.pop(info.key, None))
        if len(fresh):
            store.create(info.key, fresh)
            return store.read(info.key)
        return fresh

    def initial_state(self, scheme, info, like, loaded):
        """``scheme``'s initial state for a tensor, or ``loaded`` (a checkpoint's) checked
        against it and moved to ``like``'s device; built where the frontend says
        (:meth:`~hvd_gradcomp.frontend.Frontend.build_state`). Raises ValueError for a loaded
        state of other fields or shapes."""
        return self.frontend.build_state(lambda at: self._initial(scheme, info, at, loaded), like)

    def _initial(self, scheme, info, like, loaded):
        ops = self.ops
        if loaded is None:
            return scheme.init(ops, info, like)
        fresh = composite.init_like(scheme, ops, info, like, loaded)
        composite.forget(scheme, info.key)
        self.check_loaded(scheme, info.key, loaded, fresh)
        return type(fresh)(*[ops.cast(self.store.to_device(v, like), ops.dtype(f)) for v, f in zip(loaded, fresh)])

    def check_loaded(self, scheme, key, loaded, fresh):
        """Raise ValueError unless ``loaded`` has ``fresh``'s fields and shapes (and what the
        scheme checks itself: :func:`~hvd_gradcomp.composite.check_loaded`)."""
        composite.check_loaded(scheme, key, loaded)
        check_state(loaded, fresh, key)
        for field, a, b in zip(fresh._fields, loaded, fresh):
            if tuple(self.ops.shape(a)) != tuple(self.ops.shape(b)):
                raise ValueError(f"{scheme.name}: loaded state for tensor {key!r} has "
                                 f"{field} of shape {list(self.ops.shape(a))}, expected "
                                 f"{list(self.ops.shape(b))}")

    def note_sparse(self, key, make_entry, spec: str, label=None):
        """The entry of sparse gradient ``key``, created by ``make_entry()`` with a one-time
        warning naming it (``label``, else the key) and the compressor ``spec`` if new."""
        entry = self.sparse.get(key)
        if entry is None:
            log.warning(SPARSE_WARNING.format(name=label or key, spec=spec))
            entry = self.sparse[key] = make_entry()
        return entry


class FieldBag(tuple):
    """A loaded state whose NamedTuple type is not known until the tensor is first seen."""

    def __new__(cls, fields: dict):
        obj = super().__new__(cls, tuple(fields.values()))
        obj._fields = tuple(fields)
        return obj
