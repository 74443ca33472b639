"""Per-tensor records of a compressor, whatever engine sends the payloads (Horovod, DDP).

:class:`TensorRecords` keeps, per tensor key: the static facts (:class:`~hvd_gradcomp.base.TensorInfo`),
the bytes it puts on the wire, and the scheme's state, kept in the compressor's ``store`` (a
:class:`~hvd_gradcomp.store.Store`: plain tensors in PyTorch, ``tf.Variable`` s in TensorFlow); the routes are the
:class:`~hvd_gradcomp.routing.RouteTable`'s (``table``), which :meth:`TensorRecords.route`
feeds with the backend's parameter names and the engine's object gather. It also keeps the
sparse gradients seen, and reports: ``wire_bytes()``, ``bytes_per_step()``, ``metrics()``,
``routes()``, ``decisions()``. A mixin of :class:`hvd_gradcomp.adapter.HorovodCompressor`:
the attributes it reads (``table``, ``ops``, ``spec``, ``_infos``, ``_wire``, ``_pending``,
``_owners``, ``_sparse``) are that class's slots, and ``_from_every_rank`` is its engine's
object gather.
"""
import logging

from . import composite
from .base import StepBytes, check_state

__all__ = ["TensorRecords", "FieldBag"]

log = logging.getLogger("hvd_gradcomp")

_SPARSE_WARNING = ("hvd_gradcomp: {name} has a sparse gradient (PyTorch sparse=True / TensorFlow "
                   "IndexedSlices): Horovod's sparse path sends its indices and values uncompressed, around "
                   "the compressor {spec!r}; bytes_per_step().sparse counts them. Pass "
                   "sparse_as_dense=True to Horovod's optimizer to compress it (as a dense gradient "
                   "of the full table)")


class TensorRecords:
    """Per-tensor bookkeeping (module docstring); the state hooks are the backend's."""

    __slots__ = ()

    # ---- the state store (:class:`~hvd_gradcomp.store.Store`, the compressor's ``store``) ----
    def _read_state(self, key):
        return self.store.read(key)

    def _write_state(self, key, state):
        self.store.write(key, state)

    def _create_state(self, key, state):
        """Store a tensor's first state (TensorFlow's store makes variables here)."""
        self.store.create(key, state)

    def _has_state(self, key) -> bool:
        return self.store.has(key)

    def _drop_state(self, key):
        """Forget the state under ``key`` (its error feedback moved into a bucket group)."""
        self.store.drop(key)

    def _export(self, tensor, portable=False):
        """A host-side copy of a state tensor for state_dict(); ``portable``: an object that
        pickles without the framework's graph or device (for ``gather=True``)."""
        return self.store.export(tensor, portable)

    def _zeros_like(self, value):
        """Zeros of a saved state value's shape and dtype (a reset residual)."""
        return self.store.zeros_like(value)

    def _import(self, value):
        """A saved state value (a tensor, or a NumPy array from a gathered state) as a host
        tensor of the framework."""
        return self.store.load(value)

    def _to_device(self, value, like):
        return self.store.to_device(value, like)

    # ---- backend hooks ----
    def _route_items(self, params):
        """``(name, shape tuple, dtype string, pin)`` per parameter given to :meth:`route`."""
        raise NotImplementedError

    def _read_sparse(self, entry):
        """(bytes last step, steps) of a sparse-gradient entry, as Python ints."""
        return int(entry[0]), int(entry[1])

    # ---- identity, route, state ----
    def _key(self, call):
        """The state key of a call: Horovod's name, kept apart per optimizer/tape; None
        without a name."""
        key = call.key
        if key is None:
            return None
        if call.owner is not None:
            owners = self._owners.setdefault(key, [])
            for i, owner in enumerate(owners):
                if owner is call.owner:
                    break
            else:
                i = len(owners)
                owners.append(call.owner)
            if i:
                key = f"{key}@{i}"
        return key

    def _state_for(self, scheme, info, like):
        """The state under info.key: existing, loaded, or freshly initialised; checked."""
        if self._has_state(info.key):
            return self._read_state(info.key)
        fresh = self._initial_state(scheme, info, like, self._pending.pop(info.key, None))
        if len(fresh):
            self._create_state(info.key, fresh)
            return self._read_state(info.key)
        return fresh

    def _initial_state(self, scheme, info, like, loaded):
        """``scheme``'s initial state for a tensor, or ``loaded`` checked against it.

        TensorFlow overrides this to build it outside any graph (it becomes tf.Variables).
        """
        if loaded is None:
            return scheme.init(self.ops, info, like)
        fresh = composite.init_like(scheme, self.ops, info, like, loaded)
        composite.forget(scheme, info.key)
        self._check_loaded(scheme, info.key, loaded, fresh)
        return type(fresh)(*[self.ops.cast(self._to_device(v, like), self.ops.dtype(f))
                             for v, f in zip(loaded, fresh)])

    def _check_loaded(self, scheme, key, loaded, fresh):
        composite.check_loaded(scheme, key, loaded)
        check_state(loaded, fresh, key)
        for field, a, b in zip(fresh._fields, loaded, fresh):
            if tuple(self.ops.shape(a)) != tuple(self.ops.shape(b)):
                raise ValueError(f"{scheme.name}: loaded state for tensor {key!r} has "
                                 f"{field} of shape {list(self.ops.shape(a))}, expected "
                                 f"{list(self.ops.shape(b))}")

    # ---- routing (the table's; the backend gives the names, the engine the gather) ----
    def route(self, params, check: bool = True) -> list:
        """Decide each parameter's route now, and check that every rank decides alike
        (:meth:`~hvd_gradcomp.routing.RouteTable.route`).

        Needed in TensorFlow when rules match names (variable names may differ between ranks,
        see :mod:`~hvd_gradcomp.routing`): call it on every rank once the model's variables
        exist, before the first step. In PyTorch the routes follow from Horovod's parameter
        names, equal on every rank; ``route()`` then only shows and checks them.

        Args:
            params: PyTorch: ``model.named_parameters()`` (``(name, tensor)`` pairs, the names
                given to ``hvd.DistributedOptimizer``); TensorFlow: ``model.trainable_variables``
                (or ``(name, variable)`` pairs).
            check: compare the ranks' decisions (:meth:`_from_every_rank`: one Horovod
                broadcast per rank; every rank must call ``route()`` then); False decides
                locally, without a collective.

        Returns and raises as :meth:`~hvd_gradcomp.routing.RouteTable.route`: ``[(name,
        scheme spec or None), ...]``; ValueError on every rank if the ranks disagree.
        """
        gather = (lambda table: self._from_every_rank(table, "hvd_gradcomp.route")) if check else None
        return self.table.route(self._route_items(params), gather)

    def routes(self) -> dict:
        """``{key: scheme spec}``: the route of every tensor seen so far."""
        return {key: route.text for key, route in self.table.routes.items()}

    # ---- reporting ----
    def wire_bytes(self) -> dict:
        """``{key: WireBytes}`` for every tensor seen: bytes per step, per rank, as routed
        (and widened for a TensorFlow group, see the module docstring). A bucket group's bytes
        (:mod:`~hvd_gradcomp.buckets`) are shared out among its tensors by size; their sum is
        the group's."""
        out = {}
        for key, w in self._live_wire().items():
            grp = self._groups.get(key)
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

    def _live_wire(self) -> dict:
        """``_wire`` of the units that send now: a bucket group of an earlier layout (DDP's
        first-step buckets) holds no tensor's bytes any more (:mod:`~hvd_gradcomp.buckets`)."""
        if not self._holders:
            return self._wire
        live = set(self._holders.values())
        return {k: w for k, w in self._wire.items() if k in live or k not in self._groups}

    def sparse_bytes(self) -> dict:
        """``{key: bytes}`` of each sparse gradient seen (indices and values this rank handed
        to Horovod's sparse path, as of the last step it was seen); they bypass compression."""
        return {key: self._read_sparse(entry)[0] for key, entry in self._sparse.items()}

    def bytes_per_step(self) -> StepBytes:
        """:meth:`wire_bytes` summed over tensors, plus the sparse gradients' own collectives
        (:class:`~hvd_gradcomp.base.StepBytes`; ``total`` counts everything)."""
        payload = side = collectives = 0
        for w in self._live_wire().values():
            payload, side, collectives = payload + w.payload, side + w.side, collectives + w.side_collectives
        return StepBytes(payload, side, collectives, sum(self.sparse_bytes().values()), 2 * len(self._sparse))

    def metrics(self) -> dict:
        """``{key: {name: value}}``: the schemes' per-tensor diagnostics (tensors, no host
        sync), and for sparse gradients ``sparse_bytes`` / ``sparse_steps`` (ints)."""
        out = {}
        for k in self._infos:
            if k in self._groups and self._has_state(k):  # a bucket group: its own diagnostics
                out[k] = dict(composite.metrics(self._group_scheme(k), self._read_state(k)))
                continue
            if not (self._has_state(k) and k in self.table.routes):
                continue
            scheme = self.table.routes[k].scheme
            out[k] = dict(composite.metrics(scheme, self._read_state(k)))
            if scheme.adaptive:  # auto: its choice, why, and the bytes it saves against fp16
                out[k].update(scheme.explain(k))
                info = self._infos[k]
                out[k]["bytes_saved"] = 2 * info.numel - self._wire[k].payload
        for key, entry in self._sparse.items():
            nbytes, steps = self._read_sparse(entry)
            out.setdefault(key, {}).update(sparse_bytes=nbytes, sparse_steps=steps)
        return out

    def decisions(self) -> list:
        """Every ``auto`` decision this compressor's tensors took, oldest first (dicts of
        :meth:`hvd_gradcomp.auto.AutoScheme.history_records`); [] without ``auto``."""
        seen, out = set(), []
        for route in self.table.routes.values():
            scheme = route.scheme
            if scheme.adaptive and id(scheme) not in seen:
                seen.add(id(scheme))
                out.extend(scheme.history_records())
        return out

    def _note_sparse(self, key, make_entry, label=None):
        """The entry of sparse gradient ``key``, created by ``make_entry()`` with a one-time
        warning naming it (``label``, else the key) if new."""
        entry = self._sparse.get(key)
        if entry is None:
            log.warning(_SPARSE_WARNING.format(name=label or key, spec=self.spec))
            entry = self._sparse[key] = make_entry()
        return entry


class FieldBag(tuple):
    """A loaded state whose NamedTuple type is not known until the tensor is first seen."""

    def __new__(cls, fields: dict):
        obj = super().__new__(cls, tuple(fields.values()))
        obj._fields = tuple(fields)
        return obj

